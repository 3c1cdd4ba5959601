"""The KV manager's compaction over 2-/4-bit pools (:meth:`KVCacheManager.compress`,
:mod:`kvserve.worker.kv_compressor`, :mod:`kvserve.worker.kv_quant_lowbit`), no model: the kept
tokens' rows as they were read (full blocks dequantized, the partial block's model-dtype residual
rows) become the new table's rows, each new full block quantized again from them and the partial
last block's rows in its residual slot; residual slots: the new partial block gets one, new full
blocks hold none (a freshly allocated block whose slot was still waiting for release is detached),
the old partial block's slot comes back after the next step."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_compression import KVCompressionConfig, streaming_keep
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.worker import kv_quant_lowbit as lb

BS = 4


def _req(rid: str, n: int, comp=None) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), seed=0,
                   kv_compression=KVCompressionConfig.parse(comp))


def _compute(kv: KVCacheManager, req: Request, n: int, gen: torch.Generator) -> None:
    """Admit ``req`` and write random K/V for its ``n`` tokens as a forward would (then end_step)."""
    assert kv.admit(req, n) == n
    table = kv.block_tables[req.request_id]
    slots = torch.tensor([table[j // BS] * BS + j % BS for j in range(n)])
    for pair in kv.kv_caches:
        for pool in pair:
            x = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=gen)
            lb.write(pool, x, slots, kv.residual.map)
    kv.end_step()
    req.num_computed_tokens = n


def _read(kv: KVCacheManager, table: list[int], idx: list[int]) -> list[torch.Tensor]:
    slots = torch.tensor([table[j // BS] * BS + j % BS for j in idx])
    return [lb.gather(pool, slots, kv.residual.map) for pair in kv.kv_caches for pool in pair]


@pytest.mark.parametrize("bits", [4, 2])
def test_compress_requantizes_kept_rows_and_moves_residual_slots(bits):
    pools = lb.allocate_pools(2, 7, BS, 2, 8, bits, 4, torch.float32, "cpu")
    kv = KVCacheManager(7, BS, enable_prefix_caching=True, kv_caches=pools, residual_blocks=4)
    gen = torch.Generator().manual_seed(0)
    comp = {"method": "streaming_llm", "sink_tokens": 2, "window": 4}
    a, b, c = _req("a", 18, comp), _req("b", 2), _req("c", 2)
    for r, n in ((a, 18), (b, 2), (c, 2)):
        _compute(kv, r, n, gen)
    old = list(kv.block_tables["a"])
    res = kv.residual
    assert [res.has(x) for x in old] == [False] * 4 + [True]  # (18 tokens: block 4 partial)
    keep = streaming_keep(18, 2, 4)
    before = _read(kv, old, keep)
    b_block, c_block = kv.block_tables["b"][0], kv.block_tables["c"][0]
    kv.free(b)
    kv.free(c)  # (their slots wait for the next end_step; the free queue is now [b's, c's])
    kv.cache_computed(a)  # (a's 4 full blocks enter the cache: the compaction writes fresh blocks)
    assert kv.compress(a, keep, 6)
    new = kv.block_tables["a"]
    assert new == [b_block, c_block] and a.num_dropped_tokens == 12
    # the new full block holds no slot (b's, waiting for release, was detached); the partial one has one
    assert not res.has(new[0]) and res.has(new[1]) and int(res.map[new[0]]) == -1
    after = _read(kv, new, list(range(6)))
    for x, y, pool in zip(before, after, [p for pair in pools for p in pair]):
        requant = lb.dequantize_blocks(lb.quantize_blocks(x[:BS].unsqueeze(0), bits, pool.is_key), bits,
                                       pool.is_key, BS, pool.head_dim, torch.float32)[0]
        torch.testing.assert_close(y[:BS], requant, rtol=0, atol=0)
        torch.testing.assert_close(y[BS:], x[BS:], rtol=0, atol=0)  # (residual rows: as they were read)
        # keys: new per-channel groups over other tokens, the values move; values: per-token groups,
        # a dequantized row quantizes back to itself (here, float32)
        assert torch.equal(y[:BS], x[:BS]) != pool.is_key
    kv.check_invariants()
    kv.end_step()  # the old partial block's slot (and b's) come back
    assert res.num_free == res.num_slots - 1
    kv.free(a)
    kv.end_step()
    assert res.num_free == res.num_slots and bool((res.map == -1).all())
    kv.check_invariants()


def test_compress_waits_for_a_residual_slot():
    """No residual slot free for the kept tokens' partial last block: nothing changes (False), and
    the compaction goes through once a slot is back."""
    pools = lb.allocate_pools(1, 16, BS, 2, 8, 4, 1, torch.float32, "cpu")
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, kv_caches=pools, residual_blocks=1)
    gen = torch.Generator().manual_seed(1)
    a = _req("a", 16, {"method": "streaming_llm", "sink_tokens": 2, "window": 4})
    b = _req("b", 3)
    _compute(kv, a, 16, gen)  # (4 full blocks: no slot)
    _compute(kv, b, 3, gen)  # (b holds the only slot)
    table = list(kv.block_tables["a"])
    assert not kv.compress(a, streaming_keep(16, 2, 4), 6)
    assert kv.block_tables["a"] == table and a.num_dropped_tokens == 0
    kv.free(b)
    kv.end_step()
    assert kv.compress(a, streaming_keep(16, 2, 4), 6)
    assert kv.block_tables["a"] == table[:2] and kv.residual.has(table[1])
    kv.check_invariants()


def test_compress_in_place_keeps_the_partial_blocks_slot():
    """7 tokens (block 0 full, block 1 with 3 rows in a residual slot) → 5 kept (2 sinks + 3 recent),
    in place: block 0 requantized from kept rows 0..3, block 1 keeps its slot with the last kept row
    first (read before the slot is rewritten)."""
    pools = lb.allocate_pools(1, 8, BS, 2, 8, 4, 2, torch.float32, "cpu")
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, kv_caches=pools, residual_blocks=2)
    gen = torch.Generator().manual_seed(2)
    a = _req("a", 7, {"method": "streaming_llm", "sink_tokens": 2, "window": 3})
    _compute(kv, a, 7, gen)
    old = list(kv.block_tables["a"])
    slot = int(kv.residual.map[old[1]])
    keep = streaming_keep(7, 2, 3)
    assert keep == [0, 1, 4, 5, 6]
    before = _read(kv, old, keep)
    assert kv.compress(a, keep, 5)
    assert kv.block_tables["a"] == old and int(kv.residual.map[old[1]]) == slot
    after = _read(kv, old, list(range(5)))
    for x, y, pool in zip(before, after, pools[0]):
        requant = lb.dequantize_blocks(lb.quantize_blocks(x[:BS].unsqueeze(0), 4, pool.is_key), 4, pool.is_key, BS,
                                       pool.head_dim, torch.float32)[0]
        torch.testing.assert_close(y[:BS], requant, rtol=0, atol=0)
        torch.testing.assert_close(y[BS:], x[BS:], rtol=0, atol=0)
    kv.end_step()
    assert kv.residual.num_free == 1
    kv.check_invariants()
