"""KV compression policies without a model: the selection functions against NumPy, the admission
bound, and KVCacheManager.compress on local pools (in place for blocks the request alone holds,
fresh copies for shared or cached ones, the K/V moved)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_compression import KVCompressionConfig, h2o_keep, snapkv_keep, streaming_keep
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams


def np_topk(x, k):
    return np.sort(np.argsort(-x, kind="stable")[:k])


def test_streaming_keep():
    assert streaming_keep(10, 4, 8) == list(range(10))
    assert streaming_keep(20, 4, 8) == [0, 1, 2, 3] + list(range(12, 20))
    assert streaming_keep(20, 0, 5) == list(range(15, 20))


@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_keep_matches_numpy(seed):
    g = np.random.default_rng(seed)
    L, H, n, B, w, k = 2, 3, 50, 20, 6, 5
    scores = g.random((L, H, n)).astype(np.float32)
    scores[0, 0, 10:14] = 0.5  # ties
    got = snapkv_keep(torch.from_numpy(scores), B, w, k).numpy()
    for l in range(L):
        for h in range(H):
            s = np.concatenate([np.full(k // 2, -np.inf), scores[l, h, : n - w], np.full(k // 2, -np.inf)])
            pooled = np.array([s[i : i + k].max() for i in range(n - w)])
            want = np.concatenate([np_topk(pooled, B - w), np.arange(n - w, n)])
            np.testing.assert_array_equal(got[l, h], want)


def test_h2o_keep_matches_numpy():
    g = np.random.default_rng(3)
    scores = g.random((2, 2, 40)).astype(np.float32)
    scores[1, 1, :] = 1.0  # all tied: the earliest win
    got = h2o_keep(torch.from_numpy(scores), 16, 4).numpy()
    for l in range(2):
        for h in range(2):
            want = np.concatenate([np_topk(scores[l, h, :36], 12), np.arange(36, 40)])
            np.testing.assert_array_equal(got[l, h], want)
    np.testing.assert_array_equal(got[1, 1], np.concatenate([np.arange(12), np.arange(36, 40)]))


def test_config_fields_and_bound():
    c = KVCompressionConfig.parse('{"method": "streaming_llm", "window": 256}')
    assert (c.sink_tokens, c.window, c.kept) == (4, 256, 260)
    assert c.to_dict() == {"method": "streaming_llm", "sink_tokens": 4, "window": 256}
    assert c.max_kv_tokens(12, 4000, 64, 16) == 260 + 15 + 64
    assert c.max_kv_tokens(12, 100, 64, 16) == 112
    s = KVCompressionConfig.parse({"method": "snapkv", "budget": 64})
    assert (s.observation_window, s.kernel_size) == (32, 7) and s.uses_scores
    assert s.max_kv_tokens(1000, 50, 2048, 16) == 1000 and s.max_kv_tokens(10, 500, 2048, 16) == 510
    assert not KVCompressionConfig.parse({"method": "none"}).enabled
    with pytest.raises(ValueError, match=r"kv_compression\.budget must be at most max_model_len \(100\)"):
        KVCompressionConfig.parse({"method": "h2o", "budget": 101, "recent": 1}).check_fits(100)
    with pytest.raises(ValueError, match=r"kv_compression\.window: sink_tokens \+ window = 104"):
        KVCompressionConfig.parse({"method": "streaming_llm", "window": 100}).check_fits(100)


def _req(rid: str, n: int, comp) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), seed=0,
                   kv_compression=KVCompressionConfig.parse(comp))


def _pools(num_blocks=16, bs=4, heads=2, hd=3):
    torch.manual_seed(0)
    return [(torch.randn(num_blocks, bs, heads, hd), torch.randn(num_blocks, bs, heads, hd)) for _ in range(2)]


def _slot_rows(pools, table, n, bs):
    return [torch.stack([k[table[j // bs], j % bs] for j in range(n)]) for k, _ in pools]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_compress_moves_kept_tokens(prefix_caching):
    """18 tokens in 5 blocks of 4 → StreamingLLM (2 sinks + 6 recent) keeps 8 in 2 blocks; the K of
    KV index j afterwards is the K of the kept old index; blocks the request alone held are reused
    in place, cached ones (prefix caching) replaced by fresh ones, the rest freed."""
    bs = 4
    pools = _pools(bs=bs)
    kv = KVCacheManager(16, bs, enable_prefix_caching=prefix_caching, kv_caches=pools)
    req = _req("a", 18, {"method": "streaming_llm", "sink_tokens": 2, "window": 6})
    assert kv.admit(req, 18) == 18
    req.num_computed_tokens = 18
    kv.cache_computed(req)
    old = list(kv.block_tables["a"])
    before = _slot_rows(pools, old, 18, bs)
    keep = streaming_keep(18, 2, 6)
    assert kv.compress(req, keep, 8)
    new = kv.block_tables["a"]
    assert len(new) == 2 and req.num_dropped_tokens == 10 and req.num_kv_tokens == 8
    if prefix_caching:  # its 4 full blocks went to the cache: fresh copies, the cache keeps the exact ones
        assert not set(new) & set(old) and kv.num_cached_blocks == 4
    else:
        assert new == old[:2] and kv.num_used_blocks == 2
    after = _slot_rows(pools, new, 8, bs)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b[keep], rtol=0, atol=0)
    kv.check_invariants()
    # a compacted request inserts nothing more into the cache
    req.num_computed_tokens += 4
    assert kv.allocate_slots(req, 0)
    cached = kv.num_cached_blocks
    kv.cache_computed(req)
    kv.free(req)
    assert kv.num_cached_blocks == cached and kv.num_used_blocks == 0
    kv.check_invariants()


def test_compress_copies_blocks_shared_with_a_fork():
    """A fork shares the first blocks: the compaction of one writes fresh blocks, the other's K/V
    stays as it was."""
    bs = 4
    pools = _pools(bs=bs)
    kv = KVCacheManager(16, bs, kv_caches=pools)
    comp = {"method": "streaming_llm", "sink_tokens": 1, "window": 3}
    a, b = _req("a", 13, comp), _req("b", 13, comp)
    assert kv.admit(a, 13) == 13
    a.num_computed_tokens = 13
    assert kv.fork(a, b)  # b shares a's 3 full blocks, copies the 4th
    shared = kv.block_tables["b"][:3]
    b_before = _slot_rows(pools, kv.block_tables["b"], 12, bs)
    assert kv.compress(a, streaming_keep(13, 1, 3), 4)
    assert kv.block_tables["a"][0] not in shared
    b_after = _slot_rows(pools, kv.block_tables["b"], 12, bs)
    for x, y in zip(b_before, b_after):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    kv.check_invariants()
