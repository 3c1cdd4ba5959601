"""Continuous-batching scheduler with one token-budget rule (vLLM v1's design).

There are no prefill and decode phases. Each step, every request is owed
``num_tokens - num_computed_tokens`` tokens of computation; the scheduler hands out new
tokens under a budget of ``max_num_batched_tokens`` per step and at most ``max_num_seqs``
running requests. Requests are ordered by ``(priority, arrival)``: a lower priority value
runs first, first come first served within a level.

1. Running requests first — decodes (one token owed) before prefill chunks, each in
   priority order, so decodes keep flowing while a long prompt is chunked. When the pool is
   short of blocks the KV manager first evicts unused prefix-cache blocks (LRU); only if
   that is not enough does the scheduler free the blocks of forked samples still waiting,
   then preempt the running request that comes last in ``(priority, arrival)`` order (its
   computed full blocks go to the prefix cache, its blocks are released and its
   ``num_computed_tokens`` reset; when it comes back it is recomputed from prompt + output
   so far — hitting the cache it left behind where that is still there — which leaves its
   output unchanged).
2. Then waiting requests in ``(priority, arrival)`` order, as long as budget, sequence
   slots and blocks allow; admission looks up the prefix cache (a hit simply advances
   ``num_computed_tokens``). None is admitted in a step whose running requests had to be
   preempted. A waiting request that does not fit may preempt running requests of strictly
   lower priority (higher value), never requests of its own level.

Fair share between users (``Request.user``: the OpenAI ``user`` field or the API key; None is
one anonymous user): with requests of two or more users present, each user's fair share is
``max_num_seqs // users`` sequence slots. Within a priority level the next waiting request is
that of the user running the fewest sequences (FCFS within a user), and a waiting request of a
user below its share that finds no slot (or no blocks) preempts the last sequence of the user
furthest above its share (never a request of a higher priority); when blocks run short, the
victim is taken from a user above its share first. So one user's burst (``n=128``, or a flood
of requests) cannot hold every slot while another user waits. With one user nothing of this
applies and the order is as above.

A slot is not the whole cost, though: a step's time grows with its batch (on a CPU a decode step
of 128 sequences takes ~10x one of 8), so a user holding half of 128 slots still makes another
user's tokens ~10x slower. ``max_num_seqs_per_user`` (off by default) caps the sequences one
user runs at once, alone or not: the rest of its samples and requests wait (FCFS), and nobody
else's steps grow beyond the other users' sequences plus the cap. (A cap applied only while
another user is present would thrash: the burst grows back between two requests of the other
user, re-prefilling its samples in large steps that the next request then waits behind.)

Beam search: the beams of a group extend together (each step waits for all of them), so
they are preempted together, and a beam whose group is running is admitted without the
watermark below. If every running request waits for beams that do not fit, the last group
is preempted, so that one group at a time gathers its beams.

Admission watermark: while any request is running, a new request is admitted only if
``watermark_blocks = ceil(watermark · num_blocks)`` blocks (default 1 %) stay available
(free or evictable) after its first chunk's blocks are taken, so that a flood of long
prompts cannot take the last blocks that running decodes need to grow (which would turn
into preemption thrash). With nothing running the watermark does not apply, so a request
as large as the whole pool can still run.

A prompt longer than the budget is simply chunked over several steps.

Swap (``preemption_mode="swap"``, :mod:`kvserve.core.kv_swap`): a preempted request's computed
blocks are first copied to the host pool (then freed as above), and when it is admitted again
it gets fresh blocks, its K/V copied back and its ``num_computed_tokens`` restored: it decodes
on with no prefill. A swap-in is an admission (a sequence slot, its owed tokens from the
budget, the watermark); a step swaps in at most ``max_num_batched_tokens // block_size``
blocks (the blocks a prefill of the whole budget would write) but always at least one request,
so a long context still comes back (the requests behind it wait for the next step: FCFS).
Beam-search groups are recomputed (their beams share blocks copy-on-write: swapped apart, each
beam would need its own copy of the shared ones), and so is a victim the host pool cannot hold
or one that has freed blocks before its sliding window; a swapped request that cannot be
swapped in while nothing else runs drops its host copy and is recomputed: none waits forever.
With a 2-/4-bit cache a victim's partial last block moves with its residual slot (a host
residual slot, then a device slot its new block gets; a victim when none is free is recomputed).

Speculative decoding: a decoding request may carry draft tokens (``spec_token_ids``); it
is then owed its last token plus the drafts, verified in one multi-token chunk. Drafts
are trimmed to the budget left and to the slots its block table and the empty blocks
hold: they never evict cached blocks or preempt another request.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import FREED_BLOCK, KVCacheManager
from kvserve.core.kv_ops import KVCacheOps
from kvserve.core.kv_swap import KVSwapSpace
from kvserve.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: (request, number of new tokens to compute) in batch order.
        preempted: requests preempted in this step.
        kv_ops: the block copies and swaps recorded since the last forward (this step's
            swap-outs, swap-ins and partial prefix-cache copies, and the forks and beam clones
            of the steps before), which every worker applies to its pools, in order, before
            this step's forward (:mod:`kvserve.core.kv_ops`); the engine core fills it once the
            step is scheduled (:meth:`kvserve.engine.core.EngineCore._schedule`).
        num_batched_tokens: sum of the new tokens.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_ops: KVCacheOps = field(default_factory=KVCacheOps)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: budget and limits.
        kv: the KV cache manager (block tables, pool and prefix cache).
        watermark: fraction of the pool's blocks kept available when admitting new
            requests while others run (see the module docstring); 0 disables it.
        swap: the host pool to swap preempted requests' KV to (``preemption_mode="swap"``);
            None recomputes them.

    Raises:
        ValueError: if ``watermark`` is not in ``[0, 1)``.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, watermark: float = 0.01,
                 swap: KVSwapSpace | None = None) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.config = config
        self.kv = kv
        self.watermark = watermark
        self.watermark_blocks = math.ceil(watermark * kv.num_blocks)
        self.waiting: list[Request] = []  # sorted by (priority, arrival_index)
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0  # all preemptions (out of blocks or by priority)
        self.num_priority_preemptions = 0  # of those, to admit a higher-priority request
        self.num_chunked_prefills = 0
        self.num_fair_preemptions = 0  # of those, to give a user below its fair share a slot
        self._waiting_users: Counter = Counter()  # user -> waiting sequences
        self.swap = swap
        self.max_swap_in_blocks = max(1, config.max_num_batched_tokens // kv.block_size)  # per step

    # ------------------------------------------------------------------ queue
    @staticmethod
    def _order(req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_index)

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        keys = [self._order(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._order(req)), req)
        self._waiting_users[req.user] += 1

    def num_waiting_to_start(self) -> int:
        """The requests waiting that have not started: groups none of whose sequences has been
        scheduled yet (not preempted requests, not the forked samples of a started group), the
        count ``max_waiting`` bounds."""
        return sum(1 for r in self.waiting if r.sample_index == 0 and r.metrics.first_scheduled_time is None)

    def _pop_waiting(self, index: int) -> Request:
        req = self.waiting.pop(index)
        self._waiting_users[req.user] -= 1
        if not self._waiting_users[req.user]:
            del self._waiting_users[req.user]
        return req

    # ------------------------------------------------------------ fair share
    def _fair_share(self) -> tuple[Counter, int]:
        """``(running sequences per user, fair share in slots)``; a share of 0 when fewer than two
        users have requests (fairness does not apply)."""
        running = Counter(r.user for r in self.running)
        users = set(running) | set(self._waiting_users)
        if len(users) < 2:
            return running, 0
        return running, max(1, self.config.max_num_seqs // len(users))

    def _next_waiting(self) -> int | None:
        """Index in ``waiting`` of the request to admit next: the first of the best priority
        level, or with several users, the first of that level whose user runs the fewest
        sequences; requests of users at ``max_num_seqs_per_user`` are passed over (None when
        every waiting request's user is at it)."""
        running, share = self._fair_share()
        cap = self.config.max_num_seqs_per_user
        level = best = None
        best_count = 0
        for i, r in enumerate(self.waiting):
            if cap and running[r.user] >= cap:
                continue
            if best is None:
                level, best, best_count = r.priority, i, running[r.user]
                if not share:
                    break
            elif best_count == 0 or r.priority != level:
                break
            elif running[r.user] < best_count:
                best, best_count = i, running[r.user]
        return best

    def _preempt_over_share(self, req: Request, out: SchedulerOutput) -> bool:
        """For ``req``, whose user runs fewer sequences than its fair share: preempt the last
        sequence (of ``req``'s priority or lower) of the user furthest above its share."""
        running, share = self._fair_share()
        if not share or running[req.user] >= share:
            return False
        over = [u for u, n in running.items() if n > share and u != req.user]
        if not over:
            return False
        user = max(over, key=lambda u: running[u])
        victims = [r for r in self.running if r.user == user and r.priority >= req.priority]
        if not victims:
            return False
        self._preempt(max(victims, key=self._order), out)
        self.num_fair_preemptions += 1
        return True

    def _victim(self) -> Request:
        """The running request to preempt when blocks run short: the last in ``(priority,
        arrival)`` order, of a user above its fair share where there is one."""
        running, share = self._fair_share()
        if not share:
            return max(self.running, key=self._order)
        return max(self.running, key=lambda r: (r.priority, running[r.user] > share, r.arrival_index))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (finished, aborted or failed) and free its blocks.

        Its computed full blocks stay in the prefix cache, except after an error.
        """
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._pop_waiting(self.waiting.index(req))
        self.kv.free(req, cache=status is not RequestStatus.FINISHED_ERROR)
        if self.swap is not None:
            self.swap.discard(req.request_id)  # (an aborted request swapped out)

    def _running_beams(self, req: Request) -> list[Request]:
        """The running beams of ``req``'s beam-search group (``req`` included if it runs);
        for another request, ``[req]`` if it runs."""
        if not req.sampling_params.use_beam_search:
            return [req] if req in self.running else []
        return [r for r in self.running if r.parent_id == req.parent_id]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt a running request, and with a beam its whole group (beams extend together:
        one left running would wait for the others while holding their room); returns the
        tokens they had been given in this step."""
        return sum(self._preempt_one(r, out) for r in self._running_beams(victim))

    def _preempt_one(self, victim: Request, out: SchedulerOutput) -> int:
        self.running.remove(victim)
        taken = 0
        for j, (r, n) in enumerate(out.scheduled):
            if r is victim:  # already planned this step: take its tokens back
                taken = n
                del out.scheduled[j]
                break
        self._swap_out(victim)
        swapped = self.swap is not None and victim.request_id in self.swap.swapped
        # computed full blocks are cached first: resumption may hit them; a swapped request keeps
        # its compression state (dropped tokens, the workers' scores), a recomputed one restarts it
        self.kv.free(victim, keep_scores=swapped)
        victim.num_computed_tokens = 0
        if not swapped:
            victim.num_dropped_tokens = 0
            victim.kv_prompt_compressed = False
        victim.clear_spec()  # (drafts are proposed again once it decodes)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.add_request(victim)
        victim.status = RequestStatus.PREEMPTED
        return taken

    def _swap_out(self, victim: Request) -> None:
        """With a swap space, copy the victim's computed blocks to the host pool (it keeps its
        ``num_computed_tokens`` there; with a 2-/4-bit cache its partial last block's residual slot
        too); a beam, a victim the pool cannot hold (blocks, or a host residual slot), or one that
        has freed blocks before its sliding window (their K/V is gone), is recomputed."""
        if self.swap is None or victim.sampling_params.use_beam_search or victim.num_computed_tokens == 0:
            return
        table = self.kv.block_tables.get(victim.request_id, [])
        blocks = table[: self.kv.blocks_needed(victim.num_kv_tokens)]  # (not this step's new slots)
        if FREED_BLOCK in blocks:
            self.swap.num_swap_fallbacks += 1
            return
        slot = None
        if self.kv.residual is not None and victim.num_kv_tokens % self.kv.block_size:
            slot = int(self.kv.residual.map[blocks[-1]])  # (2-/4-bit: the partial last block's rows)
            if slot < 0:  # (cannot happen: a partial block holds a slot; recompute rather than lose rows)
                self.swap.num_swap_fallbacks += 1
                return
        self.swap.swap_out(victim.request_id, blocks, victim.num_computed_tokens, slot)

    def _swap_in(self, req: Request, budget: int, headroom: int) -> int:
        """Bring a swapped request back: fresh blocks for its computed tokens plus its next
        chunk, its K/V copied in, ``num_computed_tokens`` restored. Returns the tokens scheduled,
        0 when the blocks do not fit (nothing changed)."""
        assert self.swap is not None
        s = self.swap.swapped[req.request_id]
        num_new = min(req.num_tokens - s.num_computed_tokens, budget)
        table = self.kv.admit_swapped(req, s.num_computed_tokens, num_new, headroom)
        if table is None:
            return 0
        slot = None
        if s.host_residual is not None:  # (2-/4-bit: the partial last block's rows into its new residual slot)
            slot = int(self.kv.residual.map[table[len(s.host_blocks) - 1]])
        req.num_computed_tokens = self.swap.swap_in(req.request_id, table, slot)
        return num_new

    def _release_waiting_blocks(self, keep: Request | None = None) -> bool:
        """Free the blocks of waiting requests that hold some (forked samples); they will be
        admitted again through the prefix cache. Returns whether any were freed."""
        freed = False
        for r in self.waiting:
            if r is not keep and self.kv.has_blocks(r):
                self.kv.free(r)
                r.num_computed_tokens = 0
                freed = True
        return freed

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        ordered = sorted(self.running, key=self._order)
        decodes = [r for r in ordered if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in ordered if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            owed = req.num_tokens - req.num_computed_tokens
            num_new = min(owed, budget)
            if req.spec_token_ids:
                num_new += self._schedule_drafts(req, budget - 1 if owed == 1 else 0)
            while not self.kv.allocate_slots(req, num_new):  # (evicts cached blocks first)
                if self._release_waiting_blocks():
                    continue
                budget += self._preempt(self._victim(), out)
                if req.status is not RequestStatus.RUNNING:  # req itself, or its beam group
                    num_new = 0
                    break
            if num_new == 0:
                continue
            self._plan(req, num_new, out)
            budget -= num_new
        if out.preempted:
            return out
        self._admit(out, budget)
        if out.is_empty and self.running and self.waiting:
            # Every running request waits for beams still waiting, which do not fit: preempt
            # the last group so that one group at a time can gather its beams (validation
            # ensures that any one group fits the pool alone).
            self._preempt(max(self.running, key=self._order), out)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while budget, sequence slots and blocks allow."""
        swapped_in = 0  # blocks swapped in this step
        while self.waiting and budget > 0:
            index = self._next_waiting()
            if index is None:  # every waiting request's user runs its max_num_seqs_per_user
                break
            req = self.waiting[index]
            swap_blocks = self.swap.num_blocks_of(req.request_id) if self.swap is not None else 0
            if swap_blocks and swapped_in and swapped_in + swap_blocks > self.max_swap_in_blocks:
                break  # this step's swap-in allowance is spent: it comes back next step
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_lower_priority(req, out) or self._preempt_over_share(req, out):
                    budget = self.config.max_num_batched_tokens - out.num_batched_tokens
                    continue
                break
            # (no watermark for a beam whose group runs: the group cannot move without it)
            headroom = self.watermark_blocks if self.running and not self._running_beams(req) else 0
            if swap_blocks:
                num_new = self._swap_in(req, budget, headroom)
                swapped_in += swap_blocks if num_new else 0
            else:
                num_new = self.kv.admit(req, budget, headroom)
            if num_new == 0:
                if self._preempt_lower_priority(req, out) or self._preempt_over_share(req, out):
                    budget = self.config.max_num_batched_tokens - out.num_batched_tokens
                    continue
                if not self.running and self._release_waiting_blocks(keep=req):
                    continue
                if swap_blocks and not self.running:
                    # its blocks cannot come back even with nothing else running: recompute it
                    self.swap.discard(req.request_id)  # type: ignore[union-attr]
                    self.swap.num_swap_drops += 1  # type: ignore[union-attr]
                    if req.num_dropped_tokens or req.kv_prompt_compressed:  # its compression restarts
                        req.num_dropped_tokens, req.kv_prompt_compressed = 0, False
                    if req.kv_compression is not None and req.kv_compression.uses_scores:
                        self.kv.ops.forget(req.request_id)
                    continue
                break
            self._pop_waiting(index)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.sampling_params.prompt_logprobs is not None and req.prompt_logprobs:
                # keep the logprobs of positions < num_computed_tokens (the first entry is
                # None); a resumed request recomputes the rest and must not repeat them
                del req.prompt_logprobs[req.num_computed_tokens + 1 :]
            self._plan(req, num_new, out)
            budget -= num_new

    def _schedule_drafts(self, req: Request, room: int) -> int:
        """Keep as many of a decoding request's draft tokens as fit in ``room`` budget tokens
        and in its block table plus the empty blocks (drafts never evict cached blocks nor
        preempt anything), allocate their slots, and drop the rest; returns the number kept."""
        bs = self.kv.block_size
        table = self.kv.block_tables.get(req.request_id, [])
        slots = (len(table) + self.kv.num_empty_blocks) * bs - (req.num_kv_tokens + 1)
        d = max(0, min(len(req.spec_token_ids), room, slots))
        if d and not self.kv.allocate_slots(req, 1 + d):  # (cannot fail: only empty blocks are taken)
            d = 0
        if d < len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:d]
            if req.spec_draft_probs is not None:
                req.spec_draft_probs = req.spec_draft_probs[:d] if d else None
        return d

    def _plan(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        if num_new < req.num_tokens - req.num_computed_tokens:
            self.num_chunked_prefills += 1
        out.scheduled.append((req, num_new))

    def _preempt_lower_priority(self, req: Request, out: SchedulerOutput) -> bool:
        """Preempt the last running request if its priority is strictly lower than ``req``'s."""
        if not self.running:
            return False
        victim = max(self.running, key=self._order)
        if victim.priority <= req.priority:
            return False
        self._preempt(victim, out)
        self.num_priority_preemptions += 1
        return True
