"""The CPU swap tier for preempted requests' KV (vLLM's ``swap_space`` / ``preemption_mode="swap"``).

When the block pool runs out, the scheduler preempts a running request. With
``preemption_mode="recompute"`` it frees the request's blocks and later recomputes prompt + output
so far (a prefill). With ``preemption_mode="swap"`` it first copies the request's computed blocks
(every layer, K and V) into a host-memory pool, then frees the device blocks; when the request is
resumed, it gets new device blocks, the host copy is written back and it goes on decoding where
it was (no prefill).

This module keeps the books (:class:`KVSwapSpace`: which host blocks each swapped request holds,
its ``num_computed_tokens``, the capacity and the counters); the host pool itself is the
workers' (:class:`kvserve.worker.kv_block_mover.KVBlockMover`: each tensor-parallel rank holds
its shard), and the swaps are recorded as ops (:mod:`kvserve.core.kv_ops`) that the workers apply
in order before the next forward: a swap-out is read before anything written later (the same
step's new K/V in the freed blocks) overwrites its blocks. The host pool has the device pool's
row format (a block moves as raw bytes); on CUDA it is pinned CPU memory, on CPU one more tensor
in RAM (the device pool is RAM too: swapping then trades recomputation for two memory copies and
lets a small pool serve more requests at once). A request's swap is one ``index_select`` and one
``index_copy_`` per layer and K/V.

2-/4-bit caches (``kv_cache_dtype`` int4/int2, :mod:`kvserve.worker.kv_quant_lowbit`): a request's
full blocks move as their packed codes and scales; its last block, when partial, has its rows in
a model-dtype residual slot, which moves too, into a *host residual slot* (a small area of the
host pool, :func:`plan_host_pool`; its own allocator here) and back into a device residual slot
the KV manager gives the swapped-in block. A victim with a partial block when every host residual
slot is taken is recomputed (counted in ``swap_num_recompute_fallbacks``).

Host blocks are owned by one swapped request each (no sharing, no prefix cache): a request whose
prompt blocks were shared swaps out its own copy of them, and gets its own device copy back.
Invariant after every operation: ``num_free + num_used == num_blocks``, and the blocks the swapped
requests hold are exactly the used ones (:meth:`KVSwapSpace.check_invariants`).

Data flows one way: the scheduler decides (swap out a victim, swap in a resumed request, fall back
on recompute) and calls into this module, which allocates host blocks and records the moves; it
never calls back into the scheduler or the KV cache manager.
"""

from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvserve.core.kv_ops import KVCacheOps

GiB = 1 << 30
#: ``preemption_mode`` values (vLLM's names).
PREEMPTION_MODES = ("recompute", "swap")
#: The largest ``swap_space`` accepted (GiB), as ``kv_cache_memory``'s limit: no machine has more.
MAX_SWAP_SPACE_GIB = 1 << 20


def check_swap_options(swap_space, preemption_mode, name=lambda field: field) -> str:
    """Validate ``swap_space`` (GiB) and ``preemption_mode``; return the effective mode.

    ``preemption_mode=None`` means ``"swap"`` when ``swap_space > 0``, else ``"recompute"``.

    Args:
        name: maps a field name to the name the error uses (``--swap-space`` for the CLI).

    Raises:
        ValueError: naming the option and the allowed range: ``swap_space`` not a finite number in
            ``[0, 1048576]`` GiB, ``preemption_mode`` not one of :data:`PREEMPTION_MODES` (or None),
            or ``preemption_mode="swap"`` with ``swap_space == 0``.
    """
    if not isinstance(swap_space, numbers.Real) or isinstance(swap_space, bool):
        raise ValueError(f"{name('swap_space')} must be a number of GiB, got {swap_space!r}")
    if not 0 <= swap_space <= MAX_SWAP_SPACE_GIB:  # (NaN fails both comparisons)
        raise ValueError(f"{name('swap_space')} must be in [0, {MAX_SWAP_SPACE_GIB}] GiB (0: no swap space), "
                         f"got {swap_space}")
    if preemption_mode is not None and preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"{name('preemption_mode')} must be one of {list(PREEMPTION_MODES)} (or None: swap when "
                         f"swap_space > 0), got {preemption_mode!r}")
    mode = preemption_mode or ("swap" if swap_space > 0 else "recompute")
    if mode == "swap" and swap_space == 0:
        raise ValueError(f"{name('preemption_mode')}='swap' needs {name('swap_space')} > 0 GiB of host memory for "
                         f"the swapped-out KV blocks, got {name('swap_space')}=0")
    return mode


def num_host_blocks(swap_space: float, bytes_per_token: int, block_size: int) -> int:
    """Host blocks in ``swap_space`` GiB: ``floor(swap_space · 2^30 / (bytes_per_token · block_size))``.

    Raises:
        ValueError: the budget holds no block.
    """
    n = int(swap_space * GiB) // (bytes_per_token * block_size)
    if n < 1:
        raise ValueError(f"swap_space={swap_space} GiB holds no KV block of {block_size} tokens at "
                         f"{bytes_per_token} bytes/token ({bytes_per_token * block_size} bytes); raise swap_space")
    return n


def plan_host_pool(swap_space: float, block_bytes: int, residual_bytes: int, max_residual: int) -> tuple[int, int]:
    """Split ``swap_space`` GiB into host blocks and (2-/4-bit caches) host residual slots:
    ``R = min(max_residual, floor(swap_space / 2 / residual_bytes))`` residual slots (at most
    half the budget), then ``floor((swap_space − R · residual_bytes) / block_bytes)`` blocks.

    Args:
        block_bytes: one host block, all layers, K and V (packed for 2-/4-bit pools), > 0.
        residual_bytes: one residual slot, all layers, K and V (model dtype); 0: none (other formats).
        max_residual: most residual slots worth having (one per swapped request: ``max_num_seqs``).

    Returns:
        ``(num_blocks, num_residual)``.

    Raises:
        ValueError: the budget holds no block (naming ``swap_space``).
    """
    budget = int(swap_space * GiB)
    r = min(max_residual, budget // 2 // residual_bytes) if residual_bytes > 0 else 0
    n = (budget - r * residual_bytes) // block_bytes
    if n < 1:
        raise ValueError(f"swap_space={swap_space} GiB holds no KV block of {block_bytes} bytes; raise swap_space")
    return n, r


class HostBlockAllocator:
    """The host pool's blocks: a free queue and the set of used blocks (each owned by one request).

    Args:
        num_blocks: host blocks (≥ 1).

    Raises:
        ValueError: ``num_blocks`` below 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> Optional[list[int]]:
        """Take ``n`` free blocks; None (taking nothing) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Return used blocks to the free queue.

        Raises:
            RuntimeError: a block that is not in use (a double free).
        """
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"free of host block {b}, which is not in use")
            self._used.remove(b)
            self._free.append(b)

    def check_invariants(self) -> None:
        """Raises RuntimeError unless free and used blocks partition ``range(num_blocks)``."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a host block is twice in the free queue")
        if free & self._used:
            raise RuntimeError("a host block is both free and used")
        if self.num_free + self.num_used != self.num_blocks or free | self._used != set(range(self.num_blocks)):
            raise RuntimeError("host blocks: free + used != num_blocks")


@dataclass(slots=True)
class SwappedKV:
    """What a swapped-out request keeps: its host block table and its ``num_computed_tokens``
    (tokens whose K/V are in those blocks, in order: token ``p`` is in slot ``p % block_size`` of
    ``host_blocks[p // block_size]``)."""

    host_blocks: list[int]
    num_computed_tokens: int
    #: 2-/4-bit caches: the host residual slot holding the last (partial) block's rows, or None
    host_residual: Optional[int] = None


class KVSwapSpace:
    """The host pool's books, and the swaps between it and the device pools, recorded.

    Args:
        kv_caches: None (the engine core: the host pool is the workers',
            :meth:`kvserve.worker.worker.Worker.initialize_swap_space`): the swaps are recorded in
            ``ops`` for the caller to hand to the workers. Or device pools in this process, per
            layer ``(K, V)``, each ``[num_blocks, block_size, num_kv_heads, row]`` (any dtype,
            8-bit rows with their scales included; or 2-/4-bit
            :class:`~kvserve.worker.kv_quant_lowbit.LowBitPool` s; unit tests): the swap space
            then allocates a host pool beside them and applies each swap at once.
        num_blocks: host blocks (see :func:`num_host_blocks`).
        ops: the record to append the swaps to (the engine core passes its KV manager's
            :attr:`~kvserve.core.kv_cache_manager.KVCacheManager.ops`, so that copies and swaps
            keep one order); a new one if None.
        block_bytes: bytes of one block, all layers, K and V (for :meth:`stats` readers and the
            log; taken from ``kv_caches`` when given).
        num_residual: host residual slots (2-/4-bit caches: :func:`plan_host_pool`); 0: none.

    Raises:
        ValueError: ``num_blocks`` below 1; with ``kv_caches``, the host pool (``num_blocks ·
            block bytes``) is larger than the memory available (``MemAvailable``), or cannot be
            allocated; the message names ``swap_space``.
    """

    def __init__(self, kv_caches: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]], num_blocks: int,
                 ops: Optional[KVCacheOps] = None, block_bytes: int = 0, num_residual: int = 0) -> None:
        self._mover = None
        if kv_caches is not None:  # (the host pool is allocated, and checked, before the allocator's queue)
            from kvserve.worker.kv_block_mover import KVBlockMover

            self._mover = KVBlockMover(kv_caches)
            self._mover.allocate_host(num_blocks, num_residual)
            block_bytes = self._mover.block_bytes
        self.num_residual = num_residual
        self._free_residual: deque[int] = deque(range(num_residual))
        self.block_bytes = block_bytes
        self.ops = ops if ops is not None else KVCacheOps()
        self.allocator = HostBlockAllocator(num_blocks)
        self.swapped: dict[str, SwappedKV] = {}
        # counters (blocks are KV blocks of all layers, K and V)
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_swap_fallbacks = 0  # preemptions that recomputed because the host pool was full
        self.num_swap_drops = 0  # swapped requests brought back by recompute instead
        self.num_swapped_residuals = 0  # partial blocks (residual slots) swapped out

    def _flush_local(self) -> None:
        """With pools in this process, apply what was just recorded."""
        if self._mover is not None:
            self._mover.apply(self.ops.take())

    # ------------------------------------------------------------------ state
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.swapped

    def num_blocks_of(self, request_id: str) -> int:
        """Host blocks a swapped request holds (0 if it holds none)."""
        s = self.swapped.get(request_id)
        return len(s.host_blocks) if s is not None else 0

    def usage(self) -> float:
        """Fraction of host blocks in use (0..1)."""
        return self.allocator.num_used / self.allocator.num_blocks

    # ------------------------------------------------------------------ moves
    def swap_out(self, request_id: str, device_blocks: Sequence[int], num_computed_tokens: int,
                 residual_slot: Optional[int] = None) -> bool:
        """Copy ``device_blocks`` (the request's block table up to its computed tokens) into new
        host blocks and remember them with ``num_computed_tokens``. The copy is recorded in
        ``ops``, to be applied before anything recorded later (or the next forward) can
        overwrite the device blocks, which the caller frees afterwards.

        Args:
            residual_slot: 2-/4-bit caches: the device residual slot of the last block (partial:
                its rows are there, not in the packed block), moved to a host residual slot; None
                when the last block is full (or another format).

        Returns:
            False, copying nothing, when the host pool has too few free blocks (or no free host
            residual slot for ``residual_slot``: the caller then recomputes the request) or there
            is nothing to copy.

        Raises:
            RuntimeError: the request is already swapped out.
        """
        if request_id in self.swapped:
            raise RuntimeError(f"request {request_id} is already swapped out")
        n = len(device_blocks)
        if n and residual_slot is not None and not self._free_residual:
            self.num_swap_fallbacks += 1
            return False
        host = self.allocator.allocate(n) if n else None
        if host is None:
            if n:
                self.num_swap_fallbacks += 1
            return False
        host_res = None
        if residual_slot is not None:
            host_res = self._free_residual.popleft()
            self.num_swapped_residuals += 1
        self.ops.swap_out(device_blocks, host, None if host_res is None else (residual_slot, host_res))
        self._flush_local()
        self.swapped[request_id] = SwappedKV(host, num_computed_tokens, host_res)
        self.num_swap_outs += 1
        self.num_swapped_out_blocks += n
        return True

    def swap_in(self, request_id: str, device_blocks: Sequence[int], residual_slot: Optional[int] = None) -> int:
        """Copy a swapped request's host blocks into ``device_blocks`` (at least as many, freshly
        allocated by the caller; the first ones get the copies), free its host blocks and return
        its ``num_computed_tokens``. The copy is recorded in ``ops`` (the host blocks are read
        before anything recorded later reuses them).

        Args:
            residual_slot: 2-/4-bit caches: the device residual slot the caller gave the last
                swapped-in block, needed when the request's host copy has a host residual slot
                (:attr:`SwappedKV.host_residual`, :meth:`needs_residual`); its rows go there.

        Raises:
            KeyError: the request is not swapped out.
            ValueError: fewer device blocks than host blocks, or no ``residual_slot`` for a
                partial last block.
        """
        s = self.swapped[request_id]
        n = len(s.host_blocks)
        if len(device_blocks) < n:
            raise ValueError(f"swap_in of {n} blocks into {len(device_blocks)} device blocks")
        if s.host_residual is not None and residual_slot is None:
            raise ValueError(f"swap_in of request {request_id}: its last block is partial (host residual slot "
                             f"{s.host_residual}) and needs a device residual_slot")
        self.ops.swap_in(s.host_blocks, list(device_blocks[:n]),
                         None if s.host_residual is None else (s.host_residual, residual_slot))
        self._flush_local()
        self.discard(request_id)
        self.num_swap_ins += 1
        self.num_swapped_in_blocks += n
        return s.num_computed_tokens

    def discard(self, request_id: str) -> bool:
        """Forget a swapped request's host copy (swapped in, aborted, finished, or brought back by
        recompute instead) and free its host blocks; returns whether it had one."""
        s = self.swapped.pop(request_id, None)
        if s is None:
            return False
        self.allocator.free(s.host_blocks)
        if s.host_residual is not None:
            self._free_residual.append(s.host_residual)
        return True

    def needs_residual(self, request_id: str) -> bool:
        """Whether a swapped request's last block is partial (a 2-/4-bit cache's residual slot
        moved with it): its swap-in needs a device residual slot."""
        s = self.swapped.get(request_id)
        return s is not None and s.host_residual is not None

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        """Swap counters: swap-outs and swap-ins (requests), blocks moved each way, preemptions that
        recomputed because the host pool was full, swapped requests brought back by recompute
        instead (``swap_num_dropped``), and the host pool's blocks and usage (0..1); 2-/4-bit
        caches: partial blocks swapped out with their residual rows, and the host residual slots
        (total, in use)."""
        a = self.allocator
        return {
            "swap_num_swap_outs": self.num_swap_outs,
            "swap_num_swap_ins": self.num_swap_ins,
            "swap_num_swapped_out_blocks": self.num_swapped_out_blocks,
            "swap_num_swapped_in_blocks": self.num_swapped_in_blocks,
            "swap_num_recompute_fallbacks": self.num_swap_fallbacks,
            "swap_num_dropped": self.num_swap_drops,
            "swap_blocks_total": a.num_blocks,
            "swap_blocks_used": a.num_used,
            "swap_num_swapped_residuals": self.num_swapped_residuals,
            "swap_residual_slots_total": self.num_residual,
            "swap_residual_slots_used": self.num_residual - len(self._free_residual),
            "swap_usage": self.usage(),
            "num_swapped": len(self.swapped),
        }

    def check_invariants(self) -> None:
        """The allocator's invariant, and the swapped requests' host blocks are exactly the used
        ones, each held once. O(blocks), for tests.

        Raises:
            RuntimeError: naming the broken invariant.
        """
        self.allocator.check_invariants()
        held = [b for s in self.swapped.values() for b in s.host_blocks]
        if len(held) != len(set(held)):
            raise RuntimeError("a host block is held by two swapped requests")
        if set(held) != self.allocator._used:
            raise RuntimeError("host blocks in use differ from the swapped requests' host block tables")
        res = [s.host_residual for s in self.swapped.values() if s.host_residual is not None]
        free = list(self._free_residual)
        if len(set(res)) != len(res) or set(res) & set(free) or len(res) + len(free) != self.num_residual \
                or set(res) | set(free) != set(range(self.num_residual)):
            raise RuntimeError("host residual slots: held + free != num_residual, or a slot held twice")
