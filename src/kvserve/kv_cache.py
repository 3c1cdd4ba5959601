"""The paged KV cache: pool sizing from a memory budget, the K/V tensors, and per-request
block tables.

Per layer there is one K pool and one V pool, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A request's block table lists the blocks holding its tokens in order; token at
position ``p`` lives in slot ``block_table[p // block_size] · block_size + p % block_size``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.block_pool import BlockPool, NoFreeBlocksError
from kvserve.config import ModelConfig
from kvserve.request import Request

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(slots=True)
class KVCacheSpec:
    """The sizes derived from the budget.

    Attributes:
        bytes_per_token: ``2 · num_layers · num_kv_heads · head_dim · dtype_bytes``.
        num_blocks, block_size: pool geometry.
        capacity_tokens: ``num_blocks · block_size``.
        max_model_len: the longest sequence (tokens).
    """

    bytes_per_token: int
    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_full_sequences(self) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once."""
        return self.capacity_tokens / self.max_model_len

    def describe(self) -> str:
        return (
            f"KV cache: {self.bytes_per_token} bytes/token, {self.num_blocks} blocks x {self.block_size} "
            f"tokens = {self.capacity_tokens} tokens ({self.num_blocks * self.block_size * self.bytes_per_token / GiB:.2f} GiB); "
            f"{self.max_concurrent_full_sequences:.1f} sequences of max_model_len={self.max_model_len} fit"
        )


def plan_kv_cache(cfg: ModelConfig, dtype: torch.dtype, memory_gib: float, block_size: int,
                  max_model_len: int, num_blocks: Optional[int] = None) -> KVCacheSpec:
    """Size the pool: ``num_blocks = floor(budget / (bytes_per_token · block_size))``.

    Raises:
        ValueError: if the budget holds no block, or ``memory_gib`` is not positive.
    """
    bpt = cfg.kv_bytes_per_token(dtype)
    if num_blocks is None:
        if not memory_gib > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {memory_gib}")
        num_blocks = int(memory_gib * GiB) // (bpt * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={memory_gib} GiB holds no block of {block_size} tokens at {bpt} bytes/token"
        )
    return KVCacheSpec(bpt, num_blocks, block_size, max_model_len)


def allocate_kv_cache(cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate the per-layer K and V pools once, zero-filled.

    Returns:
        ``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors.
    """
    shape = (spec.num_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Args:
        num_blocks, block_size: pool geometry.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns:
            False (and allocates nothing) when the pool has too few free blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return True
        try:
            table.extend(self.pool.allocate(need))
        except NoFreeBlocksError:
            return False
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (they return to the pool when unreferenced)."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.decref(table)

    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks
