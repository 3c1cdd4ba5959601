"""EngineCore: the scheduler, the KV cache manager and the executor, stepped.

``step()`` is schedule → execute (the executor runs the model and the sampler on its
workers) → update (num_computed_tokens, prefix-cache insertion, forks, appended tokens with
their token-level stop checks, beams, speculative verification and drafts) → outputs: per
request, the tokens each sample gained (:class:`~kvserve.engine.core_output.EngineCoreOutput`).
Requests come in already tokenized (:class:`~kvserve.engine.input_processor.EngineCoreRequest`);
the core checks them against the pool and the queue. Text (detokenization, stop strings) is the
front end's (:class:`~kvserve.engine.output_processor.OutputProcessor`): it ends a sample at a
stop string through :meth:`EngineCore.finish_samples`.

A user request with ``n`` (or ``best_of``) > 1 becomes a group of sequences: the first
computes the prompt; the others are forked from it once its prompt is computed (they share
its full KV blocks, copy the partial one and compute only the last prompt token), so the
prompt is computed once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import random
import time
import weakref
from typing import Optional, Sequence

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.kv_compression import KVCompressionConfig, streaming_keep
from kvserve.core.kv_cache_manager import KVCacheManager, available_memory, default_kv_cache_memory, plan_kv_cache
from kvserve.core.kv_ops import KVCacheOpsError
from kvserve.core.kv_swap import KVSwapSpace, check_swap_options, num_host_blocks, plan_host_pool
from kvserve.core.request import Request, RequestStatus, TokenLogprob
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.args import EngineArgs, parse_device, parse_dtype
from kvserve.engine.core_output import BeamOutput, EngineCoreOutput, SampleDelta, append_output_tokens
from kvserve.engine.input_processor import EngineCoreRequest
from kvserve.engine.tokenizer import eos_token_ids, load_tokenizer
from kvserve.executor import Executor, ExecutorError, UniProcExecutor
from kvserve.sample.beam_search import BeamSearchState
from kvserve.sample.sampler import sample_seed
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode import SpeculativeConfig
from kvserve.spec_decode.driver import SpecDecodeDriver
from kvserve.structured_output.manager import GrammarLimitError, StructuredOutputManager
from kvserve.worker import kv_quant
from kvserve.worker import kv_quant_lowbit
from kvserve.worker.loader import load_model_config, resolve_model_path
from kvserve.worker.model_runner import ModelRunnerOutput, SpecResult
from kvserve.worker.worker import Worker, available_cores

logger = logging.getLogger(__name__)


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
        self.num_prompt_logprobs_sent = 0

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


def kv_loader(executor: Executor):
    """The KV manager's loader over ``executor``'s workers (``kv_loader`` of
    :class:`KVCacheManager`): ``load(ops)`` has every worker apply ``ops`` (the block moves
    recorded so far, then a KV transfer's load) now (:meth:`Worker.load_kv_blocks`).

    ``load`` raises:
        KVTransferError: a worker's load failed (the request recomputes its prompt).
        KVCacheOpsError: another move failed (an engine fault).
    """

    def load(ops) -> None:
        from kvserve.distributed.kv_transfer import KVTransferError

        errors = [e for e in executor.collective_rpc("load_kv_blocks", (ops,)) if e]
        if errors:
            raise KVTransferError(errors[0])

    return load


def _sync_kv_offload(kv: KVCacheManager, executor: Executor) -> None:
    """Take in what the workers report of the disk tier's writes (:meth:`KVOffloadTier.on_reports`):
    a call to every rank, only while writes are in flight (or a read failed)."""
    tier = kv.offload
    if tier is None or not tier.awaiting_reports or not executor.is_alive:
        return
    try:
        reports = executor.collective_rpc("kv_offload_report")
    except Exception:  # noqa: BLE001 - a worker died: the step that follows reports it
        logger.debug("KV disk tier: the workers' report failed", exc_info=True)
        return
    tier.on_reports(reports)


def _close_kv_offload(kv: KVCacheManager, executor: Executor) -> None:
    """Write the prefix cache's blocks that are not on disk yet to the disk tier (within its
    budget, most recently used first) and wait for every queued write: at shutdown, so that a
    restarted engine finds the cache. Quiet: failed writes are counted (and logged as while
    serving: rate-limited, one line each); other errors are one line (the engine is going away)."""
    tier = kv.offload
    try:
        if not executor.is_alive:
            return
        _sync_kv_offload(kv, executor)
        before = tier.num_written_blocks
        n = kv.offload_cached()
        ops = kv.ops.take()
        if ops:
            executor.collective_rpc("apply_kv_ops", (ops,))
        tier.on_reports(executor.collective_rpc("close_kv_offload"))
        tier.closed = True
        if n:
            logger.info("KV disk tier: wrote %d of %d cached block(s) at shutdown", tier.num_written_blocks - before, n)
    except Exception as e:  # noqa: BLE001 - a dead worker: what was written stays
        logger.warning("KV disk tier: writing the cached blocks at shutdown failed (%s: %s)", type(e).__name__, e)
        logger.debug("KV disk tier: the shutdown's error", exc_info=True)


class EngineCore:
    """The engine core: :class:`EngineCoreRequest` in, :class:`EngineCoreOutput` per step out.

    It owns the scheduler, the KV cache manager and the executor, and its :meth:`step` is the
    loop: schedule, execute, update. It runs in the caller's process (offline :class:`LLM`,
    :class:`~kvserve.engine.llm_engine.LLMEngine`) or in a process of its own (``kvserve serve``).

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
        self.quantization: Optional[str] = args.resolved_quantization(path)  # ("auto": by the file's format)
        t0 = time.perf_counter()
        self.max_model_len = max_len = self._check_config(load_model_config(path))  # before the weights load
        self.executor: Executor = self._make_executor()
        # the workers stop when the core is collected (or at exit) if shutdown() was not called
        weakref.finalize(self, self.executor.shutdown)
        try:
            # the tokenizer (Python: transformers' import, the vocabulary's conversion) loads on a thread
            # while the workers load the weights (GIL released); a weights error still comes first
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer") as pool:
                tokenizer = pool.submit(load_tokenizer, path)
                cfg = self.executor.collective_rpc("load_model", (path, max_len, self.quantization))[0]
                self.tokenizer = tokenizer.result()
            self.model_config: ModelConfig = cfg
            self.model_path = path
            self._init_kv_cache(cfg, path)
            self._init_state(cfg, max_len)
        except BaseException:
            self.executor.shutdown()  # (no rank process outlives a failed start)
            raise
        self.load_time_s = time.perf_counter() - t0

    def _init_state(self, cfg: ModelConfig, max_len: int) -> None:
        """The request bookkeeping, structured output and speculative decoding."""
        args = self.args
        self.eos_token_ids = eos_token_ids(cfg, self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_to_group: dict[str, RequestGroup] = {}
        self._deltas: dict[str, SampleDelta] = {}  # sequence id -> its tokens of this step, until output
        self._transfers: dict = {}  # request id -> the KVTransferHandle of its saved prompt K/V, until output
        self.num_kv_transfer_saved = 0
        self.num_kv_transfer_saved_bytes = 0
        self._rng = random.Random(args.seed)
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (excludes cache hits)
        self.num_generated_tokens = 0
        self.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        # (a draft model's pool: 8-bit under a 2-/4-bit target, whose pool has 2.9-4.6x the blocks;
        # the model dtype otherwise: spec_decode.draft_model)
        draft_kv = torch.int8 if kv_quant.is_lowbit(self.kv_cache_dtype) else None
        self.spec = SpecDecodeDriver.from_config(self.speculative_config, cfg, self.tokenizer, self.dtype, self.device,
                                                 self.kv_spec.num_blocks, args.block_size, max_len, draft_kv)
        self.kv_compression = KVCompressionConfig.parse(args.kv_compression)
        if self.kv_compression is not None:
            self._check_kv_compression(self.kv_compression)
        self.num_kv_compactions = 0  # compactions applied (all requests)
        self.num_kv_dropped_tokens = 0  # tokens they dropped

    def _check_kv_compression(self, cfg: KVCompressionConfig, params: Optional[SamplingParams] = None) -> None:
        """Raises ValueError naming ``kv_compression`` where a policy cannot work: kept tokens above
        max_model_len, a model with sliding-window layers (their windows count KV indices as
        positions), beam search. (With speculative decoding, SnapKV's and H2O's scores count only accepted tokens'
        queries: :meth:`kvserve.worker.kv_compressor.KVCompressor.accumulate`.)"""
        if not cfg.enabled:
            return
        cfg.check_fits(self.max_model_len)
        if self.model_config.sliding_window is not None:
            raise ValueError(f"kv_compression is not supported for models with sliding-window layers (window "
                             f"{self.model_config.sliding_window}): their windows are counted in cached tokens")
        if params is not None and params.use_beam_search:
            raise ValueError("kv_compression is not supported with use_beam_search (beams share their KV blocks "
                             "copy-on-write by position, which compaction would break)")

    def _check_config(self, cfg: ModelConfig) -> int:
        """The checks that need only the model's config; returns ``max_model_len``.

        Raises:
            ValueError: a head count that ``tensor_parallel_size`` does not split, more ranks
                than the CPU cores available (or the CUDA devices; with the ``ray`` backend the
                executor checks the cluster's instead), a bad ``max_model_len``.
        """
        args = self.args
        tp = args.tensor_parallel_size
        if tp > 1:  # before any process starts
            cfg.check_tensor_parallel(tp)
            if args.distributed_executor_backend == "ray":
                pass  # (the ranks may span machines: RayExecutor checks the local or cluster resources)
            elif self.device.type == "cpu" and tp > available_cores():
                raise ValueError(f"tensor_parallel_size ({tp}) exceeds the {available_cores()} CPU cores this "
                                 f"process may run on: each rank needs a core of its own")
            elif self.device.type == "cuda" and tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size ({tp}) exceeds the {torch.cuda.device_count()} CUDA devices")
        kv_quant.check_head_dim(cfg.head_dim, args.kv_cache_dtype)
        self.kv_cache_dtype = kv_quant.storage_dtype(args.kv_cache_dtype, self.dtype)
        if args.max_model_len is not None and not 2 <= args.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's context length), "
                f"got {args.max_model_len}"
            )
        return args.max_model_len or min(cfg.max_position_embeddings, 4096)

    def _make_executor(self) -> Executor:
        """One worker in this process, or ``tensor_parallel_size`` ranks on the
        ``distributed_executor_backend`` (``mp``: local processes; ``ray``: Ray actors,
        :mod:`kvserve.executor.ray_executor`). At one rank the worker is in this process
        whatever the backend (the driver rank always is: there is nothing for Ray to run)."""
        args = self.args
        tp, backend = args.tensor_parallel_size, args.distributed_executor_backend or "mp"
        if tp == 1:
            if args.distributed_executor_backend:
                logger.info("tensor_parallel_size=1: the one worker runs in this process (distributed_executor_backend"
                            "=%r has no other rank to start)", args.distributed_executor_backend)
            return UniProcExecutor(Worker(self.dtype, self.device))
        if backend == "ray":
            from kvserve.executor.ray_executor import RayExecutor

            return RayExecutor(tp, self.dtype, self.device, args.distributed_timeout_s)
        from kvserve.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(tp, self.dtype, self.device, args.distributed_timeout_s)

    def is_healthy(self) -> bool:
        """Whether the engine can still run steps (False once a worker died: every later step
        raises :class:`~kvserve.executor.ExecutorError`)."""
        return self.executor.is_alive

    def health_error(self) -> Optional[str]:
        """Why the engine cannot run steps any more (which worker died), or None while it can."""
        return None if self.executor.is_alive else self.executor.death

    def shutdown(self) -> None:
        """Stop the workers (the rank processes of a tensor-parallel executor); idempotent. With
        a disk tier, the blocks still in the prefix cache are written to it first, and the
        writes queued are waited for (:func:`_close_kv_offload`)."""
        finalizer = getattr(self, "_offload_finalizer", None)
        if finalizer is not None:
            finalizer()
        self.executor.shutdown()

    def _init_kv_cache(self, cfg: ModelConfig, path) -> None:
        """Size the KV pool, have the workers allocate it, and build the KV manager, the swap
        space, the scheduler and the workers' model runners over it."""
        args, max_len = self.args, self.max_model_len
        # Every layer windowed (Mistral v0.1): the blocks before the window are freed as a
        # request advances (KVCacheManager), so a sequence of any length runs in about
        # window / block_size blocks. The radix prefix cache keeps a running request's whole
        # prefix locked, which would pin those blocks: prefix caching is off for such models.
        window = cfg.uniform_window
        prefix_caching = args.enable_prefix_caching
        if window is not None and prefix_caching:
            logger.warning("prefix caching is off: every layer of this model has a sliding window (%d tokens), "
                           "and the blocks before it are freed while a request runs", window)
            prefix_caching = False
        budget, note = args.kv_cache_memory, ""  # (per rank: each holds the K/V of its heads)
        tp = args.tensor_parallel_size
        if budget is None and args.num_blocks is None:  # sized from what the machine has left now
            available = available_memory(self.device)
            if available is not None and self.device.type == "cpu":
                available //= tp  # (the ranks share the host's memory)
            budget, note = default_kv_cache_memory(
                cfg.kv_bytes_per_token(self.kv_cache_dtype, tp, args.block_size), args.block_size, max_len, args.max_num_seqs,
                available, args.kv_cache_memory_fraction, sliding_window=window,
                max_num_batched_tokens=args.max_num_batched_tokens, device=str(self.device))
        self.cache_config = CacheConfig(args.block_size, budget, args.num_blocks, prefix_caching)
        # 2-/4-bit KV (KIVI): a residual slot in the model dtype per partly written block, at most
        # one per running sequence, or per block a verification of k drafts writes
        # (kv_quant_lowbit.num_residual_slots); the spare ones cover forked samples waiting and the
        # slots of blocks filled or freed, which come back after the forward (ResidualSlots)
        spec = SpeculativeConfig.parse(args.speculative_config)
        residual_blocks = kv_quant_lowbit.num_residual_slots(
            args.max_num_seqs, args.block_size, spec.num_speculative_tokens if spec is not None else 0
        ) if kv_quant.is_lowbit(self.kv_cache_dtype) else 0
        self.kv_spec = plan_kv_cache(cfg, self.kv_cache_dtype, budget, args.block_size, max_len, args.num_blocks,
                                     tp_size=tp, residual_blocks=residual_blocks, model_dtype=self.dtype)
        self.kv_spec.budget_note = note
        logger.info(self.kv_spec.describe())
        if self.kv_spec.capacity_tokens < max_len and (window is None or self.kv_spec.num_blocks < -(
                -(window - 1 + args.max_num_batched_tokens) // args.block_size) + 1):
            logger.warning("the KV cache holds %d tokens, less than one sequence of max_model_len=%d: a request's "
                           "prompt + max_tokens must fit in %d tokens (raise kv_cache_memory to lift this)",
                           self.kv_spec.capacity_tokens, max_len, self.kv_spec.capacity_tokens)
        # The pools (and the swap space's host pool) are the workers'; the KV manager and the swap
        # space keep the books and record their block copies (partial prefix hits, forks, beam
        # clones) and swaps in self.kv.ops, which go to every worker with the next step
        # (_schedule: SchedulerOutput.kv_ops) and are applied there, in order, before its forward.
        self.executor.collective_rpc("initialize_kv_cache", (cfg, self.kv_spec, self.kv_cache_dtype))
        # (a KV transfer's load is applied at admission, not with the step: a failed one is then
        # one request's, which recomputes its prompt: kv_loader)
        offload = self._init_kv_offload(cfg, path) if args.kv_offload_dir and prefix_caching else None
        if args.kv_offload_dir and not prefix_caching:
            raise ValueError(f"kv_offload_dir: the disk tier extends the prefix cache, which is off for this model "
                             f"(every layer has a sliding window of {window} tokens)")
        self.kv = KVCacheManager(self.kv_spec.num_blocks, args.block_size, prefix_caching,
                                 None, namespace_model=str(path), sliding_window=window,
                                 kv_loader=kv_loader(self.executor) if args.kv_connector or offload else None,
                                 offload=offload, residual_blocks=residual_blocks)
        if offload is not None:  # (at shutdown, or when the core is collected: the cached blocks go to disk too)
            self._offload_finalizer = weakref.finalize(self, _close_kv_offload, self.kv, self.executor)
        self.scheduler_config = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, max_len, args.max_waiting,
                                                args.max_num_seqs_per_user)
        self.preemption_mode = check_swap_options(args.swap_space, args.preemption_mode)
        self.swap: Optional[KVSwapSpace] = None
        if self.preemption_mode == "swap":
            block_bytes = self.kv_spec.bytes_per_token * args.block_size
            if self.kv_spec.residual_blocks:  # 2-/4-bit: a host residual area for partial last blocks
                host_blocks, host_res = plan_host_pool(args.swap_space, block_bytes, self.kv_spec.residual_bytes
                                                       // self.kv_spec.residual_blocks, args.max_num_seqs)
            else:
                host_blocks, host_res = num_host_blocks(args.swap_space, self.kv_spec.bytes_per_token,
                                                        args.block_size), 0
            pinned = self.executor.collective_rpc("initialize_swap_space", (host_blocks, host_res))[0]
            self.swap = KVSwapSpace(None, host_blocks, ops=self.kv.ops, block_bytes=block_bytes, num_residual=host_res)
            logger.info("swap space: %d host blocks of %d tokens (%.2f GiB%s)%s", self.swap.num_blocks,
                        args.block_size, self.swap.num_blocks * self.swap.block_bytes / (1 << 30),
                        ", pinned" if pinned else "", f", {host_res} host residual slots" if host_res else "")
        self.scheduler = Scheduler(self.scheduler_config, self.kv, swap=self.swap)
        self.executor.collective_rpc("init_model_runner", (self.kv.block_tables, args.block_size, window,
                                                           self.kv.residual.map if self.kv.residual else None))

    def _init_kv_offload(self, cfg: ModelConfig, path):
        """The prefix cache's disk tier (:mod:`kvserve.core.kv_offload`): the model fingerprint,
        the index rebuilt from ``kv_offload_dir``, and each worker's writer/reader."""
        from kvserve.core.kv_offload import KVOffloadTier, model_fingerprint
        from kvserve.distributed.kv_transfer.disk_connector import BlockFileLayout

        args, tp = self.args, self.args.tensor_parallel_size
        kv_heads = cfg.num_kv_heads if tp == 1 else cfg.heads_per_rank(tp)[1]
        fp, _ = model_fingerprint(path, self.dtype, self.kv_cache_dtype, args.block_size, cfg.num_layers, kv_heads,
                                  cfg.head_dim, tp, self.quantization)
        layout = BlockFileLayout(fp, 0, tp, cfg.num_layers, args.block_size, kv_heads,
                                 kv_quant.row_elements(cfg.head_dim, self.kv_cache_dtype), self.kv_cache_dtype)
        tier = KVOffloadTier(args.kv_offload_dir, args.kv_offload_gib, layout, ops=None)  # (the KV manager's ops)
        self.executor.collective_rpc("initialize_kv_offload", (args.kv_offload_dir, layout))
        logger.info("KV disk tier: %s, %.2f GiB = %d blocks of %d bytes; %d blocks found there (model fingerprint %s)",
                    args.kv_offload_dir, args.kv_offload_gib, tier.capacity_blocks, tier.block_file_bytes,
                    tier.num_scanned_blocks, fp.hex())
        return tier

    @property
    def proposer(self):
        """The speculative proposer (None without speculation)."""
        return self.spec.proposer if self.spec is not None else None

    @property
    def spec_num_draft_tokens(self) -> int:
        """Drafts verified so far (0 without speculation)."""
        return self.spec.num_draft_tokens if self.spec is not None else 0

    @property
    def model(self):
        """The driver worker's model (one-process executor)."""
        return self.executor.driver_worker.model

    @property
    def runner(self):
        """The driver worker's model runner (one-process executor)."""
        return self.executor.driver_worker.runner

    @property
    def kv_caches(self):
        """The driver worker's KV pools (one-process executor; for inspection: the core itself
        never reads or writes them)."""
        return self.executor.driver_worker.kv_caches

    # ------------------------------------------------------------- requests
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a request against the model and the pool; return its resolved max_tokens.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt or
                prompt + max_tokens longer than ``max_model_len``, a request larger than
                the whole KV pool, or more beams than ``max_num_seqs`` (or
                ``max_num_seqs_per_user``).
            QueueFullError: ``max_waiting`` requests wait to start
                (:meth:`Scheduler.num_waiting_to_start
                <kvserve.core.scheduler.Scheduler.num_waiting_to_start>`: preempted requests and
                forked samples do not count).
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
                f"max_model_len ({self.max_model_len}): set max_tokens to at most {self.max_model_len - n} "
                f"or shorten the prompt"
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
        compression = params.kv_compression if params.kv_compression is not None else self.kv_compression
        if compression is not None and compression.enabled:  # (so does a compression policy)
            # (+ the kept tokens' blocks: a compaction of shared or cached blocks writes fresh
            # copies before the old ones go)
            most = compression.max_kv_tokens(n, max_tokens, budget, self.kv.block_size)
            need = min(need, self.kv.blocks_needed(most) + self.kv.blocks_needed(compression.kept))
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
        cap = self.args.max_num_seqs_per_user
        if params.use_beam_search and cap is not None and params.beam_width > cap:
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs_per_user={cap}: every beam of "
                             f"a group runs at once")
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
        if params.kv_compression is not None:
            self._check_kv_compression(params.kv_compression, params)
        elif self.kv_compression is not None:
            self._check_kv_compression(self.kv_compression, params)
        if self.args.max_waiting:
            # the requests actually waiting: not preempted ones, not forked samples
            waiting = self.scheduler.num_waiting_to_start()
            if waiting >= self.args.max_waiting:
                raise QueueFullError(f"the waiting queue is full (max_waiting={self.args.max_waiting}): {waiting} "
                                     f"requests wait to start")
        return max_tokens

    def add_request(self, request: EngineCoreRequest) -> str:
        """Queue a request processed by :meth:`InputProcessor.process`; returns its id
        (``request.request_id``, or ``req-N`` when that is None).

        Raises:
            ValueError: see :meth:`validate_request`, an invalid structured-output spec, a
                ``request_id`` in use, or ``kv_transfer_params`` this engine cannot honour
                (:meth:`_check_kv_transfer`); nothing is queued and no other request is affected.
            QueueFullError: the waiting queue is full.
        """
        ids, text, params = request.prompt_token_ids, request.prompt, request.sampling_params
        request_id, priority, cache_salt = request.request_id, request.priority, request.cache_salt
        params.max_tokens = self.validate_request(ids, params)  # (the request's own copy)
        load, save = self._check_kv_transfer(request.kv_transfer_params, ids, params)
        compression = params.kv_compression if params.kv_compression is not None else self.kv_compression
        if compression is not None and compression.enabled and (load is not None or save):
            raise ValueError("kv_compression is not supported with kv_transfer_params (the prompt K/V moves between "
                             "engines whole)")
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
                user=request.user,
                arrival_index=arrival,
                parent_id=rid,
                sample_index=i,
                kv_compression=compression if compression is not None and compression.enabled else None,
            )
            if params.structured_outputs is not None:  # each sample follows the grammar on its own
                seq.grammar = self.structured_output.new_grammar(params.structured_outputs)
            seqs.append(seq)
        seqs[0].kv_transfer, seqs[0].kv_save = load, save  # (the first sequence computes the prompt)
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

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> list[str]:
        """Queue every request of ``requests``, or none; returns their ids.

        With more than one request every one is checked (:meth:`validate_request`) before any
        is added; one that still fails when added (e.g. the batch overfills the waiting queue)
        takes back those added before it (no step runs in between).

        Raises:
            ValueError, TypeError, QueueFullError: as :meth:`add_request`; the exception's
                ``request_index`` attribute is the position in ``requests`` of the one at fault.
        """
        added: list[str] = []
        index: Optional[int] = None
        try:
            if len(requests) > 1:  # check them all first: a bad one must not start the others
                for index, r in enumerate(requests):
                    self.validate_request(r.prompt_token_ids, r.sampling_params)
            for index, r in enumerate(requests):
                added.append(self.add_request(r))
        except Exception as e:
            for rid in added:
                self.abort_request(rid)
            e.request_index = index
            raise
        return added

    def _kv_layout(self) -> tuple:
        """``(num_layers, num_kv_heads, row, dtype, tensor_parallel_size)`` of the pools."""
        cfg = self.model_config
        row = cfg.head_dim + (4 if kv_quant.is_quantized(self.kv_cache_dtype) else 0)
        return (cfg.num_layers, cfg.num_kv_heads, row, str(self.kv_cache_dtype), self.args.tensor_parallel_size)

    def _check_kv_transfer(self, kv_transfer_params, ids: Sequence[int], params: SamplingParams):
        """``(handle to load or None, whether to save)`` for a request's ``kv_transfer_params``.

        Raises:
            ValueError: naming ``kv_transfer_params``: no ``kv_connector`` configured, neither
                ``{"do_remote_decode": True}`` nor a :class:`KVTransferHandle`, a handle of
                another connector, block size or pool layout, one whose tokens are not the
                prompt's first ``len(prompt) - 1`` (2-/4-bit caches: its full blocks among them,
                :meth:`_transfer_tokens`), one already loaded or released, or a
                combination the transfer cannot serve (beam search, prompt_logprobs, a model
                whose blocks before its sliding window are freed).
        """
        if kv_transfer_params is None:
            return None, False
        name = self.args.kv_connector
        if name is None:
            raise ValueError("kv_transfer_params: this engine has no kv_connector (build it with "
                             "EngineArgs(kv_connector='local' or 'ray'))")
        if params.use_beam_search or params.prompt_logprobs is not None:
            raise ValueError("kv_transfer_params: a transferred request cannot use beam search or prompt_logprobs")
        if self.model_config.uniform_window is not None:
            raise ValueError("kv_transfer_params: this model frees the blocks before its sliding window, so its "
                             "prompt K/V cannot be transferred")
        if isinstance(kv_transfer_params, dict):
            if kv_transfer_params != {"do_remote_decode": True}:
                raise ValueError(f"kv_transfer_params must be {{'do_remote_decode': True}} or a KVTransferHandle, "
                                 f"got {kv_transfer_params!r}")
            return None, True
        from kvserve.distributed.kv_transfer import KVTransferHandle, get_connector
        from kvserve.distributed.kv_transfer.base import token_digest

        h = kv_transfer_params
        if not isinstance(h, KVTransferHandle):
            raise ValueError(f"kv_transfer_params must be {{'do_remote_decode': True}} or a KVTransferHandle, "
                             f"got {type(h).__name__}")
        if h.connector != name:
            raise ValueError(f"kv_transfer_params: a handle of the {h.connector!r} connector; this engine's is {name!r}")
        if h.block_size != self.args.block_size or tuple(h.layout) != self._kv_layout():
            raise ValueError(f"kv_transfer_params: blocks of {h.block_size} tokens laid out as {tuple(h.layout)}; this "
                             f"engine's are {self.args.block_size} tokens as {self._kv_layout()}")
        want = self._transfer_tokens(len(ids))
        if h.num_tokens != want or h.prompt_digest != token_digest(ids[: h.num_tokens]):
            raise ValueError(f"kv_transfer_params: the handle holds the K/V of {h.num_tokens} other tokens than this "
                             f"prompt's first {want}")
        if h.num_tokens and not get_connector(name).has(h.key):
            raise ValueError("kv_transfer_params: the handle's blocks can no longer be loaded (already loaded or "
                             "released, dropped, or the engine that saved them is gone)")
        return (h if h.num_tokens else None), False

    def _transfer_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens whose K/V a prefill engine saves for a prompt of ``num_prompt_tokens``: the first
        ``P - 1`` (the decode engine computes the last, for its logits); with a 2-/4-bit cache the
        full blocks among them only (their packed codes and scales; the rows of a partial block
        are in a residual slot, or already quantized with the last token: the decode engine
        computes those at most ``block_size - 1`` tokens too, exactly as a cold run holds them)."""
        n = num_prompt_tokens - 1
        if kv_quant.is_lowbit(self.kv_cache_dtype):
            n -= n % self.args.block_size
        return max(n, 0)

    def _save_kv(self, req: Request) -> None:
        """Save the K/V of ``req``'s first ``P - 1`` prompt tokens for another engine
        (:mod:`kvserve.distributed.kv_transfer`); its handle goes out with the request's final
        output. Called as the sequence finishes, before its blocks are freed."""
        from kvserve.distributed.kv_transfer import KVTransferHandle, get_connector
        from kvserve.distributed.kv_transfer.base import token_digest

        n = self._transfer_tokens(req.num_prompt_tokens)
        connector = get_connector(self.args.kv_connector)
        key, nbytes = None, 0
        if n > 0:
            blocks = self.kv.block_tables[req.request_id][: self.kv.blocks_needed(n)]
            # (the last forward wrote them; nothing after it has run: read them now, before they are freed)
            payloads = self.executor.collective_rpc("save_kv_blocks", (blocks,))
            key = connector.save(payloads)
            nbytes = sum(t.numel() * t.element_size() for p in payloads for pair in p for t in pair)
        self._transfers[req.parent_id] = KVTransferHandle(connector.name, key, n, token_digest(req.prompt_token_ids[:n]),
                                                          self.args.block_size, self._kv_layout(), nbytes)
        self.num_kv_transfer_saved += 1
        self.num_kv_transfer_saved_bytes += nbytes

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
            self._deltas.pop(s.request_id, None)
        handle = self._transfers.pop(request_id, None)
        if handle is not None and handle.key is not None:  # saved, never handed out
            from kvserve.distributed.kv_transfer import get_connector

            get_connector(handle.connector).release(handle.key)

    def finish_samples(self, samples: Sequence[tuple[str, int]]) -> None:
        """Finish samples that the front end ended at a stop string (``finish_reason
        "stop"``): ``(request_id, sample index)`` each. Their blocks are freed (full ones stay
        in the prefix cache); a request none of whose samples runs any more is retired
        without a further output. Unknown ids, and samples already finished, are ignored."""
        now = time.perf_counter()
        for rid, index in samples:
            group = self.groups.get(rid)
            if group is None or group.beam is not None:
                continue
            for s in group.seqs:
                if s.sample_index == index and not s.is_finished:
                    s.metrics.finished_time = now
                    self.scheduler.finish_request(s, RequestStatus.FINISHED_STOPPED)
                    self._deltas.pop(s.request_id, None)
            if group.finished:
                self._retire(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; returns an output for every request that changed.

        Schedule, execute, update. A request whose own part of the step raises (its forward:
        when the batched forward raises, each request group's part is rerun alone to find the
        one at fault; sampling results, stop checks, forking, its output) finishes with an
        error output (``EngineCoreOutput.error``, ``finish_reason="error"`` downstream); its
        blocks are freed (not cached) and the other requests go on. An exception in scheduling
        still propagates.
        """
        _sync_kv_offload(self.kv, self.executor)  # (the disk tier's index as the writes went, before lookups)
        sched = self._schedule()
        if sched is None:
            return []
        # From here on the work is per request: an exception in one request's forward or
        # bookkeeping (a bug, or a tokenizer that chokes on its text) fails that request
        # alone, with finish_reason "error"; the others in the batch go on.
        failed: dict[str, tuple[RequestGroup, Exception]] = {}
        try:
            result = self.executor.execute_model(sched)
        except Exception as e:  # noqa: BLE001 - find the request(s) at fault, run the others
            result = self._execute_per_group(sched, e, failed)
        self.kv.end_step()  # (2-/4-bit KV: the residual slots of blocks this forward filled come back)
        self._update_computed(sched, result, failed)
        self._fork_pending(sched, failed)
        changed = self._update_from_output(sched, result, failed)
        self._compress(sched, failed)
        outputs = []
        for rid, group in changed.items():
            if rid not in failed:
                with self._isolated(group.seqs[0], failed):
                    outputs.append(self._make_output(group))
                    if group.finished:
                        self._retire(group)
        outputs.extend(self._fail_group(group, e) for group, e in failed.values())
        if self.spec is not None:
            self._propose(sched, result, failed)
        return outputs

    def _schedule(self) -> Optional[SchedulerOutput]:
        """The step's plan (None when nothing is to run); records first-scheduled times and
        the prompt tokens about to be computed."""
        sched = self.scheduler.schedule()
        if sched.is_empty and sched.preempted:  # a plan that only made room: admit into it now
            sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (a bug)")
            return None  # (ops recorded stay in self.kv.ops, in order, for the next step that runs)
        # every block copy and swap recorded since the last forward (forks and beam clones after
        # it, aborts, both schedule passes above): the workers apply them before this forward
        sched.kv_ops = self.kv.ops.take()
        now = time.perf_counter()
        for req, n in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                                   - req.num_computed_tokens)
        return sched

    def _update_computed(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                         failed: dict[str, tuple[RequestGroup, Exception]]) -> None:
        """Advance ``num_computed_tokens`` of the requests that ran, cache their full blocks
        and append their prompt logprobs."""
        for req, n in sched.scheduled:
            if self._group_id(req) in failed:
                continue  # its K/V may be half written: never cache it
            req.num_computed_tokens += n
            if req.spec_token_ids:
                continue  # a verification: its drafts' K/V is cached once they are accepted
            with self._isolated(req, failed):
                self.kv.cache_computed(req)  # before _fork_pending: forks share the cached prompt
        by_id = {r.request_id: r for r, _ in sched.scheduled}
        for rid, lps in result.prompt_logprobs.items():
            req = by_id[rid]
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            req.prompt_logprobs.extend(lps)

    def _update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                            failed: dict[str, tuple[RequestGroup, Exception]]) -> dict[str, RequestGroup]:
        """Append the step's tokens: each verification's accepted drafts and correction, each
        sampled token (stop checks and detokenization), and each beam group's next beams once
        all its beams have their rows. Returns the groups that changed, by request id."""
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
        return changed

    # ------------------------------------------------------- KV compression
    def _compress(self, sched: SchedulerOutput, failed: dict[str, tuple[RequestGroup, Exception]]) -> None:
        """Compact the KV of the step's requests whose policy says so
        (:mod:`kvserve.core.kv_compression`): StreamingLLM and H2O once their KV holds ``kept +
        block_size`` tokens (back to ``kept``), SnapKV once, when its prompt (prompt + output, for a
        recomputed request) is computed and longer than the budget. The compaction is recorded for
        the workers (:meth:`KVCacheManager.compress`); when its fresh blocks do not fit now it is
        tried again after the next step."""
        bs = self.kv.block_size
        for req, _ in sched.scheduled:
            cfg = req.kv_compression
            if cfg is None or req.status is not RequestStatus.RUNNING or self._group_id(req) in failed:
                continue
            with self._isolated(req, failed):
                n = req.num_kv_tokens
                keep: Optional[list[int]] = None
                if cfg.method == "snapkv":
                    if req.kv_prompt_compressed or req.num_tokens - req.num_computed_tokens > 1:
                        continue  # (done, or its prompt still has chunks to compute)
                    req.kv_prompt_compressed = True
                    if n <= cfg.kept:
                        continue
                elif n < cfg.kept + bs:
                    continue
                elif cfg.method == "streaming_llm":
                    keep = streaming_keep(n, cfg.sink_tokens, cfg.window)
                if self.kv.compress(req, keep, cfg.kept):
                    self.num_kv_compactions += 1
                    self.num_kv_dropped_tokens += n - cfg.kept
                elif cfg.method == "snapkv":
                    req.kv_prompt_compressed = False  # (try again after the next step)

    # ------------------------------------------------------- speculative decoding
    def _apply_verification(self, req: Request, res: SpecResult, now: float) -> None:
        """Roll back the K/V of a verification's rejected drafts (:meth:`SpecDecodeDriver.rollback`;
        with a 2-/4-bit cache the blocks it wrote are then sealed or keep their residual slot:
        :meth:`KVCacheManager.end_verification`) and append its tokens (accepted drafts, then the
        correction or bonus token)."""
        end = req.num_kv_tokens  # (the step's K/V: the last token and every draft)
        self.spec.rollback(req, res)
        self.kv.end_verification(req, end - 1 - res.num_drafts, end)
        self._append_tokens(req, res.token_ids, res.logprobs, now)
        if not req.is_finished:
            self.kv.cache_computed(req)

    def _propose(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                 failed: dict[str, tuple[RequestGroup, Exception]]) -> None:
        """Draft tokens for the requests of this step that decode next (see
        ``speculative_config`` and :meth:`SpecDecodeDriver.propose`). Beam search decodes
        without drafts. At most ``min(max_tokens - output, max_model_len - num_tokens) - 1``
        drafts are proposed, so that drafts plus the bonus token never pass either limit."""
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
        self.spec.propose(reqs, rooms, {r.request_id for r in self.scheduler.running},
                          lambda req: self._isolated(req, failed))

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
        step; the engine itself goes on. A failure to apply the step's block ops
        (:class:`~kvserve.core.kv_ops.KVCacheOpsError`) is raised: it is no request's."""
        if isinstance(error, (KVCacheOpsError, ExecutorError)):  # no request's fault
            raise error
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
                    # (no kv_ops: the step's were applied before its forward ran and raised)
                    results.append(self.executor.execute_model(SchedulerOutput(scheduled=scheduled)))
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
        self._transfers.pop(group.request_id, None)
        for s in group.seqs:
            self._seq_to_group.pop(s.request_id, None)

    def _fail_group(self, group: RequestGroup, error: Exception) -> EngineCoreOutput:
        """Finish every sequence of a group whose bookkeeping raised: ``finish_reason="error"``,
        the message in ``RequestOutput.error``; its KV blocks are freed (not cached)."""
        if isinstance(error, GrammarLimitError):  # (the request's own grammar: its input, not an engine fault)
            logger.warning("request %s failed (its grammar: %s); the engine goes on without it", group.request_id,
                           error)
        else:
            logger.error("request %s failed; the engine goes on without it", group.request_id, exc_info=error)
        msg = f"{type(error).__name__}: {error}"
        group.pending_forks.clear()
        now = time.perf_counter()
        for s in group.seqs:
            s.error = msg
            if not s.is_finished:
                s.metrics.finished_time = now
                self.scheduler.finish_request(s, RequestStatus.FINISHED_ERROR)
        samples = [d for s in group.seqs if (d := self._deltas.pop(s.request_id, None)) is not None]
        self._retire(group)
        lead = group.seqs[0]
        transfer_stats, lead.kv_transfer_stats = lead.kv_transfer_stats, None
        return EngineCoreOutput(group.request_id, samples, True, lead.metrics, lead.num_cached_tokens, error=msg,
                                error_param=error.param if isinstance(error, GrammarLimitError) else None,
                                kv_transfer_stats=transfer_stats)

    def _append_token(self, req: Request, tok: int, lp: TokenLogprob, now: float) -> None:
        self._append_tokens(req, [tok], [lp], now)

    def _append_tokens(self, req: Request, toks: list[int], lps: list[TokenLogprob], now: float) -> None:
        """Append generated tokens with their token-level stop checks
        (:func:`~kvserve.engine.core_output.append_output_tokens`), finish the request where
        they end it, and keep the delta for the step's output."""
        status, delta = append_output_tokens(req, toks, lps, now, self.max_model_len)
        self.num_generated_tokens += len(delta.new_token_ids)
        prev = self._deltas.get(req.request_id)
        if prev is None:
            self._deltas[req.request_id] = delta
        else:
            prev.extend(delta)
        if status is not None:
            if req.kv_save:
                self._save_kv(req)
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

    def _make_output(self, group: RequestGroup) -> EngineCoreOutput:
        """The group's :class:`EngineCoreOutput`: its samples' deltas of this step, the prompt
        logprobs not reported yet, and for a beam search the best ``n`` beams."""
        lead = group.seqs[0]
        params = group.params
        samples = [d for s in group.seqs if (d := self._deltas.pop(s.request_id, None)) is not None]
        new_plp = None
        if params.prompt_logprobs is not None:
            new_plp = lead.prompt_logprobs[group.num_prompt_logprobs_sent:]
            group.num_prompt_logprobs_sent = len(lead.prompt_logprobs)
        beams = None
        if group.beam is not None:
            beams = [BeamOutput(list(h.token_ids), h.cum_logprob, h.finished_by_eos)
                     for h in group.beam.best(params.n)]
        transfer_stats, lead.kv_transfer_stats = lead.kv_transfer_stats, None  # (sent once)
        return EngineCoreOutput(group.request_id, samples, group.finished, lead.metrics, lead.num_cached_tokens,
                                new_plp, beams, kv_transfer_params=self._transfers.get(group.request_id)
                                if group.finished else None, kv_transfer_stats=transfer_stats)

    # --------------------------------------------------------------- metrics
    def spec_stats(self) -> dict:
        """Speculative-decoding counters (:meth:`SpecDecodeDriver.stats`); all 0 without speculation."""
        return self.spec.stats() if self.spec is not None else SpecDecodeDriver.empty_stats()

    def swap_stats(self) -> dict:
        """The swap space's counters (:meth:`kvserve.core.kv_swap.KVSwapSpace.stats`): swap-outs and
        swap-ins (requests), blocks moved each way, recompute fallbacks, host pool blocks and
        usage; all 0 without a swap space."""
        if self.swap is not None:
            return self.swap.stats()
        return {"swap_num_swap_outs": 0, "swap_num_swap_ins": 0, "swap_num_swapped_out_blocks": 0,
                "swap_num_swapped_in_blocks": 0, "swap_num_recompute_fallbacks": 0, "swap_num_dropped": 0,
                "swap_blocks_total": 0, "swap_blocks_used": 0, "swap_num_swapped_residuals": 0,
                "swap_residual_slots_total": 0, "swap_residual_slots_used": 0, "swap_usage": 0.0, "num_swapped": 0}

    def flush_kv_offload(self) -> None:
        """Wait until the disk tier's queued writes and deletions are done and take in their
        outcomes (its counters are then exact); a no-op without a disk tier."""
        if self.kv.offload is not None:
            self.executor.collective_rpc("flush_kv_offload")
            _sync_kv_offload(self.kv, self.executor)

    def kv_offload_pending(self) -> bool:
        """Whether disk-tier writes are in flight whose outcome :meth:`stats` has not counted yet."""
        return self.kv.offload is not None and self.kv.offload.awaiting_reports

    def stats(self) -> dict:
        """Engine counters: running/waiting requests, KV usage, preemptions, swaps, tokens (the
        disk tier's write outcomes reported so far: :meth:`flush_kv_offload` waits for them)."""
        _sync_kv_offload(self.kv, self.executor)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_usage": self.kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_priority_preemptions": self.scheduler.num_priority_preemptions,
            "num_fair_preemptions": self.scheduler.num_fair_preemptions,
            "num_chunked_prefills": self.scheduler.num_chunked_prefills,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "generated_tokens": self.num_generated_tokens,
            "kv_transfer_saved": self.num_kv_transfer_saved,
            "kv_transfer_saved_bytes": self.num_kv_transfer_saved_bytes,
            "kv_compactions": self.num_kv_compactions,  # KV compression: compactions applied
            "kv_compression_dropped_tokens": self.num_kv_dropped_tokens,  # tokens they dropped
            **self.spec_stats(),
            **self.swap_stats(),
            **self.kv.stats(),  # prefix-cache queries/hits/hit rates/evictions, blocks free/cached/in use
        }


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests; retry later (HTTP 503)."""
