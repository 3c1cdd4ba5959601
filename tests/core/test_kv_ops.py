"""KV block ops (kvserve.core.kv_ops, kvserve.worker.kv_block_mover): the KV cache manager and the
swap space with no pools at all keep their books and record the copies and swaps they used to do
(the expected op lists); a record applied in batches equals its moves applied one by one, in
order, whatever the hazards between them (a block copied then copied from, written twice, a
host block swapped in then reused by a swap-out, a swapped-out block reused by a copy); batches
are split only where the order needs it; the record pickles."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_ops import COPY, SWAP_IN, SWAP_OUT, KVCacheOps
from kvserve.core.kv_swap import KVSwapSpace
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.worker.kv_block_mover import KVBlockMover

BS = 4


def _req(rid: str, prompt, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=8, **kw),
                   seed=0)


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does to the books once the forward computed ``n`` tokens."""
    req.num_computed_tokens += n
    kv.cache_computed(req)


# ------------------------------------------------------------------ (a) recording with no pools
def test_partial_prefix_hit_is_recorded_as_a_copy():
    kv = KVCacheManager(16, BS, True, None)  # no pools at all
    a = _req("a", range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    assert kv.admit(a, 64) == 10
    _compute(kv, a, 10)
    ta = list(kv.block_tables["a"])
    kv.free(a)
    assert not kv.ops  # admission without a partial hit copies nothing
    b = _req("b", list(range(100, 107)) + [7, 8])  # shares 7 tokens: 1 full block + 3 in block 2
    assert kv.admit(b, 64) == 2
    tb = kv.block_tables["b"]
    assert tb[0] == ta[0] and b.num_computed_tokens == 7
    assert kv.ops.moves() == [(COPY, ta[1], tb[1], 3)]
    ops = kv.ops.take()
    assert len(ops) == 1 and not kv.ops and kv.ops.moves() == []
    kv.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_fork_and_clone_are_recorded_as_copies(caching):
    kv = KVCacheManager(32, BS, caching, None)
    src = _req("s", range(10, 21))  # 11 prompt tokens: the fork shares 10 = 2 full blocks + 2
    assert kv.admit(src, 64) == 11
    _compute(kv, src, 11)
    ts = kv.block_tables["s"]
    dst = _req("d", range(10, 21))
    assert kv.fork(src, dst)  # (before, with no pools the fork was refused)
    td = kv.block_tables["d"]
    assert td[:2] == ts[:2] and td[2] != ts[2] and dst.num_computed_tokens == 10
    assert kv.ops.moves() == [(COPY, ts[2], td[2], 2)]
    # beam-search clones: one more copy each of the block holding the last position
    handle = kv.detach(src)
    c1 = kv.clone(handle, 11)
    c2 = kv.clone(handle, 9)
    assert c1 is not None and c2 is not None
    assert kv.ops.moves()[1:] == [(COPY, ts[2], c1[0][2], 3), (COPY, ts[2], c2[0][2], 1)]
    assert len(kv.ops.batches) == 1  # three copies, no hazard: one batch (one gather + scatter per layer)
    for h in (handle, c1, c2):
        kv.release(h)
    kv.free(dst)
    kv.check_invariants()


def test_swaps_are_recorded_in_order_with_the_copies():
    kv = KVCacheManager(16, BS, False, None)
    sw = KVSwapSpace(None, 6, ops=kv.ops, block_bytes=1024)
    assert sw.block_bytes == 1024 and sw.num_blocks == 6
    assert sw.swap_out("x", [5, 2, 9], 11)
    assert not sw.swap_out("y", [0, 1, 3, 4], 16)  # 3 host blocks left: recompute, nothing recorded
    kv.ops.copy(7, 2, 3)  # a device block swapped out is reused at once
    assert sw.swap_in("x", [2, 8, 12, 13]) == 11
    assert sw.swap_out("z", [12, 8], 8)  # reads blocks the swap-in just wrote
    assert kv.ops.moves() == [
        (SWAP_OUT, 5, 0), (SWAP_OUT, 2, 1), (SWAP_OUT, 9, 2),
        (COPY, 7, 2, 3),
        (SWAP_IN, 0, 2), (SWAP_IN, 1, 8), (SWAP_IN, 2, 12),
        (SWAP_OUT, 12, 3), (SWAP_OUT, 8, 4),
    ]
    assert [b.kind for b in kv.ops.batches] == [SWAP_OUT, COPY, SWAP_IN, SWAP_OUT]
    sw.check_invariants()
    s = sw.stats()
    assert s["swap_num_swap_outs"] == 2 and s["swap_num_swap_ins"] == 1 and s["swap_num_recompute_fallbacks"] == 1
    assert s["swap_num_swapped_out_blocks"] == 5 and s["swap_num_swapped_in_blocks"] == 3


def test_ops_pickle_and_take_leaves_the_recorder_empty():
    ops = KVCacheOps()
    ops.copy(1, 2, 3)
    ops.swap_out([4, 5], [0, 1])
    sent = ops.take()
    back = pickle.loads(pickle.dumps(sent))
    assert back == sent and back.moves() == sent.moves() == [(COPY, 1, 2, 3), (SWAP_OUT, 4, 0), (SWAP_OUT, 5, 1)]
    assert not ops and len(ops) == 0 and len(sent) == 3
    ops.copy(2, 1, 1)  # the hazard set went with the taken ops: a new record starts a new batch
    assert len(ops.batches) == 1


def test_bad_records_raise():
    ops = KVCacheOps()
    with pytest.raises(ValueError):
        ops.copy(3, 3, 2)
    with pytest.raises(ValueError):
        ops.copy(1, 2, 0)
    with pytest.raises(ValueError):
        ops.swap_out([1, 2], [0])
    with pytest.raises(ValueError):
        ops.swap_in([0, 1], [5, 5])
    assert not ops


# ------------------------------------------------------------------ (c) order: batched == one by one
def _pools(num_blocks: int, host_blocks: int, seed: int, layers: int = 2, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)

    def t(n):
        x = torch.randn(n, BS, 2, 3, generator=g) * 50
        return x.to(torch.int8) if dtype == torch.int8 else x.to(dtype)

    return [(t(num_blocks), t(num_blocks)) for _ in range(layers)], [(t(host_blocks), t(host_blocks))
                                                                        for _ in range(layers)]


def _one_by_one(moves, dev, host) -> None:
    """The reference: each move on its own, in order."""
    for m in moves:
        for (k, v), (hk, hv) in zip(dev, host):
            for c, h in ((k, hk), (v, hv)):
                if m[0] == COPY:
                    c[m[2], : m[3]] = c[m[1], : m[3]].clone()
                elif m[0] == SWAP_OUT:
                    h[m[2]] = c[m[1]]
                else:
                    c[m[2]] = h[m[1]]


def _batched(ops, dev, host) -> None:
    mover = KVBlockMover(dev)
    mover.host_caches = host
    mover.apply(ops)


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)
               for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def _check(ops: KVCacheOps, nb: int = 8, nh: int = 6, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    dev1, host1 = _pools(nb, nh, seed, dtype=dtype)
    dev2, host2 = [tuple(t.clone() for t in p) for p in dev1], [tuple(t.clone() for t in p) for p in host1]
    _batched(ops, dev1, host1)
    _one_by_one(ops.moves(), dev2, host2)
    assert _same(dev1, dev2) and _same(host1, host2)


@pytest.mark.parametrize("record, num_batches", [
    # a copy whose source an earlier copy wrote (a chain): two batches
    pytest.param(lambda o: (o.copy(0, 1, 4), o.copy(1, 2, 4)), 2, id="copy_chain"),
    # the same destination written twice (a freed block reused before the forward): two batches
    pytest.param(lambda o: (o.copy(0, 3, 4), o.copy(1, 3, 2)), 2, id="copy_twice_into_one_block"),
    # a copy into a block an earlier copy read (read first by the gather): one batch
    pytest.param(lambda o: (o.copy(0, 1, 3), o.copy(2, 0, 4)), 1, id="copy_into_a_block_read_before"),
    # copies out of one block into several (a fork of n samples, beam clones): one batch
    pytest.param(lambda o: (o.copy(0, 1, 2), o.copy(0, 2, 3), o.copy(0, 3, 1)), 1, id="fork_into_many"),
    # a swapped-out block reused at once by a copy and a swap-in (the same step's admissions)
    pytest.param(lambda o: (o.swap_out([1, 2], [0, 1]), o.copy(3, 1, 2), o.swap_in([0], [2])), 3,
                 id="swap_out_then_reuse"),
    # a host block swapped in, freed, and reused by a swap-out in the same window
    pytest.param(lambda o: (o.swap_in([0, 1], [4, 5]), o.swap_out([4], [0])), 2, id="swap_in_then_host_reuse"),
    # a swap-out whose host block was written by an earlier swap-out of the batch (aborted, reused)
    pytest.param(lambda o: (o.swap_out([1], [3]), o.swap_out([2], [3])), 2, id="swap_out_twice_into_one_host_block"),
    # swap-ins into a device block twice: two batches
    pytest.param(lambda o: (o.swap_in([0], [6]), o.swap_in([1], [6])), 2, id="swap_in_twice_into_one_block"),
])
def test_hazards_split_batches_and_batched_equals_one_by_one(record, num_batches):
    ops = KVCacheOps()
    record(ops)
    assert len(ops.batches) == num_batches
    _check(ops)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from([COPY, SWAP_OUT, SWAP_IN]), st.integers(0, 7), st.integers(0, 7),
                          st.integers(1, BS), st.integers(0, 5)), max_size=20),
       st.integers(0, 3))
def test_random_records_applied_in_batches_equal_one_by_one(moves, seed):
    ops = KVCacheOps()
    for kind, a, b, n, h in moves:
        if kind == COPY:
            if a != b:
                ops.copy(a, b, n)
        elif kind == SWAP_OUT:
            ops.swap_out([a], [h])
        else:
            ops.swap_in([h], [b])
    _check(ops, seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_every_pool_dtype_moves_as_bytes(dtype):
    """The 8-bit pools (rows with their scales) and bf16 move exactly; float8 as its bytes (torch
    has no index_copy_ for it on the CPU)."""
    ops = KVCacheOps()
    ops.copy(0, 1, 3)
    ops.copy(2, 3, 4)
    ops.swap_out([1, 4], [0, 5])
    ops.copy(5, 4, 2)
    ops.swap_in([5, 0], [6, 7])
    _check(ops, dtype=dtype)


def test_local_pools_apply_at_once_and_record_nothing():
    """With pools in the caller's process (unit tests, a draft model) the manager and the swap
    space apply each op at once, as they copied before: nothing stays recorded."""
    dev, _ = _pools(16, 1, seed=1)
    before = [tuple(t.clone() for t in p) for p in dev]
    kv = KVCacheManager(16, BS, False, dev)
    src = _req("s", range(10, 21))
    kv.admit(src, 64)
    _compute(kv, src, 11)
    dst = _req("d", range(10, 21))
    assert kv.fork(src, dst) and not kv.ops
    ts, td = kv.block_tables["s"], kv.block_tables["d"]
    for (k, v), (k0, v0) in zip(dev, before):
        assert torch.equal(k[td[2], :2], k0[ts[2], :2]) and torch.equal(v[td[2], :2], v0[ts[2], :2])
        assert torch.equal(k[td[2], 2:], k0[td[2], 2:])  # the rest of the block untouched
    sw = KVSwapSpace(dev, 3)
    assert sw.swap_out("s", ts, 11) and not sw.ops
    for k, v in dev:
        k.zero_(), v.zero_()
    new = [b for b in range(16) if b not in td][:3]
    assert sw.swap_in("s", new) == 11 and not sw.ops
    for (k, v), (k0, v0) in zip(dev, before):
        for a, b in zip(ts, new):
            assert torch.equal(k[b], k0[a]) and torch.equal(v[b], v0[a])
