"""LLMEngine: the generation loop.

``step()`` is the whole loop — schedule → run the model → sample → update requests
(stop checks, detokenization) → emit outputs. Offline :class:`kvserve.entrypoints.llm.LLM` calls it until
every request finished; the server runs it in a background thread.

A user request with ``n`` (or ``best_of``) > 1 becomes a group of sequences: the first
computes the prompt; the others are forked from it once its prompt is computed (they share
its full KV blocks, copy the partial one and compute only the last prompt token), so the
prompt is computed once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import numbers
import os
import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from kvserve.worker import kv_quant
from kvserve.worker.attention import default_backend
from kvserve.sample.beam_search import BeamSearchState
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.core.kv_cache_manager import KVCacheManager, allocate_kv_cache, plan_kv_cache
from kvserve.core.kv_swap import KVSwapSpace, check_swap_options, num_host_blocks
from kvserve.worker.layers.linear import QUANTIZATIONS
from kvserve.worker.loader import load_model_config, load_weights, resolve_model_path
from kvserve.worker.model_runner import ModelRunner, ModelRunnerOutput, SpecResult
from kvserve.worker.models import model_class
from kvserve.core.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    TokenLogprob,
)
from kvserve.sample.sampler import sample_seed
from kvserve.sampling_params import SamplingParams, require_utf8
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.structured_output.manager import GrammarLimitError, StructuredOutputManager
from kvserve.spec_decode import NgramProposer, SpeculativeConfig
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.engine.input_processor import EngineCoreRequest, InputProcessor
from kvserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

from kvserve.engine.args import DTYPES, MAX_KV_CACHE_GIB, EngineArgs, parse_device, parse_dtype  # noqa: F401



class RequestGroup:
    """The sequences of one user request (n / best_of samples, or the live beams)."""

    def __init__(self, request_id: str, params: SamplingParams, seqs: list[Request],
                 beam: Optional[BeamSearchState] = None) -> None:
        self.request_id = request_id
        self.params = params
        self.seqs = seqs
        self.pending_forks: list[Request] = seqs[1:]
        self.beam = beam
        self.beam_rows: dict[str, tuple[list[int], list[float]]] = {}

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The serving engine: requests in, :class:`RequestOutput` per step out.

    Raises at construction:
        ModelNotFoundError: the model path does not exist / default model not installed.
        ModelLoadError: the file is corrupt.
        UnsupportedModelError: the architecture is not implemented.
        ValueError: a bad engine argument.
    """

    def __init__(self, args: EngineArgs) -> None:
        args.check()  # before the model loads, which takes a while
        self.args = args
        self.dtype = parse_dtype(args.dtype)
        self.device = parse_device(args.device)
        path = resolve_model_path(args.model)
        t0 = time.perf_counter()
        cfg = load_model_config(path)  # checks that need only the config come before the weights
        kv_quant.check_head_dim(cfg.head_dim, args.kv_cache_dtype)
        self.kv_cache_dtype = kv_quant.storage_dtype(args.kv_cache_dtype, self.dtype)
        if args.max_model_len is not None and not 2 <= args.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's context length), "
                f"got {args.max_model_len}"
            )
        cfg, state = load_weights(path)
        self.model_config: ModelConfig = cfg
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        # Every layer windowed (Mistral v0.1): the blocks before the window are freed as a
        # request advances (kv_cache.KVCacheManager), so a sequence of any length runs in about
        # window / block_size blocks. The radix prefix cache keeps a running request's whole
        # prefix locked, which would pin those blocks: prefix caching is off for such models.
        window = cfg.uniform_window
        prefix_caching = args.enable_prefix_caching
        if window is not None and prefix_caching:
            logger.warning("prefix caching is off: every layer of this model has a sliding window (%d tokens), "
                           "and the blocks before it are freed while a request runs", window)
            prefix_caching = False
        self.max_model_len = max_len
        backend = default_backend(self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.model = model_class(cfg.architecture)(cfg, backend, self.dtype, self.device, max_positions=max_len)
        self.model.load_weights(state, quantization=args.quantization)
        del state
        self.model.eval()
        self.cache_config = CacheConfig(args.block_size, args.kv_cache_memory, args.num_blocks, prefix_caching)
        self.kv_spec = plan_kv_cache(cfg, self.kv_cache_dtype, args.kv_cache_memory, args.block_size, max_len, args.num_blocks)
        logger.info(self.kv_spec.describe())
        if self.kv_spec.capacity_tokens < max_len and (window is None or self.kv_spec.num_blocks < -(
                -(window - 1 + args.max_num_batched_tokens) // args.block_size) + 1):
            logger.warning("the KV cache holds %d tokens, less than one sequence of max_model_len=%d: a request's "
                           "prompt + max_tokens must fit in %d tokens (raise kv_cache_memory to lift this)",
                           self.kv_spec.capacity_tokens, max_len, self.kv_spec.capacity_tokens)
        self.kv_caches = allocate_kv_cache(cfg, self.kv_spec, self.kv_cache_dtype, self.device)
        self.kv = KVCacheManager(self.kv_spec.num_blocks, args.block_size, prefix_caching,
                                 self.kv_caches, namespace_model=str(path), sliding_window=window)
        self.scheduler_config = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, max_len, args.max_waiting)
        self.preemption_mode = check_swap_options(args.swap_space, args.preemption_mode)
        self.swap: Optional[KVSwapSpace] = None
        if self.preemption_mode == "swap":
            self.swap = KVSwapSpace(self.kv_caches, num_host_blocks(args.swap_space, self.kv_spec.bytes_per_token,
                                                                    args.block_size))
            logger.info("swap space: %d host blocks of %d tokens (%.2f GiB%s)", self.swap.num_blocks,
                        args.block_size, self.swap.num_blocks * self.swap.block_bytes / (1 << 30),
                        ", pinned" if self.swap.pin else "")
        self.scheduler = Scheduler(self.scheduler_config, self.kv, swap=self.swap)
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv.block_tables, args.block_size, self.device,
                                  sliding_window=window)
        self.eos_token_ids = tuple(cfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        if cfg.architecture == "Gemma3ForCausalLM":
            # Gemma ends a chat turn with <end_of_turn> (its generation_config lists [1, 106]);
            # a GGUF names only <eos>
            eot = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
            if isinstance(eot, int) and eot != self.tokenizer.unk_token_id and eot not in self.eos_token_ids:
                self.eos_token_ids += (eot,)
        self.input_processor = InputProcessor(cfg, self.tokenizer, max_len)
        self.structured_output = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_to_group: dict[str, RequestGroup] = {}
        self._rng = random.Random(args.seed)
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (excludes cache hits)
        self.num_generated_tokens = 0
        self.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        self.proposer: Optional[NgramProposer | DraftModelProposer] = None
        sc = self.speculative_config
        if sc is not None and sc.method == "ngram":
            self.proposer = NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
        elif sc is not None:
            self.proposer = DraftModelProposer(sc.model, sc.num_speculative_tokens, cfg, self.tokenizer, self.dtype,
                                               self.device, self.kv_spec.num_blocks, args.block_size, max_len)
        self.spec_num_drafts = 0  # verifications with at least one draft
        self.spec_num_draft_tokens = 0  # drafts verified
        self.spec_num_accepted_tokens = 0  # drafts accepted
        self.spec_num_grammar_cut_tokens = 0  # drafts dropped before verification: after one the grammar rejects
        self.load_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt (:meth:`InputProcessor.encode`)."""
        return self.input_processor.encode(prompt)

    def truncate_prompt(self, ids: list[int], text: Optional[str], k: Optional[int]) -> tuple[list[int], Optional[str]]:
        """``truncate_prompt_tokens`` applied to a prompt (:meth:`InputProcessor.truncate_prompt`)."""
        return self.input_processor.truncate_prompt(ids, text, k)

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a request against the model and the pool; return its resolved max_tokens.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt or
                prompt + max_tokens longer than ``max_model_len``, a request larger than
                the whole KV pool, or more beams than ``max_num_seqs``.
            QueueFullError: the waiting queue holds ``max_waiting`` requests.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[0]!r}")
        params.check_token_ids(vocab)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, but max_model_len is {self.max_model_len}: it must be at most "
                f"{self.max_model_len - 1} tokens to leave room for one generated token"
            )
        # no max_tokens: up to the context window, or to what the whole KV pool holds if less
        budget = self.args.max_num_batched_tokens
        limit = (self.max_model_len if self.kv.blocks_to_run(self.max_model_len, budget) <= self.kv.num_blocks
                 else min(self.max_model_len, self.kv_spec.capacity_tokens))
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, limit - n)
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})")
        if params.allowed_token_ids is not None:  # some allowed token must stay sampleable
            allowed = set(params.allowed_token_ids)
            banned = {w[0] for w in params.bad_words or () if len(w) == 1}
            if allowed <= banned:
                raise ValueError("allowed_token_ids: every allowed token is a one-token bad_words entry, "
                                 "so no token could ever be sampled")
            ends = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if params.min_tokens > 0 and allowed <= banned | ends:
                raise ValueError(
                    f"allowed_token_ids: every allowed token is banned by bad_words or is a stop/EOS token, "
                    f"which min_tokens={params.min_tokens} forbids for the first {params.min_tokens} tokens")
        need = self.kv.blocks_to_run(n + max_tokens, budget)  # (a sliding window bounds it)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt + max_tokens = {n + max_tokens} tokens needs {need} KV blocks, but the whole "
                f"KV cache has {self.kv.num_blocks} blocks ({self.kv_spec.capacity_tokens} tokens)"
            )
        if params.use_beam_search and params.beam_width > self.args.max_num_seqs:
            # the beams run side by side: a group wider than the running-sequence limit could
            # never gather its beams again once preempted
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs={self.args.max_num_seqs}: "
                             f"every beam of a group runs at once")
        if params.use_beam_search and params.beam_width > 1:
            # Every beam extends each step, so all of them hold their KV side by side (the
            # prompt's full blocks shared, the rest each beam's own). The samples of n /
            # best_of need not: they are preempted and resumed one by one like requests.
            # (without prefix caching a preempted group recomputes each beam's prompt apart)
            shared = n // self.kv.block_size if self.kv.cache is not None else 0
            group_need = shared + params.beam_width * (need - shared)
            if group_need > self.kv.num_blocks:
                raise ValueError(
                    f"beam_width={params.beam_width} beams of prompt + max_tokens = {n + max_tokens} tokens need "
                    f"{group_need} KV blocks side by side, but the whole KV cache has {self.kv.num_blocks} blocks "
                    f"({self.kv_spec.capacity_tokens} tokens)"
                )
        if self.args.max_waiting and len(self.scheduler.waiting) >= self.args.max_waiting:
            raise QueueFullError(f"the waiting queue is full (max_waiting={self.args.max_waiting})")
        return max_tokens

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
    ) -> str:
        """Queue a request; returns its id.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            params: sampling parameters (default: ``SamplingParams()``).
            request_id: unique id (generated when None); any string: the engine's own
                sequence ids (``Request.request_id``) cannot collide with it.
            priority: lower runs first (an integer).
            cache_salt: tenant key for prefix-cache isolation.

        Raises:
            ValueError: invalid prompt or params (see :meth:`validate_request`), a
                ``request_id`` in use or not a string, a ``priority`` that is not an integer;
                the engine and every other request are unaffected.
        """
        return self.add_core_request(self.input_processor.process(prompt, params, request_id, priority, cache_salt))

    def add_core_request(self, request: EngineCoreRequest) -> str:
        """Queue a request already processed by :meth:`InputProcessor.process`; returns its id.

        Raises:
            ValueError: see :meth:`validate_request`, or a ``request_id`` in use.
            QueueFullError: the waiting queue is full.
        """
        ids, text, params = request.prompt_token_ids, request.prompt, request.sampling_params
        request_id, priority, cache_salt = request.request_id, request.priority, request.cache_salt
        params.max_tokens = self.validate_request(ids, params)  # (the request's own copy)
        if params.structured_outputs is not None:  # compiled (or found in the cache) now: errors are the request's
            self.structured_output.compile(params.structured_outputs)
        rid = request_id
        while rid is None or (request_id is None and rid in self.groups):  # (a user may have taken it)
            rid = f"req-{next(self._ids)}"
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        arrival = next(self._arrivals)
        seqs = []
        for i in range(1 if params.use_beam_search else params.num_samples):
            seed = sample_seed(params.seed, i) if params.seed is not None else self._rng.getrandbits(63)
            seq = Request(
                request_id=self._seq_id(rid),
                prompt_token_ids=ids,
                sampling_params=params,
                seed=seed,
                eos_token_ids=self.eos_token_ids,
                prompt=text,
                priority=int(priority),
                cache_salt=cache_salt,
                arrival_index=arrival,
                parent_id=rid,
                sample_index=i,
            )
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
            if params.structured_outputs is not None:  # each sample follows the grammar on its own
                seq.grammar = self.structured_output.new_grammar(params.structured_outputs)
            seqs.append(seq)
        beam = None
        if params.use_beam_search:
            beam = BeamSearchState(params.beam_width, params.max_tokens, params.length_penalty,
                                   () if params.ignore_eos else self.eos_token_ids)
        group = RequestGroup(rid, params, seqs, beam)
        self.scheduler.add_request(seqs[0])
        self.groups[rid] = group
        for s in seqs:
            self._seq_to_group[s.request_id] = group
        return rid

    def _seq_id(self, request_id: str) -> str:
        """A new sequence id ``"{request_id}#{k}"``, ``k`` an engine-wide counter: read from the
        right it names ``k``, so it equals no other sequence's id whatever the user ids are."""
        return f"{request_id}#{next(self._seq_ids)}"

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at once. Unknown ids are ignored."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        group.pending_forks.clear()
        for s in group.seqs:
            if not s.is_finished:
                self.scheduler.finish_request(s, RequestStatus.FINISHED_ABORTED)
            self._seq_to_group.pop(s.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that changed.

        A request whose own part of the step raises (its forward: when the batched forward
        raises, each request group's part is rerun alone to find the one at fault; sampling
        results, stop checks, detokenization, forking, its output) finishes with
        ``finish_reason="error"`` and the message in ``RequestOutput.error``; its blocks are
        freed (not cached) and the other requests go on. An exception in scheduling still
        propagates.
        """
        sched = self.scheduler.schedule()
        if sched.is_empty and sched.preempted:  # a plan that only made room: admit into it now
            sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (a bug)")
            return []
        now = time.perf_counter()
        for req, n in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
        # From here on the work is per request: an exception in one request's forward or
        # bookkeeping (a bug, or a tokenizer that chokes on its text) fails that request
        # alone, with finish_reason "error"; the others in the batch go on.
        failed: dict[str, tuple[RequestGroup, Exception]] = {}
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # noqa: BLE001 - find the request(s) at fault, run the others
            result = self._execute_per_group(sched, e, failed)
        for req, n in sched.scheduled:
            if self._group_id(req) in failed:
                continue  # its K/V may be half written: never cache it
            req.num_computed_tokens += n
            if req.spec_token_ids:
                continue  # a verification: its drafts' K/V is cached once they are accepted
            with self._isolated(req, failed):
                self.kv.cache_computed(req)  # before _fork_pending: forks share the cached prompt
        self._fork_pending(sched, failed)
        by_id = {r.request_id: r for r, _ in sched.scheduled}
        for rid, lps in result.prompt_logprobs.items():
            req = by_id[rid]
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            req.prompt_logprobs.extend(lps)
        changed: dict[str, RequestGroup] = {}
        for req, n in sched.scheduled:
            if not req.spec_token_ids:
                continue
            group = self._seq_to_group.get(req.request_id)
            if group is None or group.request_id in failed:
                continue
            with self._isolated(req, failed):
                self._apply_verification(req, result.spec[req.request_id], time.perf_counter())
                changed[group.request_id] = group
        if result.sampler_output is not None:
            so = result.sampler_output
            toks = so.sampled_token_ids.tolist()
            lps = so.logprobs.tolist()
            ranks = so.ranks.tolist()
            top_ids = so.top_token_ids.tolist() if so.top_token_ids is not None else None
            top_lps = so.top_logprobs.tolist() if so.top_logprobs is not None else None
            now = time.perf_counter()
            beam_groups: dict[str, RequestGroup] = {}
            for i, req in enumerate(result.sample_requests):
                group = self._seq_to_group.get(req.request_id)
                if group is None or group.request_id in failed:
                    continue
                if group.beam is not None:  # every beam's row first, then the groups advance
                    group.beam_rows[req.request_id] = result.beam_topk[req.request_id]
                    beam_groups[group.request_id] = group
                    continue
                with self._isolated(req, failed):
                    k = req.sampling_params.logprobs
                    top = list(zip(top_ids[i][:k], top_lps[i][:k])) if (k and top_ids is not None) else []
                    self._append_token(req, toks[i], TokenLogprob(toks[i], lps[i], ranks[i], top), now)
                    changed[group.request_id] = group
            # (advancing a group rewrites its beams' tokens: a row recorded after that, for a
            # beam sampled later in this step, would stand for the new tokens while it holds
            # the old ones' logprobs; the group then advanced on it one step later)
            for rid, group in beam_groups.items():
                if rid not in failed:
                    with self._isolated(group.seqs[0], failed):
                        if self._advance_beams(group):
                            changed[rid] = group
        outputs = []
        for rid, group in changed.items():
            if rid in failed:
                continue
            with self._isolated(group.seqs[0], failed):
                outputs.append(self._make_output(group))
                if group.finished:
                    self._retire(group)
        outputs.extend(self._fail_group(group, e) for group, e in failed.values())
        if self.proposer is not None:
            self._propose(sched, result, failed)
        return outputs

    # ------------------------------------------------------- speculative decoding
    def _apply_verification(self, req: Request, res: SpecResult, now: float) -> None:
        """Append a verification's tokens (accepted drafts, then the correction or bonus
        token) and roll back the K/V of the rejected drafts: ``num_computed_tokens`` counts
        the last token and the accepted drafts only, so the rejected drafts' slots are
        rewritten later and never reach the prefix cache."""
        req.num_computed_tokens -= res.num_drafts - res.num_accepted
        req.clear_spec()
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += res.num_drafts
        self.spec_num_accepted_tokens += res.num_accepted
        self._append_tokens(req, res.token_ids, res.logprobs, now)
        if not req.is_finished:
            self.kv.cache_computed(req)

    def _propose(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                 failed: dict[str, tuple[RequestGroup, Exception]]) -> None:
        """Draft tokens for the requests of this step that decode next (see
        ``speculative_config``). Beam search decodes without drafts. At most
        ``min(max_tokens - output, max_model_len - num_tokens) - 1`` drafts are proposed, so
        that drafts plus the bonus token never pass either limit.

        Structured output: the proposers do not know the grammar, so a constrained request's
        drafts are cut at the first one its grammar rejects (:meth:`_fit_to_grammar`); the
        verification then runs every position under the grammar's mask."""
        sampled = {r.request_id for r in result.sample_requests} | set(result.spec)
        reqs, rooms = [], []
        for req, _ in sched.scheduled:
            # (only after a sampled token: a prompt chunk that stops one token short of its end
            # has no output yet, and the forks of an n > 1 group must see its prompt first)
            if (req.request_id not in sampled or req.status is not RequestStatus.RUNNING
                    or req.sampling_params.use_beam_search
                    or (req.grammar is not None and (req.grammar.is_error() or req.grammar.is_terminated()))
                    or req.num_tokens - req.num_computed_tokens != 1
                    or self._group_id(req) in failed):
                continue
            room = min(req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
            if room > 0:
                reqs.append(req)
                rooms.append(room)
        if isinstance(self.proposer, NgramProposer):
            for req, room in zip(reqs, rooms):
                with self._isolated(req, failed):
                    req.spec_token_ids = self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64), room)
                    if req.grammar is not None:
                        self._fit_to_grammar(req)
            return
        # the draft KV of requests that do not run (finished, aborted, preempted) is freed: the
        # draft pool, sized like the target's, then never holds more than the running requests
        self.proposer.retain({r.request_id for r in self.scheduler.running})
        if not reqs:
            return
        try:
            drafts = self.proposer.propose(reqs, rooms)
        except Exception:  # noqa: BLE001 - drafts are an optimization: decode without them
            logger.exception("the draft model failed; these requests decode without drafts this step")
            for req in reqs:
                self.proposer.free(req.request_id)
            return
        for req, (ids, q) in zip(reqs, drafts):
            req.spec_token_ids, req.spec_draft_probs = ids, q
            if req.grammar is not None:
                with self._isolated(req, failed):
                    self._fit_to_grammar(req)

    def _fit_to_grammar(self, req: Request) -> None:
        """Cut a constrained request's drafts at the first one its grammar rejects.

        Drafts with a one-hot q (n-gram, or a greedy request's draft-model argmax) are cut
        right before it: rejecting such a draft would draw from ``max(p - onehot, 0) = p``
        (its masked p is 0), which is what the position draws from once the draft is gone.
        A draft drawn from the draft model's q is kept as the last draft: its p is 0, so it is
        rejected with certainty and the correction is drawn from ``normalize(max(p - q, 0))``;
        drawing from p there instead would skew the output toward the tokens q favours
        (Leviathan et al. 2023: the residual is what makes the output exactly p).
        """
        ids = req.spec_token_ids
        n = req.grammar.valid_prefix(ids)
        if n == len(ids):
            return
        q = req.spec_draft_probs
        keep = n + 1 if q is not None else n
        self.spec_num_grammar_cut_tokens += len(ids) - keep
        req.spec_token_ids = list(ids[:keep])
        if q is not None:
            req.spec_draft_probs = q[:keep]
        if not req.spec_token_ids:
            req.clear_spec()

    def _group_id(self, req: Request) -> Optional[str]:
        group = self._seq_to_group.get(req.request_id)
        return None if group is None else group.request_id

    def _execute_per_group(self, sched: SchedulerOutput, error: Exception,
                           failed: dict[str, tuple[RequestGroup, Exception]]) -> ModelRunnerOutput:
        """After the batched forward raised ``error``: run each request group's part of the
        step alone, record the groups whose part raises again in ``failed`` and return the
        other parts' results merged (a row does not depend on its batch-mates beyond float
        rounding; K/V half written by the failed batch is rewritten with the same values).
        A fault that is not any one request's (every part fails) fails every request of the
        step; the engine itself goes on."""
        parts: dict[Optional[str], list[tuple[Request, int]]] = {}
        for req, n in sched.scheduled:
            parts.setdefault(self._group_id(req), []).append((req, n))
        if None in parts:  # a sequence of no live group: the engine's own state is at fault
            raise error
        logger.warning("the model forward failed for a batch of %d request(s) (%s: %s); running them one by one",
                       len(parts), type(error).__name__, error)
        results = []
        for gid, scheduled in parts.items():
            if len(parts) == 1:
                e = error
            else:
                try:
                    results.append(self.runner.execute(SchedulerOutput(scheduled=scheduled)))
                    continue
                except Exception as e2:  # noqa: BLE001 - this group's own fault
                    e = e2
            failed.setdefault(gid, (self.groups[gid], e))
        return ModelRunnerOutput.merge(results)

    @contextlib.contextmanager
    def _isolated(self, req: Request, failed: dict[str, tuple[RequestGroup, Exception]]):
        """Record an exception raised inside the block as the failure of ``req``'s group."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any bug in one request's bookkeeping
            group = self._seq_to_group.get(req.request_id)
            if group is None:
                raise  # not a live request: the engine's own state is at fault
            failed.setdefault(group.request_id, (group, e))

    def _retire(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self._seq_to_group.pop(s.request_id, None)

    def _fail_group(self, group: RequestGroup, error: Exception) -> RequestOutput:
        """Finish every sequence of a group whose bookkeeping raised: ``finish_reason="error"``,
        the message in ``RequestOutput.error``; its KV blocks are freed (not cached)."""
        logger.error("request %s failed; the engine goes on without it", group.request_id, exc_info=error)
        msg = f"{type(error).__name__}: {error}"
        group.pending_forks.clear()
        now = time.perf_counter()
        for s in group.seqs:
            s.error = msg
            if not s.is_finished:
                s.metrics.finished_time = now
                self.scheduler.finish_request(s, RequestStatus.FINISHED_ERROR)
        self._retire(group)
        lead = group.seqs[0]
        outs = [CompletionOutput(index=i, text=s.output_text, token_ids=list(s.output_token_ids),
                                 finish_reason="error", cumulative_logprob=s.cumulative_logprob)
                for i, s in enumerate(group.seqs[: group.params.n])]
        return RequestOutput(group.request_id, lead.prompt, lead.prompt_token_ids, outs, True, lead.metrics,
                             num_cached_tokens=lead.num_cached_tokens, error=msg,
                             error_param=error.param if isinstance(error, GrammarLimitError) else None)

    def _append_token(self, req: Request, tok: int, lp: TokenLogprob, now: float) -> None:
        self._append_tokens(req, [tok], [lp], now)

    def _append_tokens(self, req: Request, toks: list[int], lps: list[TokenLogprob], now: float) -> None:
        """Append generated tokens (one, or a verified run of several), stopping exactly
        where appending them one at a time would: at the first EOS / stop token (once
        ``min_tokens`` is reached), at ``max_tokens`` / ``max_model_len``, or at the token
        whose text completes a stop string (the detokenizer's ``num_new_tokens_kept``); the
        tokens after it are dropped."""
        p = req.sampling_params
        n0, len0 = len(req.output_token_ids), req.num_tokens
        status, reason, end = None, None, len(toks)
        grammar_end = False
        for i, tok in enumerate(toks):
            n_out = n0 + i + 1
            if req.grammar is not None:  # structured output: the grammar follows every token kept
                # (a verified run's accepted drafts and its last token; the loop stops at the end of
                # the output, and tokens a stop string drops after this finish the request)
                req.grammar.accept_token(tok)
            if n_out >= p.min_tokens:
                if tok in req.eos_token_ids and not p.ignore_eos:
                    status = RequestStatus.FINISHED_STOPPED
                elif p.stop_token_ids and tok in p.stop_token_ids:
                    status, reason = RequestStatus.FINISHED_STOPPED, tok
            if status is None and req.grammar is not None and req.grammar.is_terminated():
                # the token completed the output (nothing but EOS could follow): it ends it, as a stop
                status, grammar_end = RequestStatus.FINISHED_STOPPED, True
            if status is None and (n_out >= p.max_tokens or len0 + i + 1 >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                end = i + 1
                break
        toks = toks[:end]
        # As in vLLM, an EOS or stop token that ends the sequence adds no text unless
        # include_stop_str_in_output (its id stays in token_ids); a token that completes a
        # grammar is text, unless it is EOS (under ignore_eos)
        hide = (status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output
                and (not grammar_end or toks[-1] in req.eos_token_ids))
        detok = req.detokenizer
        if hide:  # the tokens before it, then a flush (which may still complete a stop string)
            upd = detok.update(toks[:-1], n0 + len(toks) - 1) if len(toks) > 1 else None
            delta, kept = (upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)) if upd else ("", 0)
            if upd is None or upd.stop_str is None:
                upd = detok.update([], n0 + len(toks), finished=True)
                delta, kept = delta + upd.text_delta, len(toks)
        else:
            upd = detok.update(toks, n0 + len(toks), finished=status is not None)
            delta, kept = upd.text_delta, max(upd.num_new_tokens_kept or 0, 1)
        if upd.stop_str is not None:
            if kept < len(toks):  # the stop string ends before the run does: drop the rest
                toks, status, reason = toks[:kept], RequestStatus.FINISHED_STOPPED, upd.stop_str
            elif status in (None, RequestStatus.FINISHED_LENGTH):
                # a stop string completed by the last allowed token still ends it as "stop" (vLLM)
                status, reason = RequestStatus.FINISHED_STOPPED, upd.stop_str
        req.output_token_ids.extend(toks)
        if reason is not None:
            req.stop_reason = reason
        for lp in lps[: len(toks)]:
            req.cumulative_logprob += lp.logprob
        if p.logprobs is not None:
            req.output_logprobs.extend(lps[: len(toks)])
        self.num_generated_tokens += len(toks)
        m = req.metrics
        m.num_generated_tokens = len(req.output_token_ids)
        if m.first_token_time is None:
            m.first_token_time = now
        req.output_text = req.detokenizer.output_text
        req.last_delta = delta
        # (a verification counts its accepted drafts computed: never more than the tokens kept)
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        if status is not None:
            m.finished_time = now
            self.scheduler.finish_request(req, status)

    def _advance_beams(self, group: RequestGroup) -> bool:
        """Run one beam-search step once every live beam has its next-token logprobs.

        The new beams' KV is rearranged copy-on-write: a parent's first child takes over its
        blocks, further children share its full blocks and copy the partial last one
        (:meth:`KVCacheManager.clone`); parents with no child release theirs.

        Returns:
            True when the search finished.
        """
        live = group.seqs
        if any(s.request_id not in group.beam_rows or s.num_computed_tokens != s.num_tokens for s in live):
            return False
        rows = [group.beam_rows.pop(s.request_id) for s in live]
        outs = [list(s.output_token_ids) for s in live]
        lengths = [s.num_tokens for s in live]
        cands = group.beam.step(outs, [s.cumulative_logprob for s in live],
                                [r[0] for r in rows], [r[1] for r in rows])
        handles = [self.kv.detach(s) for s in live]
        new_handles, used = [], set()
        for c in cands:
            if c.parent not in used:
                used.add(c.parent)
                new_handles.append(handles[c.parent])
            else:  # no free block to copy into: this beam recomputes its tokens
                new_handles.append(self.kv.clone(handles[c.parent], lengths[c.parent]) or ([], None))
        for p, h in enumerate(handles):
            if p not in used:
                self.kv.release(h)
        now = time.perf_counter()
        if live[0].metrics.first_token_time is None:
            live[0].metrics.first_token_time = now
        while len(live) < len(cands):
            lead = live[0]
            beam = Request(
                request_id=self._seq_id(group.request_id), prompt_token_ids=lead.prompt_token_ids,
                sampling_params=lead.sampling_params, seed=lead.seed, eos_token_ids=lead.eos_token_ids,
                prompt=lead.prompt, priority=lead.priority, cache_salt=lead.cache_salt,
                arrival_index=lead.arrival_index, parent_id=group.request_id, sample_index=len(live),
                status=RequestStatus.RUNNING,
            )
            live.append(beam)
            self._seq_to_group[beam.request_id] = group
            self.scheduler.running.append(beam)
        for j, c in enumerate(cands):
            s = live[j]
            s.output_token_ids = outs[c.parent] + [c.token]
            s.cumulative_logprob = c.cum_logprob
            self.kv.attach(s, new_handles[j])
            s.num_computed_tokens = lengths[c.parent] if new_handles[j][0] else 0
        self.num_generated_tokens += len(cands)
        if group.beam.done:
            for s in live:
                s.metrics.finished_time = now
                self.scheduler.finish_request(s, RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _fork_pending(self, sched, failed: dict[str, tuple[RequestGroup, Exception]]) -> None:
        """Start the other samples of groups whose first sequence just computed its prompt."""
        for req, _ in sched.scheduled:
            group = self._seq_to_group.get(req.request_id)
            if group is None or not group.pending_forks or req is not group.seqs[0] or group.request_id in failed:
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                continue
            with self._isolated(req, failed):
                while group.pending_forks:
                    child = group.pending_forks.pop(0)
                    self.fork_prompt(req, child)
                    self.scheduler.add_request(child)

    def fork_prompt(self, src: Request, dst: Request) -> None:
        """Give ``dst`` the KV of ``src``'s prompt except its last token.

        Full blocks are shared (through the prefix cache when it is on, else by reference
        count); the block holding the last prompt position is copied (copy-on-write), so
        ``dst`` computes one token before sampling. See :meth:`KVCacheManager.fork`; when no
        block is free ``dst`` is admitted normally (hitting the prefix cache if it is on).
        """
        if not self.kv.fork(src, dst):
            dst.num_computed_tokens = 0

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        seqs, params = group.seqs, group.params
        lead = seqs[0]
        if group.beam is not None:
            outs = [
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(list(h.token_ids), skip_special_tokens=params.skip_special_tokens),
                    token_ids=list(h.token_ids),
                    finish_reason="stop" if h.finished_by_eos else "length",
                    cumulative_logprob=h.cum_logprob,
                )
                for i, h in enumerate(group.beam.best(params.n))
            ]
            return RequestOutput(group.request_id, lead.prompt, lead.prompt_token_ids, outs,
                                 group.finished, lead.metrics, num_cached_tokens=lead.num_cached_tokens)
        if params.num_samples == params.n:
            chosen = seqs
        elif group.finished:  # best_of: the n samples with the highest cumulative logprob
            chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            chosen = []  # best_of results are only known at the end
        outs = [
            CompletionOutput(
                index=idx,
                text=s.output_text,
                token_ids=list(s.output_token_ids),
                finish_reason=s.status.value if s.is_finished else None,
                stop_reason=s.stop_reason,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                delta_text=s.last_delta,
            )
            for idx, s in enumerate(chosen)
        ]
        for s in chosen:  # a delta is reported once: a sequence that did not move adds nothing
            s.last_delta = ""
        return RequestOutput(
            request_id=group.request_id,
            prompt=lead.prompt,
            prompt_token_ids=lead.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=lead.metrics,
            # (a one-token prompt has no scored position: just the leading None)
            prompt_logprobs=(list(lead.prompt_logprobs) or [None]) if params.prompt_logprobs is not None else None,
            num_cached_tokens=lead.num_cached_tokens,
        )

    # --------------------------------------------------------------- metrics
    def spec_stats(self) -> dict:
        """Speculative-decoding counters (vLLM's names): verifications with drafts
        (``num_drafts``), drafts verified and accepted, the acceptance rate (accepted /
        proposed drafts) and the mean acceptance length (tokens emitted per verification:
        1 + accepted / verifications). All 0 without speculation.
        ``spec_decode_num_grammar_cut_tokens`` (kvserve's own) counts the drafts of
        structured-output requests dropped before verification because their grammar rejects
        a draft before them (they are not in ``num_draft_tokens``)."""
        d, t, a = self.spec_num_drafts, self.spec_num_draft_tokens, self.spec_num_accepted_tokens
        return {
            "spec_decode_num_grammar_cut_tokens": self.spec_num_grammar_cut_tokens,
            "spec_decode_num_drafts": d,
            "spec_decode_num_draft_tokens": t,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / t if t else 0.0,
            "spec_decode_mean_acceptance_length": 1.0 + a / d if d else 0.0,
        }

    def swap_stats(self) -> dict:
        """The swap space's counters (:meth:`kvserve.core.kv_swap.KVSwapSpace.stats`): swap-outs and
        swap-ins (requests), blocks moved each way, recompute fallbacks, host pool blocks and
        usage; all 0 without a swap space."""
        if self.swap is not None:
            return self.swap.stats()
        return {"swap_num_swap_outs": 0, "swap_num_swap_ins": 0, "swap_num_swapped_out_blocks": 0,
                "swap_num_swapped_in_blocks": 0, "swap_num_recompute_fallbacks": 0, "swap_num_dropped": 0,
                "swap_blocks_total": 0, "swap_blocks_used": 0, "swap_usage": 0.0, "num_swapped": 0}

    def stats(self) -> dict:
        """Engine counters: running/waiting requests, KV usage, preemptions, swaps, tokens."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_usage": self.kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_priority_preemptions": self.scheduler.num_priority_preemptions,
            "num_chunked_prefills": self.scheduler.num_chunked_prefills,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "generated_tokens": self.num_generated_tokens,
            **self.spec_stats(),
            **self.swap_stats(),
            **self.kv.stats(),  # prefix-cache queries/hits/hit rates/evictions, blocks free/cached/in use
        }


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests; retry later (HTTP 503)."""


