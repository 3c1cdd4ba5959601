"""Drive an engine through a randomized workload (tests/engine/test_engine_randomized.py,
tests/spec_decode/test_spec_decode.py)."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine


def run_workload(engine, requests: list[dict], step_cap: int) -> tuple[dict[str, dict], dict[str, object]]:
    """Add each request at its ``arrive`` step (``request_id`` ``r{i}``, with its ``priority`` and
    ``salt`` where given), abort it ``abort`` steps later where that is not None, and step until
    every request finished, checking the KV invariants after every step.

    Returns:
        (request id → the request's dict plus the step it was ``added``,
         request id → its final :class:`RequestOutput`, or "aborted").

    Fails the test if an output comes after its request finished or requests are left
    unfinished after ``step_cap`` steps.
    """
    ids: dict[str, dict] = {}
    final: dict[str, object] = {}
    for step in range(step_cap):
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                rid = engine.add_request(list(r["prompt"]), r["params"], request_id=f"r{i}",
                                         priority=r.get("priority", 0), cache_salt=r.get("salt"))
                ids[rid] = dict(r, added=step)
        for rid, r in ids.items():
            if r["abort"] is not None and step == r["added"] + r["abort"] and rid not in final:
                engine.abort_request(rid)
                final[rid] = "aborted"
        for out in engine.step() if engine.has_unfinished_requests() else []:
            assert out.request_id not in final, f"{out.request_id}: an output after it finished"
            if out.finished:
                final[out.request_id] = out
        engine.kv.check_invariants()
        if len(ids) == len(requests) and not engine.has_unfinished_requests():
            break
    else:
        pytest.fail(f"requests still unfinished after {step_cap} steps")
    assert set(final) == set(ids)
    return ids, final


def draw_sampling_params(draw, kind: str, max_tokens: int) -> SamplingParams:
    """A randomized workload request's parameters of ``kind`` (a hypothesis ``draw`` for its seed):
    ``greedy`` (EOS ignored), ``seeded`` (temperature 1), ``samples`` (n = 2, temperature 0.8,
    seeded), else beam search (width 2, n = 2)."""
    from hypothesis import strategies as st

    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if kind == "seeded":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=draw(st.integers(0, 99)))
    if kind == "samples":
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=draw(st.integers(0, 99)), n=2)
    return SamplingParams(max_tokens=max_tokens, use_beam_search=True, beam_width=2, n=2, ignore_eos=True)


# Fixtures shared by the randomized engine tests (engine/test_engine_randomized.py, core/test_kv_swap.py)
MAX_MODEL_LEN = 64
STEP_CAP = 2000


@pytest.fixture(scope="module")
def folders(tiny_model_dir):
    return {arch: str(tiny_model_dir(arch)[0]) for arch in ("llama", "gemma3")}


@pytest.fixture(scope="module")
def alone(folders):
    """``(arch, prompt, params) -> outputs`` of the request run by itself on a roomy engine."""
    engines, cache = {}, {}

    def run(arch: str, prompt: tuple[int, ...], params: SamplingParams):
        key = (arch, prompt, repr(params))
        if key not in cache:
            if arch not in engines:
                engines[arch] = LLMEngine(EngineArgs(model=folders[arch], dtype="float32", device="cpu",
                                                     num_blocks=256, block_size=16, max_model_len=MAX_MODEL_LEN,
                                                     enable_prefix_caching=False))
            engine = engines[arch]
            engine.add_request(list(prompt), params)
            outs = [o for _ in range(STEP_CAP) if engine.has_unfinished_requests() for o in engine.step()]
            assert not engine.has_unfinished_requests()
            cache[key] = _summary(outs[-1])
        return cache[key]

    return run


def _summary(out):
    return [(o.token_ids, o.finish_reason, o.text) for o in out.outputs]
