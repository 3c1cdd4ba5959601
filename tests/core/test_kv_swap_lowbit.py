"""Swap preemption with a 2-/4-bit KV cache (``kv_cache_dtype`` int4 / int2 with
``preemption_mode="swap"``; kvserve.core.kv_swap) on the tiny random Llama in float32: a
victim's full blocks move as their packed codes and scales, its partial last block's model-dtype
rows move through a host residual slot and back into a device residual slot; the outputs of a
workload in a pool too small for it equal each request run alone on a roomy engine with the same
``kv_cache_dtype`` (token-exact), swaps (with residual slots) really happened and nothing was
recomputed; every block, host block and residual slot (device and host) is free at the end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.core.kv_swap import KVSwapSpace, plan_host_pool
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.worker import kv_quant_lowbit as lb

from test_kv_swap import _assert_swapped, _check_swap, _engine, _prompts, _run
from workload import STEP_CAP, _summary, draw_sampling_params, run_workload

LOWBIT = ("int4", "int2")


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _residuals_back(engine: LLMEngine) -> None:
    """Every device residual slot free once nothing runs (after the step that follows the last
    frees), and every host residual slot."""
    r = engine.kv.residual
    r.end_step()
    engine.kv.check_invariants()
    assert r.num_free == r.num_slots and bool((r.map == -1).all())
    s = engine.swap.stats()
    assert s["swap_residual_slots_used"] == 0 and s["swap_blocks_used"] == 0


@pytest.mark.parametrize("kv", LOWBIT)
def test_lowbit_swapped_outputs_equal_a_run_without_preemption(llama, kv):
    """6 requests of 10-30 prompt tokens + 24 greedy or seeded tokens in 20 blocks of 4: swapped
    out and in, partial blocks included, every token as without preemption, none recomputed."""
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    ref_engine = _engine(llama, num_blocks=256, kv_cache_dtype=kv)
    ref = _run(ref_engine, prompts, params)
    assert ref_engine.stats()["num_preemptions"] == 0
    eng = _engine(llama, num_blocks=20, swap_space=1e-4, kv_cache_dtype=kv)
    hk = eng.executor.driver_worker.host_caches[0][0]  # (the host pool is the worker's: LowBitPools)
    dk = eng.kv_caches[0][0]
    assert isinstance(hk, lb.LowBitPool) and hk.data.shape[1:] == dk.data.shape[1:]
    assert hk.residual.shape == (eng.swap.num_residual, *dk.residual.shape[1:]) and eng.swap.num_residual > 0
    assert _run(eng, prompts, params) == ref
    s = _assert_swapped(eng, ref_engine)  # (no recompute: the same tokens ran through the model)
    assert s["swap_num_recompute_fallbacks"] == 0 and s["swap_num_swapped_residuals"] > 0
    assert set(ref_engine.stats()) == set(s)  # (an engine without swap space reports the same counters, 0)
    _residuals_back(eng)


def test_lowbit_swap_space_moves_blocks_and_residual_rows_exactly():
    """LowBitPools: packed blocks and a residual slot survive the round trip through the host pool
    into other device blocks and another slot; a second partial victim with no host residual slot
    free is refused (the caller recomputes it)."""
    g = torch.Generator().manual_seed(0)
    pools = lb.allocate_pools(2, 8, 4, 2, 16, 4, 3, torch.float32, "cpu")
    for pair in pools:
        for c in pair:
            c.data.copy_(torch.randint(0, 256, c.data.shape, dtype=torch.uint8, generator=g))
            c.residual.copy_(torch.randn(c.residual.shape, generator=g))
    before = [[(c.data.clone(), c.residual.clone()) for c in pair] for pair in pools]
    sw = KVSwapSpace(pools, 5, num_residual=1)
    assert sw._mover.residual_bytes == 2 * 2 * 4 * 2 * 16 * 4  # layers · K/V · block · heads · head_dim · fp32
    assert sw.swap_out("a", [6, 1, 3], 10, residual_slot=2) and sw.allocator.num_used == 3
    assert not sw.swap_out("b", [0], 3, residual_slot=0)  # no host residual slot left
    assert sw.stats()["swap_num_recompute_fallbacks"] == 1 and sw.stats()["swap_residual_slots_used"] == 1
    assert sw.swap_out("c", [4], 4)  # a full last block: no residual slot needed
    sw.check_invariants()
    for pair in pools:
        for c in pair:
            c.data.zero_(), c.residual.zero_()
    with pytest.raises(ValueError, match="needs a device residual_slot"):
        sw.swap_in("a", [2, 0, 7])
    assert sw.swap_in("a", [2, 0, 7, 5], residual_slot=1) == 10
    for pair, pair0 in zip(pools, before):
        for c, (d0, r0) in zip(pair, pair0):
            for dst, src in ((2, 6), (0, 1), (7, 3)):
                assert torch.equal(c.data[dst], d0[src])
            assert torch.equal(c.residual[1], r0[2])
            assert not c.data[5].any() and not c.residual[0].any() and not c.residual[2].any()
    sw.discard("c")
    assert sw.allocator.num_used == 0 and not sw.swapped and sw.stats()["swap_residual_slots_used"] == 0
    sw.check_invariants()


def test_plan_host_pool_splits_the_budget():
    gib = 1 << 30
    assert plan_host_pool(1.0, 1000, 0, 16) == (gib // 1000, 0)
    assert plan_host_pool(1.0, 1000, 4096, 16) == ((gib - 16 * 4096) // 1000, 16)
    # a residual slot larger than half the budget: none (partial victims are recomputed)
    assert plan_host_pool(4096 / gib, 100, 4096, 16) == (40, 0)
    assert plan_host_pool(3 * 4096 / gib, 100, 4096, 16) == ((3 * 4096 - 4096) // 100, 1)
    with pytest.raises(ValueError, match=r"swap_space=1e-09 GiB holds no KV block of 1000 bytes"):
        plan_host_pool(1e-9, 1000, 64, 4)


# ------------------------------------------------------------------ randomized
@st.composite
def lowbit_workloads(draw):
    """Workloads under memory pressure on the tiny Llama (test_kv_swap's kinds of request): 4-7
    requests arriving within the first steps, the pool the largest request plus at most 2 blocks."""
    block_size = draw(st.sampled_from([2, 4, 8]))
    prefix = draw(st.lists(st.integers(3, 383), min_size=8, max_size=16))
    requests = []
    for _ in range(draw(st.integers(4, 7))):
        head = prefix if draw(st.booleans()) else []
        prompt = head + draw(st.lists(st.integers(3, 383), min_size=1 if not head else 0, max_size=20))
        max_tokens = draw(st.integers(8, 24))
        kind = draw(st.sampled_from(["greedy", "greedy", "seeded", "seeded", "samples", "beam"]))
        params = draw_sampling_params(draw, kind, max_tokens)
        requests.append(dict(prompt=tuple(prompt), params=params, arrive=draw(st.integers(0, 3)), abort=None))
    need = max(-(-(len(r["prompt"]) + r["params"].max_tokens) // block_size)
               * (r["params"].beam_width if r["params"].use_beam_search else 1) for r in requests)
    return dict(kv=draw(st.sampled_from(LOWBIT)), block_size=block_size, num_blocks=need + draw(st.integers(0, 2)),
                max_num_batched_tokens=draw(st.sampled_from([5, 16, 64])), max_num_seqs=draw(st.sampled_from([2, 4, 16])),
                enable_prefix_caching=draw(st.booleans()), requests=requests)


@pytest.fixture(scope="module")
def alone_lowbit(llama):
    """``(kv, block_size, prompt, params) -> outputs`` of the request alone on a roomy engine."""
    engines, cache = {}, {}

    def run(kv, block_size, prompt, params):
        key = (kv, block_size, prompt, repr(params))
        if key not in cache:
            if (kv, block_size) not in engines:
                engines[kv, block_size] = LLMEngine(EngineArgs(
                    model=llama, dtype="float32", device="cpu", num_blocks=256, block_size=block_size,
                    max_model_len=64, kv_cache_dtype=kv, enable_prefix_caching=False))
            engine = engines[kv, block_size]
            engine.add_request(list(prompt), params)
            outs = [o for _ in range(STEP_CAP) if engine.has_unfinished_requests() for o in engine.step()]
            assert not engine.has_unfinished_requests()
            cache[key] = _summary([o for o in outs if o.finished][-1])
        return cache[key]

    return run


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=lowbit_workloads(), host_blocks=st.sampled_from([3, 16, 64]))
def test_randomized_lowbit_workloads_with_swap(llama, alone_lowbit, w, host_blocks):
    args = dict(model=llama, dtype="float32", device="cpu", num_blocks=w["num_blocks"], block_size=w["block_size"],
                max_model_len=64, max_num_batched_tokens=w["max_num_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                enable_prefix_caching=w["enable_prefix_caching"], kv_cache_dtype=w["kv"])
    bs, bits = w["block_size"], lb.BITS[w["kv"]]
    block = -(-2 * 2 * sum(lb.block_bytes(bs, 16, bits, k) for k in (True, False)) // bs) * bs  # 2 layers, 2 heads
    res = 2 * 2 * bs * 2 * 16 * 4  # a residual slot: layers · K/V · block · heads · head_dim · fp32
    # host_blocks blocks, and a residual slot per sequence where that is at most half the budget
    engine = LLMEngine(EngineArgs(**args, swap_space=(host_blocks * block + w["max_num_seqs"] * res + block / 2) / (1 << 30)))
    assert engine.swap.num_blocks >= host_blocks and engine.swap.num_residual >= 1
    check_kv = engine.kv.check_invariants
    engine.kv.check_invariants = lambda: (check_kv(), _check_swap(engine))  # (run_workload: after every step)
    ids, final = run_workload(engine, w["requests"], STEP_CAP)
    for rid, out in final.items():
        assert out.error is None
        assert _summary(out) == alone_lowbit(w["kv"], w["block_size"], ids[rid]["prompt"], ids[rid]["params"]), rid
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.groups
    _residuals_back(engine)


def test_detach_unmaps_a_stale_slot_until_the_step_ends():
    """A block freed with a residual slot (marked for release) and handed out again to receive
    moved, full blocks (a swap-in, a disk load): detach unmaps it at once, so readers take the
    packed data, and the slot comes back with the marked ones after the step."""
    from kvserve.core.kv_cache_manager import ResidualSlots

    r = ResidualSlots(8, 2)
    assert r.ensure(3) and r.ensure(5) and r.num_free == 0
    r.release_later(3)  # (block 3 freed)
    r.detach([3, 4])  # (4 holds no slot: nothing to do)
    assert int(r.map[3]) == -1 and int(r.map[5]) >= 0 and not r.has(3) and r.num_free == 0
    r.end_step()
    assert r.num_free == 1 and r.has(5) and int((r.map >= 0).sum()) == 1


def test_swap_ops_carry_residual_slots_and_keep_their_order():
    """Residual slots ride along the swap batches (merged pairwise); one host residual slot
    written twice (a host copy dropped and its slot reused) starts a new batch, so the later
    write wins."""
    from kvserve.core.kv_ops import KVCacheOps

    ops = KVCacheOps()
    ops.swap_out([1, 2], [0, 1], residual=(5, 0))
    ops.swap_out([3], [2])
    ops.swap_out([4], [3], residual=(6, 1))
    ops.swap_out([7], [4], residual=(8, 0))
    ops.swap_in([0], [9], residual=(1, 2))
    got = ops.take()
    assert [(b.kind, b.src, b.dst, b.source) for b in got.batches] == [
        ("swap_out", [1, 2, 3, 4], [0, 1, 2, 3], [[5, 6], [0, 1]]),
        ("swap_out", [7], [4], [[8], [0]]),
        ("swap_in", [0], [9], [[1], [2]])]


@pytest.mark.parametrize("kv", LOWBIT)
def test_lowbit_swap_with_prefix_cache_and_disk_tier(llama, kv, tmp_path):
    """Swaps, prefix-cache hits and disk-tier reads in one engine: 6 prompts sharing a 24-token
    prefix in 20 blocks of 4 (swapped), then 6 sharing another (evicting the first prefix to disk),
    then the first 6 again (read back from disk): each wave the tokens of a run without preemption."""
    a = _prompts(6, lo=2, hi=10, seed=3, prefix=tuple(range(40, 64)))
    b = _prompts(6, lo=2, hi=10, seed=4, prefix=tuple(range(100, 124)))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = _engine(llama, num_blocks=256, kv_cache_dtype=kv)
    want = {"a": _run(ref, a, params), "b": _run(ref, b, params)}
    eng = _engine(llama, num_blocks=20, swap_space=1e-4, kv_cache_dtype=kv, enable_prefix_caching=True,
                  kv_offload_dir=str(tmp_path), kv_offload_gib=0.01)
    for wave, prompts in (("a", a), ("b", b), ("a", a)):
        assert _run(eng, prompts, params) == want[wave], wave
    s = _assert_swapped(eng)
    assert s["swap_num_swapped_residuals"] > 0 and s["kv_offload_read_blocks"] > 0 and s["prefix_cache_hits"] > 0
    _residuals_back(eng)
