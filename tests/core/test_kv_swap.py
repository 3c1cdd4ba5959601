"""The CPU swap tier (``preemption_mode="swap"``, ``swap_space``; kvserve.core.kv_swap) on tiny random
models in float32: outputs under swapping equal a run with no preemption token for token, and
swap-outs, swap-ins and their block counts are asserted to have happened (no recomputation: the
prompt tokens run through the model are the prompts' once); the 8-bit cache; n > 1 and beam
search; prefix caching; speculative decoding and structured output; a host pool too small
(recompute fallback) and a swapped request that can never come back (recomputed, not hung);
abort while swapped; randomized workloads with both pools' invariants after every step; the
host allocator's invariants; Prometheus counters; bad options."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.core.kv_swap import HostBlockAllocator, KVSwapSpace, check_swap_options
from workload import MAX_MODEL_LEN, STEP_CAP, _summary, alone, folders  # noqa: F401
from workload import draw_sampling_params, run_workload

GiB = 1 << 30
BLOCK = 4


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _swap_gib(engine_or_bpt, blocks: int, block_size: int = BLOCK) -> float:
    """``swap_space`` (GiB) that holds exactly ``blocks`` host blocks."""
    return (blocks + 0.5) * engine_or_bpt * block_size / GiB


def _engine(folder: str, **kw) -> LLMEngine:
    args = dict(model=folder, dtype="float32", device="cpu", block_size=BLOCK, max_model_len=128,
                enable_prefix_caching=False)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _check(engine: LLMEngine) -> None:
    """Both pools' invariants (:func:`_check_swap`)."""
    engine.kv.check_invariants()
    _check_swap(engine)


def _check_swap(engine: LLMEngine) -> None:
    """The host pool's invariants, and a swapped request waits, holding no device blocks and no
    computed tokens (its count is in the swap space)."""
    if engine.swap is None:
        return
    engine.swap.check_invariants()
    waiting = {r.request_id: r for r in engine.scheduler.waiting}
    for rid in engine.swap.swapped:
        assert rid in waiting, f"{rid} is swapped out but not waiting"
        assert not engine.kv.has_blocks(waiting[rid]) and waiting[rid].num_computed_tokens == 0
    assert engine.swap.allocator.num_used == sum(len(s.host_blocks) for s in engine.swap.swapped.values())


def _run(engine: LLMEngine, prompts, params, step_cap: int = 3000) -> dict[str, list]:
    """Add every prompt, step to the end checking invariants; request id → summary. The tokens
    run through the model are summed in ``engine.tokens_computed``."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    engine.tokens_computed = 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        engine.tokens_computed += out.num_batched_tokens
        return out

    engine.scheduler.schedule = counting_schedule
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(list(p), sp, request_id=f"r{i}")
    final = {}
    for _ in range(step_cap):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = _summary(out)
        _check(engine)
    assert not engine.has_unfinished_requests(), "requests left unfinished (a hang)"
    if engine.swap is not None:
        assert engine.swap.allocator.num_used == 0 and not engine.swap.swapped
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return final


def _prompts(n: int, lo: int = 10, hi: int = 30, seed: int = 0, prefix: tuple = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, 383) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _assert_swapped(engine: LLMEngine, ref: LLMEngine | None = None) -> dict:
    """Swap-outs and swap-ins happened, every block swapped out came back; with ``ref`` (the
    same requests without preemption, no prefix caching) nothing was recomputed: the same
    prompt tokens and the same total of tokens ran through the model."""
    s = engine.stats()
    assert s["swap_num_swap_outs"] > 0 and s["swap_num_swap_ins"] > 0, s
    assert s["swap_num_swap_ins"] == s["swap_num_swap_outs"] - s["swap_num_dropped"]
    assert s["swap_num_swapped_in_blocks"] == s["swap_num_swapped_out_blocks"] > 0
    if ref is not None:
        assert s["num_preemptions"] == s["swap_num_swap_outs"]
        assert s["prompt_tokens_computed"] == ref.stats()["prompt_tokens_computed"]
        assert engine.tokens_computed == ref.tokens_computed
    return s


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_swapped_outputs_equal_a_run_without_preemption(llama, kind):
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if kind == "greedy" else
              SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    ref_engine = _engine(llama, num_blocks=256)
    ref = _run(ref_engine, prompts, params)
    assert ref_engine.stats()["num_preemptions"] == 0
    eng = _engine(llama, num_blocks=20, swap_space=1e-4)
    assert eng.preemption_mode == "swap" and eng.swap.num_blocks == 52  # 1e-4 GiB / (512 bytes/token · 4)
    assert _run(eng, prompts, params) == ref
    assert ref_engine.stats()["prompt_tokens_computed"] == sum(map(len, prompts))
    _assert_swapped(eng, ref_engine)
    # the same pool with recompute preempts as often and recomputes prompts
    rec = _engine(llama, num_blocks=20)
    assert rec.preemption_mode == "recompute" and rec.swap is None
    assert _run(rec, prompts, params) == ref
    assert rec.stats()["prompt_tokens_computed"] > sum(map(len, prompts))
    assert rec.tokens_computed > ref_engine.tokens_computed


def test_int8_kv_cache_swaps_rows_with_their_scales(llama):
    prompts = _prompts(6, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref_engine = _engine(llama, num_blocks=256, kv_cache_dtype="int8")
    ref = _run(ref_engine, prompts, params)
    eng = _engine(llama, num_blocks=20, kv_cache_dtype="int8", swap_space=1e-4)
    hk = eng.executor.driver_worker.host_caches[0][0]  # (the host pool is the worker's)
    assert hk.dtype == torch.int8 and hk.shape[1:] == eng.kv_caches[0][0].shape[1:] and hk.shape[-1] == 16 + 4
    assert _run(eng, prompts, params) == ref
    _assert_swapped(eng, ref_engine)


def test_n_samples_and_beams_stay_exact(llama):
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=7, n=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_tokens=12, use_beam_search=True, beam_width=2, n=2, ignore_eos=True),
              SamplingParams(max_tokens=12, use_beam_search=True, beam_width=3, n=2, ignore_eos=True)]
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=28, swap_space=1e-4)
    assert _run(eng, prompts, params) == ref
    s = _assert_swapped(eng)
    assert s["swap_num_recompute_fallbacks"] == 0
    assert s["num_preemptions"] > s["swap_num_swap_outs"]  # the beams were preempted and recomputed


def test_prefix_caching_with_swap(llama):
    prompts = _prompts(6, lo=2, hi=10, seed=3, prefix=tuple(range(40, 56)))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=1e-4, enable_prefix_caching=True)
    assert _run(eng, prompts, params) == ref
    _assert_swapped(eng)
    assert eng.stats()["prefix_cache_hits"] > 0


def test_speculative_decoding_and_structured_output_with_swap(llama):
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(5)]
    params.append(SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{3,40}")))
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=1e-4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert _run(eng, prompts, params) == ref
    _assert_swapped(eng)
    assert eng.stats()["spec_decode_num_drafts"] > 0


# ------------------------------------------------------------------ fallbacks
def test_host_pool_too_small_falls_back_on_recompute(llama):
    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=_swap_gib(512, 6))
    assert eng.swap.num_blocks == 6
    assert _run(eng, prompts, params) == ref
    s = eng.stats()
    assert s["swap_num_recompute_fallbacks"] > 0 and s["swap_num_swap_outs"] > 0
    assert s["num_preemptions"] == s["swap_num_swap_outs"] + s["swap_num_recompute_fallbacks"]
    assert s["prompt_tokens_computed"] > sum(map(len, prompts))  # the fallbacks recomputed


def test_a_swapped_request_that_cannot_come_back_is_recomputed(llama, monkeypatch):
    prompts = _prompts(6, seed=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=1e-4)
    monkeypatch.setattr(eng.kv, "admit_swapped", lambda *a, **k: None)  # its blocks never fit again
    assert _run(eng, prompts, params) == ref
    s = eng.stats()
    assert s["swap_num_swap_outs"] > 0 and s["swap_num_swap_ins"] == 0
    assert s["swap_num_dropped"] == s["swap_num_swap_outs"]


def test_abort_while_swapped_frees_its_host_blocks(llama):
    prompts = _prompts(6, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=1e-4)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    final, aborted = {}, None
    for _ in range(3000):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = _summary(out)
        _check(eng)
        if aborted is None and eng.swap.swapped:
            seq_id = next(iter(eng.swap.swapped))
            aborted = seq_id.rsplit("#", 1)[0]
            held, used = eng.swap.num_blocks_of(seq_id), eng.swap.allocator.num_used
            assert held > 0
            eng.abort_request(aborted)
            assert not eng.swap.is_swapped(seq_id) and eng.swap.allocator.num_used == used - held
            assert all(r.request_id != seq_id for r in eng.scheduler.waiting)
            _check(eng)
    assert aborted is not None and not eng.has_unfinished_requests()
    assert eng.swap.allocator.num_used == 0
    assert final == {k: v for k, v in ref.items() if k != aborted}


def test_swap_in_allowance_per_step(llama):
    """A step swaps in at most max_num_batched_tokens // block_size blocks, but at least one
    request: with an 8-token budget (2 blocks) requests of more blocks still come back, one a step."""
    prompts = _prompts(6, seed=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _run(_engine(llama, num_blocks=256), prompts, params)
    eng = _engine(llama, num_blocks=20, swap_space=1e-4, max_num_batched_tokens=8)
    assert eng.scheduler.max_swap_in_blocks == 2
    steps: list[list[int]] = []  # per scheduling pass, the blocks of each swap-in
    orig_swap_in, orig_schedule = eng.swap.swap_in, eng.scheduler.schedule

    def swap_in(rid, blocks, residual_slot=None):
        steps[-1].append(eng.swap.num_blocks_of(rid))
        return orig_swap_in(rid, blocks, residual_slot)

    def schedule():
        steps.append([])
        return orig_schedule()

    eng.swap.swap_in, eng.scheduler.schedule = swap_in, schedule
    assert _run(eng, prompts, params) == ref
    _assert_swapped(eng)
    assert any(n > 2 for ins in steps for n in ins)  # larger than the allowance, still swapped in
    assert all(len(ins) <= 1 or sum(ins) <= 2 for ins in steps)  # several at once only within it


# ------------------------------------------------------------------ randomized
@st.composite
def pressed_workloads(draw):
    """Workloads under memory pressure (test_engine_randomized's kinds of request): several
    requests arrive within the first steps, decode up to 24 tokens each, and the pool holds the
    largest request (beams side by side) plus at most 3 blocks."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.lists(st.integers(3, 383), min_size=8, max_size=16))
    requests = []
    for _ in range(draw(st.integers(3, 8))):
        head = prefix if draw(st.booleans()) else []
        prompt = head + draw(st.lists(st.integers(3, 383), min_size=1 if not head else 0, max_size=20))
        max_tokens = draw(st.integers(8, min(24, MAX_MODEL_LEN - len(prompt))))
        kind = draw(st.sampled_from(["greedy", "greedy", "seeded", "samples", "beam"]))
        params = draw_sampling_params(draw, kind, max_tokens)
        requests.append(dict(prompt=tuple(prompt), params=params, priority=draw(st.integers(0, 1)),
                             arrive=draw(st.integers(0, 3)), abort=draw(st.sampled_from([None] * 6 + [2, 5, 9]))))
    need = max(-(-(len(r["prompt"]) + r["params"].max_tokens) // block_size)
               * (r["params"].beam_width if r["params"].use_beam_search else 1) for r in requests)
    return dict(arch=draw(st.sampled_from(["llama", "gemma3"])), block_size=block_size,
                num_blocks=need + draw(st.integers(0, 3)), max_num_batched_tokens=draw(st.sampled_from([4, 16, 64])),
                max_num_seqs=draw(st.sampled_from([2, 4, 16])), enable_prefix_caching=draw(st.booleans()),
                requests=requests)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=pressed_workloads(), host_blocks=st.sampled_from([3, 16, 64, 256]))
def test_randomized_workloads_with_swap(folders, alone, w, host_blocks):  # noqa: F811
    bpt = {"llama": 512, "gemma3": 2048}[w["arch"]]  # 2 · layers · kv_heads · head_dim · 4 bytes
    engine = LLMEngine(EngineArgs(model=folders[w["arch"]], dtype="float32", device="cpu",
                                  num_blocks=w["num_blocks"], block_size=w["block_size"], max_model_len=MAX_MODEL_LEN,
                                  max_num_batched_tokens=w["max_num_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                                  enable_prefix_caching=w["enable_prefix_caching"],
                                  swap_space=_swap_gib(bpt, host_blocks, w["block_size"])))
    assert engine.swap.num_blocks == host_blocks
    check_kv = engine.kv.check_invariants
    engine.kv.check_invariants = lambda: (check_kv(), _check_swap(engine))  # (run_workload: after every step)
    ids, final = run_workload(engine, w["requests"], STEP_CAP)
    for rid, out in final.items():
        if out == "aborted":
            continue
        assert out.error is None
        assert _summary(out) == alone(w["arch"], ids[rid]["prompt"], ids[rid]["params"]), rid
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.swap.allocator.num_used == 0 and not engine.swap.swapped
    assert not engine.groups


# ------------------------------------------------------------------ host allocator
def test_host_block_allocator_keeps_free_plus_used_equal_total():
    a = HostBlockAllocator(10)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randrange(0, 5)
            got = a.allocate(n)
            if n > a.num_free + (len(got) if got else 0):
                assert got is None
            if got is not None:
                assert len(got) == n
                held.append(got)
        a.check_invariants()
        assert a.num_free + a.num_used == 10
        assert a.num_used == sum(map(len, held))
    with pytest.raises(RuntimeError, match="not in use"):
        a.free([b for b in range(10) if b not in {x for h in held for x in h}][:1] or [99])
    assert a.allocate(a.num_free + 1) is None
    with pytest.raises(ValueError, match="num_blocks must be ≥ 1"):
        HostBlockAllocator(0)


def test_swap_space_moves_blocks_exactly():
    """Block contents survive a round trip through the host pool into other device blocks."""
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(8, 4, 2, 16, generator=g), torch.randn(8, 4, 2, 16, generator=g)) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in pools]
    sw = KVSwapSpace(pools, 5)
    assert sw.swap_out("a", [6, 1, 3], 10) and sw.allocator.num_used == 3
    assert not sw.swap_out("b", [0, 2, 4], 12)  # only 2 host blocks left: recompute
    assert sw.stats()["swap_num_recompute_fallbacks"] == 1 and sw.allocator.num_used == 3
    for k, v in pools:
        k.zero_(), v.zero_()
    assert sw.swap_in("a", [2, 0, 7, 5]) == 10
    for (k, v), (k0, v0) in zip(pools, before):
        for dst, src in ((2, 6), (0, 1), (7, 3)):
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        assert not k[5].any() and not k[1].any()  # nothing else written
    assert sw.allocator.num_used == 0 and not sw.swapped
    sw.check_invariants()
    with pytest.raises(KeyError):
        sw.swap_in("a", [0, 1, 2])


# ------------------------------------------------------------------ metrics
def test_stats_and_prometheus_counters(llama):
    from kvserve.entrypoints.openai.metrics import ServerMetrics
    from kvserve.entrypoints.openai.async_engine import AsyncEngine
    from prometheus_client.parser import text_string_to_metric_families

    eng = _engine(llama, num_blocks=20, swap_space=1e-4)
    prompts = _prompts(6, seed=9)
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    metrics = ServerMetrics("tiny")
    ae = AsyncEngine(eng, metrics)
    peak_usage = 0.0
    while eng.has_unfinished_requests():
        eng.step()
        ae._update_gauges()
        peak_usage = max(peak_usage, eng.stats()["swap_usage"])
    s = eng.stats()
    assert s["swap_blocks_total"] == 52 and s["swap_blocks_used"] == 0 and 0 < peak_usage <= 1
    values = {x.name: x.value for fam in text_string_to_metric_families(metrics.render().decode())
              for x in fam.samples}
    assert values["kvserve:swap_out_requests_total"] == s["swap_num_swap_outs"] > 0
    assert values["kvserve:swap_in_requests_total"] == s["swap_num_swap_ins"] > 0
    assert values["kvserve:swap_out_blocks_total"] == s["swap_num_swapped_out_blocks"] > 0
    assert values["kvserve:swap_in_blocks_total"] == s["swap_num_swapped_in_blocks"] > 0
    assert values["kvserve:swap_recompute_fallbacks_total"] == 0
    assert values["kvserve:cpu_cache_usage_perc"] == 0 and values["kvserve:num_requests_swapped"] == 0
    off = _engine(llama, num_blocks=64).stats()
    assert off["swap_num_swap_outs"] == 0 and off["swap_blocks_total"] == 0


# ------------------------------------------------------------------ bad options
@pytest.mark.parametrize("kwargs, words", [
    ({"swap_space": -1}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got -1"),
    ({"swap_space": float("nan")}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got nan"),
    ({"swap_space": float("inf")}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got inf"),
    ({"swap_space": 1e300}, r"swap_space must be in \[0, 1048576\] GiB \(0: no swap space\), got 1e\+300"),
    ({"swap_space": "4"}, "swap_space must be a number of GiB, got '4'"),
    ({"swap_space": True}, "swap_space must be a number of GiB, got True"),
    ({"preemption_mode": "swap"}, r"preemption_mode='swap' needs swap_space > 0 GiB .*got swap_space=0"),
    ({"preemption_mode": "swap", "swap_space": 0}, r"preemption_mode='swap' needs swap_space > 0 GiB"),
    ({"preemption_mode": "evict", "swap_space": 1},
     r"preemption_mode must be one of \['recompute', 'swap'\] \(or None: swap when swap_space > 0\), got 'evict'"),
])
def test_bad_swap_options_fail_before_the_model_loads(kwargs, words, tmp_path):
    from kvserve import LLM

    with pytest.raises(ValueError, match=words):
        LLM(model=str(tmp_path / "nope.gguf"), **kwargs)


def test_swap_options_defaults_and_sizes(llama):
    assert check_swap_options(0, None) == "recompute" and check_swap_options(4, None) == "swap"
    assert check_swap_options(4, "recompute") == "recompute"
    assert _engine(llama, num_blocks=8, swap_space=4, preemption_mode="recompute").swap is None
    with pytest.raises(ValueError, match=r"swap_space=1e-09 GiB holds no KV block of 4 tokens at 512 bytes/token"):
        _engine(llama, num_blocks=8, swap_space=1e-9)
    with pytest.raises(ValueError, match=r"swap_space: the host pool needs .* GiB of host memory is available"):
        _engine(llama, num_blocks=8, swap_space=1 << 20)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("argv, words", [
    (["--swap-space", "-1"], "--swap-space must be in [0, 1048576] GiB (0: no swap space), got -1.0"),
    (["--swap-space", "nan"], "--swap-space must be in [0, 1048576] GiB (0: no swap space), got nan"),
    (["--preemption-mode", "swap"], "--preemption-mode='swap' needs --swap-space > 0 GiB"),
])
def test_cli_rejects_bad_swap_options_before_loading_the_model(command, argv, words, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(command + argv + ["--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "does not exist" not in err, err


def test_cli_preemption_mode_choices(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--preemption-mode", "evict", "--model", str(tmp_path / "nope.gguf")])
    err = capsys.readouterr().err
    assert "argument --preemption-mode: invalid choice: 'evict'" in err and "recompute" in err and "swap" in err
