"""Continuous-batching scheduler with one token-budget rule (vLLM v1's design).

There are no prefill and decode phases. Each step, every request is owed
``num_tokens - num_computed_tokens`` tokens of computation; the scheduler hands out new
tokens under a budget of ``max_num_batched_tokens`` per step and at most ``max_num_seqs``
running requests:

1. Running requests first — decodes (one token owed) before prefill chunks, so decodes keep
   flowing while a long prompt is chunked. If the pool has no block for a running request,
   the most recently admitted running request is preempted (its blocks freed, its
   ``num_computed_tokens`` reset; it is recomputed later from prompt + output so far, which
   leaves its output unchanged).
2. Then waiting requests in (priority, arrival) order, as long as budget, sequence slots and
   blocks allow; none is admitted in a step that had to preempt.

A prompt longer than the budget is simply chunked over several steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv_cache import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: (request, number of new tokens to compute) in batch order.
        preempted: requests preempted in this step.
        num_batched_tokens: sum of the new tokens.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
        kv: the KV cache manager (block tables and the pool).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival_index)
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.num_chunked_prefills = 0

    # ------------------------------------------------------------------ queue
    @staticmethod
    def _order(req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_index)

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        keys = [self._order(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._order(req)), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (finished, aborted or failed) and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.add_request(victim)
        victim.status = RequestStatus.PREEMPTED

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                for j, (r, n) in enumerate(out.scheduled):
                    if r is victim:  # already planned this step: take its tokens back
                        budget += n
                        del out.scheduled[j]
                        break
                self._preempt(victim, out)
                if victim is req:
                    num_new = 0
                    break
            if num_new == 0:
                continue
            if num_new < req.num_tokens - req.num_computed_tokens:
                self.num_chunked_prefills += 1
            out.scheduled.append((req, num_new))
            budget -= num_new
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, num_new):
                break
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if num_new < req.num_tokens - req.num_computed_tokens:
                self.num_chunked_prefills += 1
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out
