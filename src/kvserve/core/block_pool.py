"""BlockPool: the fixed set of KV cache blocks, with reference counts and a free queue.

A block holds the K and V of ``block_size`` consecutive tokens of one sequence in every
layer. Blocks are shared: a running request holds one reference on each block in its
block table, and the prefix cache holds one reference on each block it keeps. A block
whose count drops to zero returns to the free queue at once.

Invariant after every operation: ``num_free + sum(1 for b if ref_count[b] > 0) == num_blocks``.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Optional


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer than the asked blocks are free."""


class BlockPool:
    """Reference-counted pool of ``num_blocks`` KV blocks with an O(1) free queue.

    Args:
        num_blocks: total blocks in the KV cache (≥ 1).
        block_size: tokens per block (≥ 1).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is below 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        #: called with each block whose last reference is dropped (the 2-/4-bit cache's residual
        #: slots: :class:`kvserve.core.kv_cache_manager.ResidualSlots`); None: nothing
        self.on_free: Optional[Callable[[int], None]] = None

    @property
    def num_free(self) -> int:
        """Blocks that no request and no cache references."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            NoFreeBlocksError: if fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each of ``blocks`` (which must be in use)."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"incref on free block {b}")
            self.ref_counts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each of ``blocks``; blocks reaching zero become free."""
        for b in blocks:
            rc = self.ref_counts[b] - 1
            if rc < 0:
                raise RuntimeError(f"decref on free block {b}")
            self.ref_counts[b] = rc
            if rc == 0:
                self._free.append(b)
                if self.on_free is not None:
                    self.on_free(b)
