"""The paged KV cache: pool sizing from a memory budget, the K/V tensors, per-request
block tables and the prefix cache (:class:`KVCacheManager`).

Per layer there is one K pool and one V pool, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A request's block table lists the blocks holding its tokens in order; token at
position ``p`` lives in slot ``block_table[p // block_size] · block_size + p % block_size``.

Sliding windows (``sliding_window``, for models whose every layer is windowed: Mistral v0.1;
Beltagy et al. 2020, Mistral 7B's rolling buffer, Jiang et al. 2023, vLLM's sliding-window KV
manager): the query at position p attends to ``(p - W, p]`` only, so once a block lies
entirely before the window of the first token a step computes, no later token reads it; the
manager then drops the request's reference to it (the block returns to the pool unless a fork
still shares it) and sets its table entry to :data:`FREED_BLOCK`. Tables stay positional (entry
i still stands for positions ``[i·bs, (i+1)·bs)``), the freed entries form a prefix of the
table, and the attention kernels never reach them (they start at the window's first block). A
sequence of any length then holds at most ``ceil((W - 1 + chunk) / block_size) + 1`` blocks
(:meth:`KVCacheManager.blocks_to_run`). Models with some full-attention layers (Gemma 3) keep
every block: their full layers read the whole context, and per-layer-group block tables (vLLM's
hybrid allocator) are not implemented; their windowed layers still read only the window.

KV compression (:mod:`kvserve.core.kv_compression`: StreamingLLM, SnapKV, H2O, per request):
:meth:`KVCacheManager.compress` moves a request's kept tokens to the first slots of a table of
``ceil(kept / block_size)`` blocks (rewritten in place where the request alone holds them, fresh
copies where a fork or the prefix cache shares them) and frees the rest; the request's
``num_dropped_tokens`` then separates a token's KV index (its slot) from its position, and every
size here counts KV tokens (:attr:`Request.num_kv_tokens`). A compacted request inserts nothing
more into the prefix cache (its blocks hold a selection, not a prefix). With a 2-/4-bit cache
the kept tokens are requantized into the new blocks and the partial last one keeps a residual
slot (:mod:`kvserve.worker.kv_compressor`).
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from kvserve.worker import kv_quant
from kvserve.worker.kv_block_mover import KVBlockMover
from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_ops import Compaction, KVCacheOps
from kvserve.core.kv_offload import KVOffloadTier
from kvserve.config import ModelConfig
from kvserve.core.radix_cache import Namespace, PartialMatch, RadixCache, RadixNode, make_namespace
from kvserve.core.request import Request

logger = logging.getLogger(__name__)

GiB = 1 << 30

#: Block-table entry of a block freed because it lies before the sliding window (never read).
FREED_BLOCK = -1


def held_blocks(table: Sequence[int]) -> list[int]:
    """The blocks a table really references (its entries other than :data:`FREED_BLOCK`)."""
    return [b for b in table if b != FREED_BLOCK]


@dataclass(slots=True)
class KVCacheSpec:
    """The sizes derived from the budget.

    Attributes:
        bytes_per_token: ``2 · num_layers · num_kv_heads · head_dim · dtype_bytes`` (8-bit pools:
            ``head_dim + 4`` bytes per head, :mod:`kvserve.worker.kv_quant`).
        num_blocks, block_size: pool geometry.
        dtype: the pools' dtype (the model dtype, ``torch.int8`` or ``torch.float8_e4m3fn``).
        capacity_tokens: ``num_blocks · block_size``.
        max_model_len: the longest sequence (tokens).
        budget_note: how the budget was chosen when ``kv_cache_memory`` was not given
            (:func:`default_kv_cache_memory`); "" otherwise.
        tp_size: tensor-parallel ranks: each holds ``num_blocks`` blocks of its own KV heads
            (:meth:`kvserve.config.ModelConfig.heads_per_rank`), and ``bytes_per_token`` is per
            rank. The block ids are the same on every rank.
    """

    bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int
    dtype: Optional[torch.dtype] = None
    budget_note: str = ""  # how the budget was chosen, when it was not given (ends the describe() line)
    tp_size: int = 1
    residual_blocks: int = 0  # int4/int2: residual slots (model-dtype partial blocks, kv_quant_lowbit)
    residual_bytes: int = 0  # their bytes (all layers, K and V), inside the budget

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_full_sequences(self) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once."""
        return self.capacity_tokens / self.max_model_len

    def describe(self) -> str:
        return (
            f"KV cache: {kv_quant.describe('auto', self.dtype)}, {self.bytes_per_token} bytes/token"
            + (f" on each of {self.tp_size} tensor-parallel ranks" if self.tp_size > 1 else "")
            + f", {self.num_blocks} blocks x {self.block_size} "
            f"tokens = {self.capacity_tokens} tokens ({self.num_blocks * self.block_size * self.bytes_per_token / GiB:.2f} GiB); "
            f"{self.max_concurrent_full_sequences:.1f} sequences of max_model_len={self.max_model_len} fit"
            + (f"; + {self.residual_blocks} residual blocks in the model dtype ({self.residual_bytes / GiB:.3f} GiB)"
               if self.residual_blocks else "")
            + (f" [{self.budget_note}]" if self.budget_note else "")
        )


def plan_kv_cache(cfg: ModelConfig, dtype: torch.dtype, memory_gib: float, block_size: int,
                  max_model_len: int, num_blocks: Optional[int] = None, tp_size: int = 1,
                  residual_blocks: int = 0, model_dtype: Optional[torch.dtype] = None) -> KVCacheSpec:
    """Size the pool: ``num_blocks = floor(budget / (bytes_per_token · block_size))``.

    ``dtype`` is the pools' dtype: the model dtype, or ``torch.int8``/``torch.float8_e4m3fn`` for
    an 8-bit cache (~1.9x the tokens of bf16 in the same budget, scales included), or
    ``torch.uint4``/``torch.uint2`` for a 2-/4-bit cache (:mod:`kvserve.worker.kv_quant_lowbit`):
    then ``residual_blocks`` model-dtype (``model_dtype``) blocks for the partial blocks come out of
    the budget first, and a block's bytes are its codes plus float16 scales and zeros. With
    ``tp_size`` ranks, the budget and ``bytes_per_token`` are each rank's (its KV heads only).

    Raises:
        ValueError: if the budget holds no block, or ``memory_gib`` is not positive.
    """
    bpt = cfg.kv_bytes_per_token(dtype, tp_size, block_size)
    res_bytes = 0
    block_bytes = bpt * block_size
    if kv_quant.is_lowbit(dtype):
        from kvserve.worker import kv_quant_lowbit as lb

        kv_heads = cfg.num_kv_heads if tp_size == 1 else cfg.heads_per_rank(tp_size)[1]
        bits = lb.bits_of(dtype)
        block_bytes = cfg.num_layers * kv_heads * sum(lb.block_bytes(block_size, cfg.head_dim, bits, k)
                                                      for k in (True, False))
        res_bytes = lb.residual_bytes(cfg.num_layers, residual_blocks, block_size, kv_heads, cfg.head_dim,
                                      model_dtype or torch.bfloat16)
    if num_blocks is None:
        if not memory_gib > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {memory_gib}")
        num_blocks = (int(memory_gib * GiB) - res_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={memory_gib} GiB holds no block of {block_size} tokens at {bpt} bytes/token"
            + (f" after {res_bytes / GiB:.3f} GiB of residual blocks (kv_cache_dtype int4/int2)" if res_bytes else "")
        )
    return KVCacheSpec(bpt, num_blocks, block_size, max_model_len, dtype, tp_size=tp_size,
                       residual_blocks=residual_blocks, residual_bytes=res_bytes)


#: The default KV budget's ceiling (GiB): the fixed default of kvserve before it was sized from the machine.
DEFAULT_KV_CACHE_MAX_GIB = 2.0
#: Default share of the memory available after the model loads that the KV pool is given.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.5


def default_kv_cache_memory(bytes_per_token: int, block_size: int, max_model_len: int, max_num_seqs: int,
                            available: Optional[int], fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION, *,
                            sliding_window: Optional[int] = None, max_num_batched_tokens: int = 2048,
                            max_gib: float = DEFAULT_KV_CACHE_MAX_GIB, device: str = "cpu") -> tuple[float, str]:
    """The KV budget when ``kv_cache_memory`` is not given (vLLM's ``--gpu-memory-utilization``
    idea, applied to what is left once the model is loaded):

    ``budget = max(one_sequence, min(fraction · available, max_gib, max_num_seqs · one_sequence))``

    where ``one_sequence`` is the KV of one ``max_model_len``-token sequence (whole blocks; with
    a sliding window over every layer, the blocks such a sequence holds at once), so that a
    request of the full context always fits; ``max_gib`` keeps big machines at the old 2 GiB and
    ``max_num_seqs · one_sequence`` is the most the scheduler could ever fill.

    Args:
        bytes_per_token: KV bytes per token (all layers, K and V; :meth:`ModelConfig.kv_bytes_per_token`).
        block_size: tokens per block.
        max_model_len: longest sequence (tokens).
        max_num_seqs: most running sequences.
        available: bytes that can still be allocated on the device (``MemAvailable`` on a CPU,
            :func:`available_memory`); None where unknown (then ``max_gib``, at least one sequence).
        fraction: share of ``available`` to take, in (0, 1].
        sliding_window, max_num_batched_tokens: a window over every layer bounds one sequence's blocks.
        max_gib: the ceiling (GiB).
        device: named in the error.

    Returns:
        ``(budget in GiB, why)``: ``why`` says in words how it was chosen (for the capacity log line).

    Raises:
        ValueError: naming ``max_model_len``, when ``available`` does not hold even one sequence.
    """
    block_bytes = bytes_per_token * block_size
    blocks = -(-max_model_len // block_size)
    if sliding_window is not None:
        blocks = min(blocks, -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1)
    one = blocks * block_bytes
    ceiling = min(max_gib * GiB, max_num_seqs * one)
    if available is None:
        budget = max(one, ceiling)
        return budget / GiB, (f"kv_cache_memory auto: memory available on {device} unknown, "
                              f"{budget / GiB:.2f} GiB (at most {max_gib:g} GiB, at least one sequence)")
    if one > available:
        raise ValueError(
            f"max_model_len={max_model_len}: one sequence of {max_model_len} tokens needs {one / GiB:.3f} GiB of KV "
            f"cache, but only {available / GiB:.3f} GiB of memory is available on {device} once the model is loaded; "
            f"lower max_model_len (--max-model-len), store the KV cache in 8 bits (--kv-cache-dtype int8), "
            f"or free memory")
    share = fraction * available
    budget = max(one, min(share, ceiling))
    why = f"kv_cache_memory auto: {fraction:g} x {available / GiB:.2f} GiB available on {device} = {share / GiB:.2f} GiB"
    if budget == one and share < one:
        why += f", raised to one sequence of max_model_len={max_model_len}"
    elif budget < share:
        why += (f", capped at {budget / GiB:.2f} GiB" + (f" (max_num_seqs={max_num_seqs} full sequences)"
                                                          if budget == max_num_seqs * one else ""))
    return budget / GiB, why


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes that can still be allocated on ``device``: ``MemAvailable`` of ``/proc/meminfo`` on
    CPU, the free memory of a CUDA device; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def zeroed_host_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are committed only when first written.

    Backed by an anonymous private ``mmap`` (the kernel hands out zero pages on demand;
    reading an untouched page maps the shared zero page and costs no memory). The tensor keeps
    the map alive and the map is released with the tensor. Page-aligned, contiguous.

    Raises:
        OSError: the map could not be created (address space exhausted).
    """
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(tuple(shape))


def allocate_kv_cache(cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype,
                      device: torch.device, model_dtype: Optional[torch.dtype] = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate the per-layer K and V pools once, zero-filled.

    On the CPU each pool is an anonymous private memory map (:func:`zeroed_host_tensor`): it
    reads as zeros, as ``torch.zeros`` would, but a page joins the process's resident memory
    only when a token is first written there, so starting takes no time for the pool and an
    idle server holds only the KV it has used (``torch.zeros`` writes every page of a 2 GiB
    pool at start: seconds, and all of it resident). On CUDA: ``torch.zeros``.

    Returns:
        ``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors of
        ``dtype`` (8-bit pools, ``dtype`` int8 or float8_e4m3fn: ``head_dim + 4`` last, the codes
        and the scale of each token and head; :mod:`kvserve.worker.kv_quant`). ``num_kv_heads``
        is one rank's (:meth:`~kvserve.config.ModelConfig.heads_per_rank` of ``spec.tp_size``).
        2-/4-bit caches (``dtype`` ``torch.uint4``/``torch.uint2``): pairs of
        :class:`~kvserve.worker.kv_quant_lowbit.LowBitPool` (their residual slots in ``model_dtype``).

    Raises:
        ValueError: the pool (``num_blocks · block_size · bytes_per_token`` bytes) is larger than
            the memory still available on the device, or its allocation failed.
    """
    need = spec.num_blocks * spec.block_size * spec.bytes_per_token + spec.residual_bytes
    have = available_memory(device)
    if have is not None and need > have:
        raise ValueError(f"kv_cache_memory: the KV pool needs {need / GiB:.2f} GiB ({spec.num_blocks} blocks), "
                         f"but only {have / GiB:.2f} GiB is available on {torch.device(device)}; lower "
                         f"kv_cache_memory (--kv-cache-memory), or num_blocks if you set it")
    kv_heads = cfg.num_kv_heads if spec.tp_size == 1 else cfg.heads_per_rank(spec.tp_size)[1]
    zeros = zeroed_host_tensor if torch.device(device).type == "cpu" else (
        lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    if kv_quant.is_lowbit(dtype):
        from kvserve.worker import kv_quant_lowbit as lb

        return lb.allocate_pools(cfg.num_layers, spec.num_blocks, spec.block_size, kv_heads, cfg.head_dim,
                                 lb.bits_of(dtype), spec.residual_blocks, model_dtype or torch.bfloat16, device,
                                 zeros=zeros)
    shape = (spec.num_blocks, spec.block_size, kv_heads, kv_quant.row_elements(cfg.head_dim, dtype))
    try:
        return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(cfg.num_layers)]
    except (RuntimeError, MemoryError, OSError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise ValueError(f"kv_cache_memory: could not allocate the KV pool of {need / GiB:.2f} GiB on "
                         f"{torch.device(device)} ({e}); lower kv_cache_memory (--kv-cache-memory), "
                         f"or num_blocks if you set it") from e


class ResidualSlots:
    """The residual slots of a 2-/4-bit KV cache (:mod:`kvserve.worker.kv_quant_lowbit`): model-dtype
    side buffers for the blocks that are not full (KIVI's full-precision residual).

    The KV manager gives a slot to every block that holds a partial block's rows after a step
    (:meth:`ensure`: a sequence's last block, the destination of a partial-block copy) and marks
    for release the blocks that fill in a step and the blocks freed (:meth:`release_later`); the
    marked slots come back after the next forward (:meth:`end_step`), since that forward (or a
    block copy applied before it) still reads them. A speculative verification step is the
    exception: every block it writes holds a slot through the step (the step quantizes the blocks
    it fills *and* keeps their model-dtype rows), and after sampling
    (:meth:`KVCacheManager.end_verification`) the blocks full of accepted tokens are unmapped
    (:meth:`detach`: sealed), the block of the first rejected draft keeps its slot (its accepted
    rows), and later blocks release theirs. ``map`` (``[num_blocks]`` int64, ``-1``: none)
    is what the workers read (:class:`kvserve.worker.model_runner.ModelRunner` puts it into every
    step's attention metadata).

    Args:
        num_blocks: blocks of the pool.
        num_slots: residual slots (≥ 1).

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"residual slots must be ≥ 1, got {num_slots}")
        self.num_slots = num_slots
        self.map = torch.full((num_blocks,), -1, dtype=torch.long)
        self._slot: dict[int, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pending: set[int] = set()
        self._detached: list[int] = []  # slots taken from blocks that now hold loaded data (freed at end_step)
        self.num_short = 0  # allocations, forks and clones refused for want of a slot (a counter)

    @property
    def num_free(self) -> int:
        """Slots that :meth:`ensure` can hand out now."""
        return len(self._free)

    def can_take(self, n: int = 1) -> bool:
        """Whether ``n`` slots are free (counts a refusal in :attr:`num_short` when not)."""
        if len(self._free) >= n:
            return True
        self.num_short += 1
        return False

    def has(self, block: int) -> bool:
        return block in self._slot

    def ensure(self, block: int) -> bool:
        """Give ``block`` a slot (keep its own, unmarking it); False when none is free."""
        self._pending.discard(block)
        if block in self._slot:
            return True
        if not self._free:
            return False
        s = self._free.pop()
        self._slot[block] = s
        self.map[block] = s
        return True

    def release_later(self, block: int) -> None:
        """Mark ``block``'s slot (if any) for release after the next forward."""
        if block in self._slot:
            self._pending.add(block)

    def detach(self, blocks) -> None:
        """Blocks whose full, quantized contents were just written by a move (a disk-tier or KV
        connector load, a swap-in) rather than by a forward: unmap any slot they still hold (a slot
        a freed block marked for release, which readers would otherwise take for the block's rows);
        the slot itself comes back at :meth:`end_step`, like the marked ones."""
        for b in blocks:
            s = self._slot.pop(b, None)
            if s is not None:
                self._pending.discard(b)
                self.map[b] = -1
                self._detached.append(s)

    def end_step(self) -> None:
        """Release the marked slots (call after each forward)."""
        for b in self._pending:
            self._free.append(self._slot.pop(b))
            self.map[b] = -1
        self._pending.clear()
        self._free.extend(self._detached)
        self._detached.clear()


@dataclass(slots=True)
class PrefixCacheMetrics:
    """Prefix-cache counters of a :class:`KVCacheManager` (all token counts are tokens).

    A *query* is the admission of a request: its tokens are looked up in the cache once,
    when it is admitted (not on every step it waits). First admissions and re-admissions
    after a preemption are counted apart, so that recomputation after preemption does not
    inflate the hit rate of real traffic.

    Attributes:
        requests: first admissions that queried the cache.
        query_tokens: prompt tokens of those requests.
        hit_tokens: of those, tokens served from the cache (full blocks plus a copied
            partial block) instead of being computed.
        resumed_requests, resumed_query_tokens, resumed_hit_tokens: the same for
            re-admissions of preempted requests (prompt + output so far).
        evicted_blocks: blocks evicted from the cache to make room.
        window: how many recent first admissions :attr:`recent_hit_rate` covers.
    """

    window: int = 1000
    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    resumed_requests: int = 0
    resumed_query_tokens: int = 0
    resumed_hit_tokens: int = 0
    evicted_blocks: int = 0
    _recent: deque = field(default_factory=deque)
    _recent_query: int = 0
    _recent_hit: int = 0

    def record(self, query_tokens: int, hit_tokens: int, resumed: bool) -> None:
        """Count one admission."""
        if resumed:
            self.resumed_requests += 1
            self.resumed_query_tokens += query_tokens
            self.resumed_hit_tokens += hit_tokens
            return
        self.requests += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        self._recent.append((query_tokens, hit_tokens))
        self._recent_query += query_tokens
        self._recent_hit += hit_tokens
        while len(self._recent) > self.window:
            q, h = self._recent.popleft()
            self._recent_query -= q
            self._recent_hit -= h

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` since start (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """Hit rate in tokens over the last :attr:`window` first admissions."""
        return self._recent_hit / self._recent_query if self._recent_query else 0.0


def _tokens(req: Request, n: int) -> list[int]:
    """The first ``n`` tokens of prompt + output."""
    p = req.prompt_token_ids
    return p[:n] if n <= len(p) else p + req.output_token_ids[: n - len(p)]


class KVCacheManager:
    """Owns the block pool, every request's block table and (optionally) the prefix cache.

    With ``enable_prefix_caching`` the KV of every computed full block is kept in a
    :class:`~kvserve.core.radix_cache.RadixCache` and reused by later requests that start with
    the same tokens in the same namespace (model, adapter, ``cache_salt``). The rules:

    * **Admission** (:meth:`admit`): the request's tokens are matched against the tree,
      capped at ``num_tokens - 1`` so the last token is always computed (a fully cached
      prompt still gets a one-token prefill and its first logits). Full matched blocks
      are shared (one more reference each) and the matched node is locked; where the match
      continues into a cached block for ``1..block_size-1`` tokens, those tokens' K/V are
      copied into the request's first new block (token-granular reuse; the copy is recorded
      in :attr:`ops` and done by the workers before the forward, like every block copy here).
    * **After each step** (:meth:`cache_computed`): the request's newly *computed* full
      blocks are inserted into the tree and its lock moves down to the new node.
    * **Finish / preemption** (:meth:`free`): the same insert, then unlock and drop the
      request's references; the blocks stay cached (evictable) until memory is needed.
    * **Memory pressure** (:meth:`allocate_slots`, :meth:`admit`): unlocked cached blocks
      are evicted (LRU leaves first) before an allocation fails; the scheduler preempts
      only when eviction cannot free enough.

    Every cached block a request references lies on the path of the node it has locked,
    so the cached blocks of unlocked nodes are referenced by the tree alone and
    ``num_empty_blocks + num_cached_blocks + num_used_blocks == num_blocks``
    (``num_free_blocks`` is empty + cached: what requests can get).

    Requests that ask for ``prompt_logprobs`` never take hits for prompt positions whose
    logprobs they do not have yet (they still insert their blocks).

    Args:
        num_blocks, block_size: pool geometry.
        enable_prefix_caching: keep and reuse computed KV blocks.
        kv_caches: None (the engine core: the pools are the workers'): the block copies
            (partial prefix-cache hits, forks, beam clones) are recorded in :attr:`ops`
            (:mod:`kvserve.core.kv_ops`) for the caller to hand to the workers before the next
            forward. Or pools in this process, per layer ``(K, V)``, each ``[num_blocks,
            block_size, num_kv_heads, head_dim]`` (unit tests, a draft model's own pool): the
            manager then applies each copy to them at once
            (:class:`~kvserve.worker.kv_block_mover.KVBlockMover`) and :attr:`ops` stays empty.
        kv_loader: with ``kv_caches`` None, how a load of blocks another engine saved (a KV
            transfer, :meth:`admit`) is applied at once: called with the ops recorded so far
            (:meth:`KVCacheOps.take`, the load last), it applies them in order on the pools
            (the engine core: :meth:`Worker.load_kv_blocks` on every worker) and raises
            :class:`~kvserve.distributed.kv_transfer.KVTransferError` when the load failed (the
            moves before it applied). Applied at admission, a failed load is one request's and
            :meth:`admit` falls back to recomputing its prompt. Without pools or a loader the
            load is recorded in :attr:`ops` like a copy, for the caller to apply before the next
            forward, and a failure there is the caller's (the engine core passes a loader).
        namespace_model: the model part of the cache namespace (model path or name; the
            tokenizer comes from the same path).
        hit_rate_window: requests covered by the recent hit rate.
        partial_block_reuse: copy a partially matching block (token-granular reuse);
            False reuses full blocks only.
        sliding_window: the window (tokens) of a model whose every layer is windowed: blocks
            before the window of a request's next token are freed (module docstring); None
            keeps every block.
        offload: the prefix cache's disk tier (:class:`~kvserve.core.kv_offload.KVOffloadTier`,
            recording into this manager's :attr:`ops`; needs prefix caching): blocks the tree
            evicts are written to disk, and :meth:`admit` continues a request's match into the
            blocks on disk, loading them (as a KV transfer's load: ``kv_loader`` or the local
            pools' mover) and inserting them into the tree. None: no disk tier.
        residual_blocks: a 2-/4-bit cache's residual slots (:class:`ResidualSlots`, :attr:`residual`):
            every block partly written after a step gets one (an allocation that needs a slot when
            none is free fails like one short of blocks); 0: none (other formats). With residual
            slots ``partial_block_reuse`` is off: the prefix cache serves full (quantized) blocks only,
            so that a hit gives exactly the tokens of a cold run.

    Raises:
        ValueError: ``hit_rate_window`` < 1, ``sliding_window`` < 1, or ``sliding_window`` with
            prefix caching (the radix cache keeps whole prefixes locked while a request runs,
            so its early blocks could not be freed), or ``offload`` without prefix caching.

    Attributes:
        ops: the block copies recorded and not yet handed over (:meth:`KVCacheOps.take`); the
            engine core's swap space records its swaps here too, so that one list holds them
            all in order.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        kv_caches: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None,
        *,
        namespace_model: str = "model",
        hit_rate_window: int = 1000,
        partial_block_reuse: bool = True,
        sliding_window: Optional[int] = None,
        kv_loader: Optional[Callable[[KVCacheOps], None]] = None,
        offload: Optional[KVOffloadTier] = None,
        residual_blocks: int = 0,
    ) -> None:
        if hit_rate_window < 1:
            raise ValueError(f"hit_rate_window must be ≥ 1, got {hit_rate_window}")
        if sliding_window is not None and (sliding_window < 1 or enable_prefix_caching):
            raise ValueError(f"sliding_window must be ≥ 1 tokens and needs prefix caching off, got "
                             f"{sliding_window} with enable_prefix_caching={enable_prefix_caching}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.residual: Optional[ResidualSlots] = None
        # 2-/4-bit caches with speculative decoding (end_verification): blocks that verification
        # steps filled with accepted tokens only (sealed), and blocks they filled that kept their
        # residual slot because rejected drafts' rows were among the block's rows
        self.num_verify_sealed = 0
        self.num_verify_unsealed = 0
        if residual_blocks:
            self.residual = ResidualSlots(num_blocks, residual_blocks)
            self.pool.on_free = self.residual.release_later
        self.block_tables: dict[str, list[int]] = {}
        self.kv_caches = kv_caches
        self.ops = KVCacheOps()
        # KV transfers (prefill/decode disaggregation) taken in: blocks and bytes loaded, seconds
        # spent applying loads (fetch and write; failed ones too), loads that failed (recomputed)
        self.num_transfer_loaded_blocks = 0
        self.num_transfer_loaded_bytes = 0
        self.num_transfer_load_seconds = 0.0
        self.num_transfer_failed = 0
        self._mover = None if kv_caches is None else KVBlockMover(kv_caches)
        self._loader = kv_loader
        self.namespace_model = namespace_model
        # 2-/4-bit caches reuse full blocks only: a cached block is quantized, and its first rows
        # dequantized into a new block's residual would differ from the model-dtype rows a cold run
        # holds there (the block's codes and the next tokens' attention would depend on the hit)
        self.partial_block_reuse = partial_block_reuse and not residual_blocks
        if offload is not None and not enable_prefix_caching:
            raise ValueError("kv_offload_dir: the disk tier extends the prefix cache, which is off "
                             "(enable_prefix_caching=False, or a model whose every layer has a sliding window)")
        if offload is not None:
            offload.ops = self.ops
        self.offload = offload
        self.cache: Optional[RadixCache] = RadixCache(
            self.pool, on_evict=offload.on_evict if offload is not None else None) if enable_prefix_caching else None
        self.metrics = PrefixCacheMetrics(window=hit_rate_window)
        self._nodes: dict[str, RadixNode] = {}  # request id → the tree node it has locked

    # ------------------------------------------------------------------ counters
    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: empty ones plus cached ones that can be evicted (what an
        allocation can get)."""
        return self.pool.num_free + self.num_cached_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Blocks nobody references, not even the prefix cache."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks no request uses: evictable on demand."""
        return self.cache.evictable_blocks if self.cache is not None else 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by requests (cached or not)."""
        return self.pool.num_blocks - self.pool.num_free - self.num_cached_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_to_run(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once when it computes at most
        ``max_chunk`` tokens a step: all of them, or with a sliding window W the blocks of
        positions ``(first - W, first + max_chunk)`` of a step computing from ``first``, at most
        ``ceil((W - 1 + max_chunk) / block_size) + 1``."""
        need = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return need
        return min(need, self.blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the request references (freed entries of its table not counted)."""
        return len(held_blocks(self.block_tables.get(request.request_id, [])))

    def _free_outside_window(self, table: list[int], num_computed: int) -> None:
        """Free the blocks of ``table`` that lie entirely before the window of position
        ``num_computed`` (the first token the next step computes): blocks ``[0, n)`` with
        ``n = max(0, num_computed - W + 1) // block_size``. Amortized O(1) per freed block (the
        freed entries are a prefix)."""
        n = min(max(0, num_computed - self.sliding_window + 1) // self.block_size, len(table))
        i = n
        while i > 0 and table[i - 1] != FREED_BLOCK:
            i -= 1
        if i < n:
            self.pool.decref(table[i:n])
            table[i:n] = [FREED_BLOCK] * (n - i)

    def namespace(self, request: Request) -> Namespace:
        """Cache namespace of a request: model, adapter (``request.adapter_id`` if the
        request has one) and ``cache_salt``, each in its own tagged slot."""
        return make_namespace(self.namespace_model, getattr(request, "adapter_id", None), request.cache_salt)

    def has_blocks(self, request: Request) -> bool:
        """Whether the request holds a block table (running, or forked and waiting)."""
        return request.request_id in self.block_tables

    # ------------------------------------------------------------------ allocation
    def _make_room(self, need: int, headroom: int = 0) -> bool:
        """Make ``need`` blocks free, evicting cached blocks if needed, provided that
        ``need + headroom`` blocks are available (free or evictable); evicts nothing if not."""
        free = self.pool.num_free
        if need + headroom <= free:
            return True
        if need + headroom > free + self.num_cached_blocks:
            return False
        if need > free:
            assert self.cache is not None
            self.metrics.evicted_blocks += self.cache.evict(need - free)
            if self._mover is not None and self.ops:  # (local pools: the disk tier's writes at once)
                self._mover.apply(self.ops.take())
        return self.pool.num_free >= need

    def _residual_blocks(self, before: int, after: int, verify: bool) -> range | tuple[int, ...]:
        """Table indices of the blocks that need a residual slot for a step computing tokens
        ``[before, after)``: the block of token ``before`` if partial and the block of token
        ``after`` if partial after the step; for a verification (``verify``) every block the step
        writes, since its acceptance decides which of them end up partial (:meth:`end_verification`)."""
        bs = self.block_size
        if verify and after > before:
            return range(before // bs, (after - 1) // bs + 1)
        return tuple(sorted({i for i, partial in ((before // bs, before % bs), (after // bs, after % bs)) if partial}))

    def _residual_room(self, table: Sequence[int], before: int, after: int, verify: bool = False) -> bool:
        """Whether the residual slots a step from ``before`` to ``after`` tokens needs are free."""
        r = self.residual
        if r is None:
            return True
        need = sum(1 for i in self._residual_blocks(before, after, verify) if not (i < len(table) and r.has(table[i])))
        return r.can_take(need)

    def _residual_step(self, table: Sequence[int], before: int, after: int, verify: bool = False) -> None:
        """Residual slots of a table about to compute tokens ``[before, after)``: the block holding
        token ``before`` (if partial) keeps or gets one, released after the step if the step fills
        it; the block of token ``after`` (if partial after the step) gets one. A verification
        (``verify``: the request's last token and its drafts) gives every block it writes a slot
        and releases none: which blocks are full of accepted tokens is known only after sampling
        (:meth:`end_verification`). Call with :meth:`_residual_room` true."""
        r = self.residual
        if r is None:
            return
        if verify:
            for i in self._residual_blocks(before, after, True):
                r.ensure(table[i])
            return
        bs = self.block_size
        i0 = before // bs
        if before % bs:
            r.ensure(table[i0])
            if after >= (i0 + 1) * bs:
                r.release_later(table[i0])
        if after % bs:
            r.ensure(table[after // bs])

    def end_verification(self, request: Request, first: int, end: int) -> None:
        """After a verification wrote KV indices ``[first, end)`` of ``request`` and its rejected
        drafts were rolled back (``request.num_kv_tokens`` counts the accepted ones), settle the
        residual slots of the blocks it wrote (2-/4-bit caches; nothing otherwise):

        * a block full of accepted tokens was quantized ("sealed") by the step from exactly the rows
          decoding would have written: its slot is unmapped now (readers take the packed block) and
          comes back after the next forward (:meth:`ResidualSlots.detach`); counted in
          :attr:`num_verify_sealed` when the step filled it;
        * the block of token ``num_kv_tokens``, if partial, keeps its slot: it holds the accepted
          rows in the model dtype (the rows of rejected drafts after them are rewritten later, and
          the codes the step may have written into the packed block, from rows of rejected drafts,
          are never read: readers take a block with a slot from its slot, and the step that fills it
          with accepted tokens quantizes it again); counted in :attr:`num_verify_unsealed` when the
          step had filled it;
        * blocks after it hold no accepted token: their slots are released after the next forward
          (a step that writes them again takes them back first, :meth:`ResidualSlots.ensure`).

        Raises:
            RuntimeError: a block that keeps accepted rows has no residual slot (the books and the
                step disagree).
        """
        r = self.residual
        if r is None or end <= first:
            return
        table = self.block_tables.get(request.request_id, [])
        bs = self.block_size
        n = request.num_kv_tokens
        for i in range(first // bs, min((end - 1) // bs + 1, len(table))):
            b = table[i]
            if b == FREED_BLOCK:
                continue
            filled = end >= (i + 1) * bs
            if (i + 1) * bs <= n:
                self.num_verify_sealed += filled
                r.detach([b])
            elif i == n // bs and n % bs:
                if not r.has(b):
                    raise RuntimeError(f"request {request.request_id}: block {b} keeps accepted rows without a "
                                       f"residual slot (kv_cache_dtype int4/int2)")
                r.ensure(b)
                self.num_verify_unsealed += filled
            else:
                r.release_later(b)

    def end_step(self) -> None:
        """After a forward: give back the residual slots of the blocks it filled and of the blocks
        freed before it (2-/4-bit caches; nothing otherwise)."""
        if self.residual is not None:
            self.residual.end_step()

    def allocate_slots(self, request: Request, num_new_tokens: int, headroom: int = 0) -> bool:
        """Grow the block table of an admitted request to hold ``num_computed_tokens +
        num_new_tokens`` tokens, evicting unused cached blocks if the free ones are short.

        A request carrying drafts (``spec_token_ids``) is about to be verified: with a 2-/4-bit cache
        every block the step writes then gets a residual slot (:meth:`_residual_step`; the engine
        settles them with :meth:`end_verification` once the accepted count is known).

        Args:
            headroom: blocks that must stay available (free or evictable) afterwards.

        Returns:
            False (and allocates and evicts nothing) when even eviction cannot make room, or
            (2-/4-bit caches) when the residual slots the step needs are not free.
        """
        table = self.block_tables.get(request.request_id, [])
        if self.sliding_window is not None and table:  # first give back what the window left behind
            self._free_outside_window(table, request.num_computed_tokens)
        before = request.num_kv_tokens
        after = before + num_new_tokens
        verify = bool(request.spec_token_ids)  # (its last token and drafts: see _residual_step)
        need = self.blocks_needed(after) - len(table)
        if not self._residual_room(table, before, after, verify):
            return False
        if need <= 0:
            self._residual_step(table, before, after, verify)
            return True
        if not self._make_room(need, headroom):
            return False
        table.extend(self.pool.allocate(need))
        self.block_tables[request.request_id] = table  # a new table holds no cached block
        self._residual_step(table, before, after, verify)
        return True

    def admit_swapped(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                      headroom: int = 0) -> Optional[list[int]]:
        """Give a request that holds no blocks (a swapped-out request coming back,
        :mod:`kvserve.core.kv_swap`) a fresh block table for ``num_computed_tokens + num_new_tokens``
        tokens and set its ``num_computed_tokens``; the caller copies its K/V into the first
        blocks. With a 2-/4-bit cache the partial block of token ``num_computed_tokens`` (if any)
        gets a residual slot (the caller copies its rows there) and the step's as allocate_slots
        gives them; None when the slots are short. No cache lookup: with prefix caching it locks its namespace's root, and its
        blocks enter the cache after the step as any request's do (where the tree already holds
        them, it switches to the tree's blocks).

        Returns:
            The new block table, or None (nothing taken or evicted) when the blocks do not fit
            with ``headroom`` blocks left available.
        """
        rid = request.request_id
        if rid in self.block_tables:
            raise RuntimeError(f"request {rid} already holds blocks")
        before = num_computed_tokens - request.num_dropped_tokens
        need = self.blocks_needed(before + num_new_tokens)
        if not self._residual_room([], before, before + num_new_tokens) or not self._make_room(need, headroom):
            return None
        table = self.pool.allocate(need)
        self.block_tables[rid] = table
        if self.residual is not None:  # 2-/4-bit: the full blocks copied in are read from the packed
            # data (not from a slot a freed block left); the partial one's rows come into a slot of its own
            self.residual.detach(table[: before // self.block_size])
            self._residual_step(table, before, before + num_new_tokens)
        if self.cache is not None:
            node = self.cache.match_prefix(self.namespace(request), [], max_tokens=0, update_stats=False).node
            self.cache.lock(node)
            self._nodes[rid] = node
        request.num_computed_tokens = num_computed_tokens
        return table

    def _hit_cap(self, request: Request) -> int:
        """Most tokens the request may take from the cache."""
        cap = request.num_tokens - 1  # the last token is always computed
        if request.kv_compression is not None and request.kv_compression.uses_scores:
            return 0  # SnapKV / H2O score the queries of the tokens they compute: compute them all
        if request.sampling_params.prompt_logprobs is not None:
            scored = len(request.prompt_logprobs) - 1  # prompt positions already scored
            if scored < request.num_prompt_tokens - 1:
                cap = min(cap, max(scored, 0))
        return cap

    def admit(self, request: Request, token_budget: int, headroom: int = 0) -> int:
        """Give a waiting request its cached prefix and blocks for its first chunk.

        A request that already holds blocks (a forked sample) only grows its table.
        Otherwise its tokens (prompt + output so far) are matched against the cache, and
        ``num_computed_tokens`` is set to the tokens served from it. A request whose prompt
        K/V another engine saved (``request.kv_transfer``, prefill/decode disaggregation)
        takes the cached full blocks, and the blocks after them are loaded from the transfer
        (a ``load`` op, applied at once by the pools' mover or ``kv_loader``: only the blocks
        the cache does not hold move); it then has ``num_computed_tokens = len(prompt) - 1`` and
        computes the last prompt token. If the load fails
        (:class:`~kvserve.distributed.kv_transfer.KVTransferError`), the request keeps its
        cached blocks and computes the rest of its prompt (``num_computed_tokens`` = the cache
        hit; the blocks the chunk does not need go back to the pool), the failure is counted
        (``kv_transfer_failed``) and logged. Either way ``request.kv_transfer_stats`` records
        the transfer (:meth:`_load_transfer`).

        Args:
            token_budget: most tokens the request may compute this step (≥ 1).
            headroom: blocks that must stay available afterwards (the admission watermark).

        Returns:
            Tokens scheduled (``min(num_tokens - num_computed_tokens, token_budget)``), or 0
            when the blocks do not fit; then nothing changed (no lock, reference or
            allocation is kept, nothing is evicted).
        """
        rid = request.request_id
        if rid in self.block_tables:
            n = min(request.num_tokens - request.num_computed_tokens, token_budget)
            return n if self.allocate_slots(request, n, headroom) else 0
        cache = self.cache
        blocks: list[int] = []
        node: Optional[RadixNode] = None
        partial: Optional[PartialMatch] = None
        transfer = request.kv_transfer
        disk_keys: list[bytes] = []
        cap = 0
        if cache is not None:
            cap = self._hit_cap(request)
            ns = self.namespace(request)
            m = cache.match_prefix(ns, request.all_token_ids, max_tokens=cap, update_stats=False)
            node, blocks = m.node, m.blocks
            cache.lock(node)
            self.pool.incref(blocks)
            if self.offload is not None and transfer is None:  # the match goes on into the disk tier
                disk_keys = self.offload.lookup(ns, request.all_token_ids, blocks,
                                                cap // self.block_size - len(blocks))
            if m.partial is not None and self.partial_block_reuse and transfer is None and not disk_keys:
                partial = m.partial
                cache.lock(partial.node)  # the copy source must outlive the eviction below
        hit = computed = len(blocks) * self.block_size + (partial.num_tokens if partial else 0)
        if transfer is not None and transfer.num_tokens > computed:
            computed = transfer.num_tokens  # the blocks after the cached ones come from the transfer
        computed += len(disk_keys) * self.block_size
        num_new = min(request.num_tokens - computed, token_budget)
        need = self.blocks_needed(computed + num_new) - len(blocks)
        room = num_new > 0 and self._make_room(need, headroom)
        if not room and disk_keys and num_new > 0:
            # all the disk blocks at once may not fit where a chunk at a time would: compute instead
            disk_keys = []
            computed = hit
            num_new = min(request.num_tokens - computed, token_budget)
            need = self.blocks_needed(computed + num_new) - len(blocks)
            room = num_new > 0 and self._make_room(need, headroom)
        if self.offload is not None:
            self.offload.unpin()
        if not room and partial is not None and num_new > 0:
            # the locked copy source may be the very block that eviction needs (a pool of a
            # few blocks): recompute that part instead of waiting for room that never comes
            cache.unlock(partial.node)
            partial = None
            computed = len(blocks) * self.block_size
            num_new = min(request.num_tokens - computed, token_budget)
            need = self.blocks_needed(computed + num_new) - len(blocks)
            room = num_new > 0 and self._make_room(need, headroom)
        if room and not self._residual_room([], computed, computed + num_new):
            room = False  # (no residual slot free: a 2-/4-bit cache's partial blocks; see end_step)
        if not room:
            if cache is not None:
                if partial is not None:
                    cache.unlock(partial.node)
                cache.unlock(node)
                self.pool.decref(blocks)
            return 0
        new = self.pool.allocate(need)
        self._residual_step(blocks + new, computed, computed + num_new)
        if partial is not None:
            self._copy_block_prefix(partial.block_id, new[0], partial.num_tokens)
            cache.unlock(partial.node)
        if disk_keys and not self._load_offloaded(request, disk_keys, new[: len(disk_keys)]):
            disk_keys = []  # recompute after the in-memory hit
            computed = hit
            num_new = min(request.num_tokens - computed, token_budget)
            keep = self.blocks_needed(computed + num_new) - len(blocks)
            self.pool.decref(new[keep:])
            new = new[:keep]
        if transfer is not None:
            if not self._load_transfer(request, transfer, hit, new):  # recompute after the cached blocks
                computed = hit
                num_new = min(request.num_tokens - computed, token_budget)
                keep = self.blocks_needed(computed + num_new) - len(blocks)
                self.pool.decref(new[keep:])  # (fresh blocks the load may have half written: free again)
                new = new[:keep]
        request.kv_transfer = None  # (taken: a request preempted later recomputes or swaps as any)
        self.block_tables[rid] = blocks + new
        if node is not None:
            self._nodes[rid] = node
        request.num_computed_tokens = computed
        if disk_keys:  # the loaded blocks join the tree now (a request admitted next matches them in memory)
            hit += len(disk_keys) * self.block_size
            self.cache_computed(request)
        if cache is not None:
            resumed = request.num_preemptions > 0
            if not resumed:
                request.num_cached_tokens = hit
            if resumed or cap > 0 or request.sampling_params.prompt_logprobs is None:
                self.metrics.record(request.num_tokens, hit, resumed)
        return num_new

    def _apply_load(self) -> Optional[str]:
        """Apply the ops recorded so far, a load last, now (the pools' mover, or ``kv_loader``);
        returns the load's error message, or None when it succeeded (or waits in :attr:`ops`,
        without mover and loader)."""
        apply = self._mover.apply if self._mover is not None else self._loader
        if apply is None:
            return None
        from kvserve.distributed.kv_transfer import KVTransferError

        try:
            apply(self.ops.take())
        except KVTransferError as e:
            return str(e)
        return None

    def _load_offloaded(self, request: Request, keys: list[bytes], new: list[int]) -> bool:
        """Load the disk tier's blocks ``keys`` into ``new`` (fresh blocks, pairwise) now;
        returns False when the load failed (a file missing or refused: the keys leave the tier's
        index, the request recomputes those tokens)."""
        assert self.offload is not None
        self.ops.load(self.offload.handle(keys), list(range(len(keys))), new)
        if self.residual is not None:  # (full quantized blocks: read from the pools' data, not a stale slot)
            self.residual.detach(new)
        err = self._apply_load()
        if err is not None:
            self.offload.failed(keys)
            if self._mover is not None:
                self._mover.apply(self.ops.take())
            logger.warning("request %s: reading %d KV block(s) from the disk tier failed (%s); it recomputes them",
                           request.request_id, len(keys), err)
            return False
        self.offload.loaded(len(keys))
        return True

    def offload_cached(self) -> int:
        """Record the writing of the tree's blocks that are not on disk yet (most recently used
        first, within the budget; at shutdown, so that a restarted engine finds them). Returns the
        blocks recorded (0 without a disk tier)."""
        if self.offload is None or self.cache is None:
            return 0
        nodes = sorted(self.cache.iter_nodes(), key=lambda n: n.last_access)
        return self.offload.offload_cached([b for n in nodes for b in n.blocks])

    def _load_transfer(self, request: Request, transfer, hit: int, new: list[int]) -> bool:
        """Load the blocks of ``transfer`` (a
        :class:`~kvserve.distributed.kv_transfer.KVTransferHandle`) after the ``hit`` cached
        tokens into the request's first new blocks ``new``, now (the pools' mover, or
        ``kv_loader``; without either the load waits in :attr:`ops`); returns False when the
        load failed. Sets ``request.kv_transfer_stats``: ``{"blocks", "bytes", "seconds",
        "cached_blocks", "failed"}`` (blocks and bytes loaded, all workers; seconds spent;
        blocks the prefix cache held; whether the load failed)."""
        first, end = hit // self.block_size, self.blocks_needed(transfer.num_tokens)
        stats = {"blocks": 0, "bytes": 0, "seconds": 0.0, "cached_blocks": first, "failed": False}
        request.kv_transfer_stats = stats
        if end <= first:
            return True  # the cache held every transferred block
        self.ops.load(transfer, list(range(first, end)), new[: end - first])
        if self.residual is not None:  # (full quantized blocks: read from the pools' data, not a stale slot)
            self.residual.detach(new[: end - first])
        t0 = time.perf_counter()
        err = self._apply_load()
        ok = err is None
        if not ok:
            self.num_transfer_failed += 1
            logger.warning("request %s: loading %d transferred KV block(s) failed (%s); it recomputes its prompt "
                           "after its %d cached token(s)", request.request_id, end - first, err, hit)
        if self._mover is not None or self._loader is not None:
            stats["seconds"] = time.perf_counter() - t0
            self.num_transfer_load_seconds += stats["seconds"]
        if ok:
            stats["blocks"], stats["bytes"] = end - first, (end - first) * transfer.block_bytes
            self.num_transfer_loaded_blocks += end - first
            self.num_transfer_loaded_bytes += stats["bytes"]
        stats["failed"] = not ok
        return ok

    def _copy_block_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Record the copy of the K/V of slots ``0..num_tokens-1`` of block ``src`` into block
        ``dst`` (in :attr:`ops`; applied here at once with local pools)."""
        self.ops.copy(src, dst, num_tokens)
        if self._mover is not None:
            self._mover.apply(self.ops.take())

    # ------------------------------------------------------------------ caching
    def cache_computed(self, request: Request) -> None:
        """Insert the request's computed full blocks into the cache (call after each step,
        once ``num_computed_tokens`` counts only tokens whose K/V are final)."""
        node = self._nodes.get(request.request_id)
        if node is None or request.num_dropped_tokens:  # (never a compacted request's blocks)
            return
        assert self.cache is not None
        bs = self.block_size
        full = request.num_computed_tokens // bs
        if full * bs <= node.depth:
            return
        table = self.block_tables[request.request_id]
        tokens = _tokens(request, full * bs)
        new = self.cache.insert(self.namespace(request), tokens, table[:full], start=node)
        # Where the tree already held these tokens in other blocks (a forked sample's copied
        # block, or two requests computing the same prompt at once), the request switches to
        # the tree's blocks and frees its duplicates: its lock must pin exactly the blocks it
        # reads, or a locked block that no request reads could never be evicted (a pool of a
        # few blocks then stalls) and the duplicates would hold memory for nothing.
        cached: list[int] = []
        n: Optional[RadixNode] = new
        while n is not None and n is not node:
            cached[:0] = n.blocks
            n = n.parent
        if n is None:  # (cannot happen: insert walks down from node)
            cached = []
        first = full - len(cached)
        for i, b in enumerate(cached):
            if table[first + i] != b:
                self.pool.incref([b])
                self.pool.decref([table[first + i]])
                table[first + i] = b
        if self.offload is not None and cached:  # the keys of the blocks that entered the tree
            ns = self.namespace(request)
            prev = self.offload.prev_key(ns, table[:first])
            if prev is None:  # (unknown: chain from the start)
                prev = self.offload.chain(self.offload.seed(ns), tokens, 0, first)[-1]
            self.offload.note_cached(cached, self.offload.chain(prev, tokens, first, len(cached)))
        self.cache.move_lock(node, new)
        self._nodes[request.request_id] = new

    def free(self, request: Request, cache: bool = True, keep_scores: bool = False) -> None:
        """Release the request's blocks. With ``cache`` its computed full blocks are first
        inserted into the prefix cache, where they stay (evictable) for later requests (not
        once a compaction dropped some of its tokens: its blocks then hold a selection). Unless
        ``keep_scores`` (a request swapped out), the workers drop its compression scores."""
        rid = request.request_id
        if cache:
            self.cache_computed(request)
        if request.kv_compression is not None and request.kv_compression.uses_scores and not keep_scores:
            self.ops.forget(rid)  # (the workers' attention scores of it)
        node = self._nodes.pop(rid, None)
        if node is not None:
            assert self.cache is not None
            self.cache.unlock(node)
        table = self.block_tables.pop(rid, None)
        if table:
            self.pool.decref(held_blocks(table))

    def fork(self, src: Request, dst: Request) -> bool:
        """Give ``dst`` (same prompt, no blocks yet) the K/V of ``src``'s prompt except its
        last token, so that ``dst`` computes one token before sampling.

        The full blocks are shared: with prefix caching through the tree (``src``'s computed
        blocks are inserted first and ``dst`` locks the matched node), without it by reference
        count. The block holding the last prompt position is copied up to that position.

        Returns:
            False when ``src`` has not computed its prompt, ``dst`` already has blocks, or no
            block is free for the copy; then ``dst`` is left untouched and is admitted like any
            other request.
        """
        n = src.num_prompt_tokens - 1
        src_table = self.block_tables.get(src.request_id)
        if (src_table is None or src.num_computed_tokens < n or dst.request_id in self.block_tables
                or dst.prompt_token_ids != src.prompt_token_ids):
            return False
        if src.num_dropped_tokens or (dst.kv_compression is not None and dst.kv_compression.uses_scores):
            return False  # (a compacted prompt; or SnapKV / H2O, which score every query they compute)
        num_full, rem = divmod(n, self.block_size)
        if self.sliding_window is not None:  # dst's first token (position n) needs its window's blocks
            first = max(0, n - self.sliding_window + 1) // self.block_size
            if FREED_BLOCK in src_table[first : num_full + (1 if rem else 0)]:
                return False
        node: Optional[RadixNode] = None
        if self.cache is not None:
            self.cache_computed(src)
            m = self.cache.match_prefix(self.namespace(dst), dst.prompt_token_ids,
                                        max_tokens=num_full * self.block_size, update_stats=False)
            if m.num_blocks != num_full:  # cannot happen while src holds its path; be safe
                return False
            node, shared = m.node, m.blocks
            self.cache.lock(node)
        else:
            shared = src_table[:num_full]
        self.pool.incref(held_blocks(shared))
        table = list(shared)
        if rem:
            if not self._make_room(1) or (self.residual is not None and not self.residual.can_take()):
                self.pool.decref(held_blocks(shared))
                if node is not None:
                    self.cache.unlock(node)  # type: ignore[union-attr]
                return False
            new = self.pool.allocate(1)
            if self.residual is not None:  # (the copy's rows land in the new block's residual slot)
                self.residual.ensure(new[0])
            self._copy_block_prefix(src_table[num_full], new[0], rem)
            table.extend(new)
        self.block_tables[dst.request_id] = table
        if node is not None:
            self._nodes[dst.request_id] = node
        dst.num_computed_tokens = n
        dst.num_cached_tokens = n
        return True

    # ------------------------------------------------------------------ compression
    def compress(self, request: Request, keep: Optional[list[int]], num_kept: int) -> bool:
        """Compact the request's KV to ``num_kept`` tokens (:mod:`kvserve.core.kv_compression`):
        the kept tokens move to KV indices ``0 .. num_kept - 1`` of a table of
        ``ceil(num_kept / block_size)`` blocks, and ``num_dropped_tokens`` grows by the tokens
        dropped. Blocks the request alone holds (not shared with a fork, not in the prefix
        cache) are rewritten in place; shared ones are replaced by fresh blocks (copy-on-write);
        the rest go back to the pool. The move is recorded in :attr:`ops`
        (:class:`~kvserve.core.kv_ops.Compaction`; applied at once with local pools). First the
        request's computed full blocks enter the prefix cache (their K/V is exact), and it leaves
        the tree: the cache never holds a compacted block. With a 2-/4-bit cache the op carries
        the residual slots (:attr:`Compaction.src_residual`, :attr:`Compaction.dst_residual`): the
        new table's partial last block (``num_kept % block_size``) keeps or gets one, its full
        blocks hold none (the slot of a fresh block freed earlier is detached), and the old
        partial block's slot comes back after the next forward, as for any freed block.

        Args:
            request: a running request with ``num_kv_tokens > num_kept``.
            keep: ``num_kept`` ascending KV indices kept in every layer and head (StreamingLLM), or
                None (the workers select them per layer and head from their scores).
            num_kept: tokens kept.

        Returns:
            False (nothing changed) when the fresh blocks a shared table needs do not fit, or no
            residual slot is free for the new partial last block (2-/4-bit).
        """
        rid = request.request_id
        old = self.block_tables.get(rid)
        n = request.num_kv_tokens
        if old is None or n <= num_kept:
            return False
        if request.num_dropped_tokens == 0:
            self.cache_computed(request)
            old = self.block_tables[rid]  # (it may have switched to the tree's blocks)
        nb = self.blocks_needed(num_kept)
        cache = self.cache
        owned = [i < len(old) and old[i] != FREED_BLOCK and self.pool.ref_counts[old[i]] == 1
                 and not (cache is not None and cache.is_cached(old[i])) for i in range(nb)]
        r = self.residual
        partial = num_kept % self.block_size != 0
        if r is not None and partial and not (owned[-1] and r.has(old[nb - 1])) and not r.can_take(1):
            return False  # (2-/4-bit: no residual slot for the kept tokens' partial last block)
        if not self._make_room(owned.count(False)):
            return False
        node = self._nodes.pop(rid, None)
        if node is not None:
            assert cache is not None
            cache.unlock(node)
        fresh = iter(self.pool.allocate(owned.count(False)))
        new = [old[i] if owned[i] else next(fresh) for i in range(nb)]
        cfg = request.kv_compression
        comp = Compaction(rid, list(old), n, list(new), num_kept, cfg.method, keep, cfg.to_dict())
        if r is not None:  # 2-/4-bit: the residual slots the workers read and write (kv_compressor)
            comp.src_residual = [int(r.map[b]) if b != FREED_BLOCK else -1 for b in old]
            r.detach(new[: nb - 1] if partial else new)  # (full blocks are read from the packed data)
            if partial:
                r.ensure(new[-1])
                comp.dst_residual = int(r.map[new[-1]])
        self.ops.compact(comp)
        kept_in_place = {old[i] for i in range(nb) if owned[i]}
        self.pool.decref([b for b in held_blocks(old) if b not in kept_in_place])
        self.block_tables[rid] = new
        request.num_dropped_tokens += n - num_kept
        if self._mover is not None:
            self._mover.apply(self.ops.take())
        return True

    # ------------------------------------------------------------------ metrics
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (0..1); evictable cached blocks count as
        available."""
        return self.num_used_blocks / self.pool.num_blocks

    def stats(self) -> dict:
        """KV block and prefix-cache counters (token counts in tokens)."""
        m = self.metrics
        return {
            "prefix_caching": self.enable_prefix_caching,
            "prefix_cache_requests": m.requests,
            "prefix_cache_queries": m.query_tokens,
            "prefix_cache_hits": m.hit_tokens,
            "prefix_cache_hit_rate": m.hit_rate,
            "prefix_cache_hit_rate_recent": m.recent_hit_rate,
            "prefix_cache_hit_rate_window": m.window,
            "prefix_cache_resumed_queries": m.resumed_query_tokens,
            "prefix_cache_resumed_hits": m.resumed_hit_tokens,
            "prefix_cache_evicted_blocks": m.evicted_blocks,
            "kv_blocks_free": self.num_empty_blocks,  # unreferenced, holding no cached KV
            "kv_blocks_cached": self.num_cached_blocks,  # cached, unused, evictable
            "kv_blocks_in_use": self.num_used_blocks,
            "kv_transfer_loaded_blocks": self.num_transfer_loaded_blocks,
            "kv_transfer_loaded_bytes": self.num_transfer_loaded_bytes,
            "kv_transfer_load_seconds": self.num_transfer_load_seconds,
            "kv_transfer_failed": self.num_transfer_failed,
            # 2-/4-bit caches with speculative decoding (end_verification): blocks verification steps
            # filled with accepted tokens only (sealed), and blocks they filled that kept their
            # residual slot (rejected drafts' rows in them)
            "kv_verify_sealed_blocks": self.num_verify_sealed,
            "kv_verify_unsealed_blocks": self.num_verify_unsealed,
            **(self.offload.stats() if self.offload is not None else {}),
        }

    # ------------------------------------------------------------------ beam search
    def detach(self, request: Request) -> tuple[list[int], Optional[RadixNode]]:
        """Take the request's KV (block table and locked cache node) away from it without
        releasing anything; hand it to :meth:`attach`, :meth:`clone` or :meth:`release`."""
        return self.block_tables.pop(request.request_id, []), self._nodes.pop(request.request_id, None)

    def attach(self, request: Request, handle: tuple[list[int], Optional[RadixNode]]) -> None:
        """Give a detached (or cloned) KV handle to ``request`` (which must hold none)."""
        table, node = handle
        if table:
            self.block_tables[request.request_id] = table
        if node is not None:
            self._nodes[request.request_id] = node

    def clone(self, handle: tuple[list[int], Optional[RadixNode]], num_tokens: int
              ) -> Optional[tuple[list[int], Optional[RadixNode]]]:
        """A second handle on the first ``num_tokens`` tokens of ``handle`` (copy-on-write):
        full blocks are shared (one more reference each, and one more lock on the cache node,
        whose path holds every cached block among them); the block holding position
        ``num_tokens`` is copied up to it, so the clone can append its own next token.

        Returns:
            None when no block is free for the copy (nothing is taken).
        """
        table, node = handle
        num_full, rem = divmod(num_tokens, self.block_size)
        shared = table[:num_full]  # (freed entries stay freed in the clone)
        new: list[int] = []
        if rem:
            if table[num_full] == FREED_BLOCK or not self._make_room(1) or (
                    self.residual is not None and not self.residual.can_take()):
                return None
            new = self.pool.allocate(1)
            if self.residual is not None:
                self.residual.ensure(new[0])
            self._copy_block_prefix(table[num_full], new[0], rem)
        self.pool.incref(held_blocks(shared))
        if node is not None:
            assert self.cache is not None
            if node.depth > num_full * self.block_size:  # keep only the path the clone shares
                node = self.cache.ancestor_at(node, num_full * self.block_size)
            self.cache.lock(node)
        return list(shared) + new, node

    def release(self, handle: tuple[list[int], Optional[RadixNode]]) -> None:
        """Drop a detached handle: unlock its node and its block references."""
        table, node = handle
        if node is not None:
            assert self.cache is not None
            self.cache.unlock(node)
        if table:
            self.pool.decref(held_blocks(table))

    def check_invariants(self) -> None:
        """Recount references and locks from the block tables; O(everything), for tests.

        Raises:
            RuntimeError: naming the first broken invariant.
        """
        pool, cache = self.pool, self.cache
        expected = [0] * pool.num_blocks
        for rid, table in self.block_tables.items():
            held = held_blocks(table)
            if len(held) != len(table) and (self.sliding_window is None or FREED_BLOCK in table[len(table) - len(held):]):
                raise RuntimeError(f"request {rid}: freed table entries without a window, or not a prefix")
            for b in held:
                expected[b] += 1
        locks: dict[int, int] = {}
        if cache is not None:
            cache.check_invariants()
            for node in cache.iter_nodes():
                for b in node.blocks:
                    expected[b] += 1
            for rid, node in self._nodes.items():
                if node.parent is None and node is not cache.root:
                    raise RuntimeError(f"request {rid} holds a lock on an evicted node")
                path: set[int] = set()
                cur: Optional[RadixNode] = node
                while cur is not None:
                    path.update(cur.blocks)
                    locks[id(cur)] = locks.get(id(cur), 0) + 1
                    cur = cur.parent
                stray = [b for b in self.block_tables.get(rid, []) if cache.is_cached(b) and b not in path]
                if stray:
                    raise RuntimeError(f"request {rid} uses cached blocks {stray} off its locked path")
            for node in cache.iter_nodes():
                if node.lock_ref != locks.get(id(node), 0):
                    raise RuntimeError("a node's lock count differs from the requests locking it")
        if pool.ref_counts != expected:
            raise RuntimeError("pool reference counts differ from block tables + cache")
        if self.num_empty_blocks + self.num_cached_blocks + self.num_used_blocks != pool.num_blocks:
            raise RuntimeError("empty + cached + in use != num_blocks")
        if pool.num_free != sum(1 for c in pool.ref_counts if c == 0):
            raise RuntimeError("free queue length differs from unreferenced blocks")
        r = self.residual
        if r is not None:
            held = sorted(r._slot.values())
            if len(set(held)) != len(held) or len(held) + r.num_free + len(r._detached) != r.num_slots:
                raise RuntimeError("residual slots: held + free != num_slots, or a slot held twice")
            if any(pool.ref_counts[b] == 0 and b not in r._pending for b in r._slot):
                raise RuntimeError("residual slots: a free block holds a slot not marked for release")
            if sorted(int(x) for x in r.map[r.map >= 0]) != held:
                raise RuntimeError("residual slots: the map differs from the slots held")
