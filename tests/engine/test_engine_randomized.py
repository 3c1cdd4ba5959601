"""Randomized workloads through the whole engine (hypothesis): tight pools that force
preemption, small token budgets that force chunking, few sequence slots, shared prefixes,
tenants, priorities, n > 1, beam search and aborts. Every request must finish exactly once
(no hang: a step cap), the KV manager's invariants must hold after every step, every block
must be free or evictable at the end, and each request's output must equal what it gives
alone on a roomy engine (float32; greedy, or seeded sampling, whose draws do not depend on
the batch). Also at tensor_parallel_size=2, on a few workloads."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from workload import MAX_MODEL_LEN, STEP_CAP, _summary, alone, folders, run_workload  # noqa: F401 (fixtures)

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    prefixes = [draw(st.lists(st.integers(3, 383), min_size=8, max_size=24)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        head = draw(st.sampled_from([[]] + prefixes + prefixes))
        prompt = head + draw(st.lists(st.integers(3, 383), min_size=1 if not head else 0, max_size=20))
        room = MAX_MODEL_LEN - len(prompt)
        max_tokens = draw(st.integers(1, min(12, room)))
        kind = draw(st.sampled_from(["greedy", "seeded", "samples", "beam"]))
        if kind == "greedy":
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=draw(st.booleans()))
        elif kind == "seeded":
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=draw(st.integers(0, 99)))
        elif kind == "samples":
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=draw(st.integers(0, 99)),
                                    n=draw(st.integers(2, 3)))
        else:
            params = SamplingParams(max_tokens=max_tokens, use_beam_search=True, beam_width=2, n=2,
                                    ignore_eos=True)
        requests.append(dict(prompt=tuple(prompt), params=params, priority=draw(st.integers(0, 1)),
                             salt=draw(st.sampled_from([None, "tenant-a"])),
                             arrive=draw(st.integers(0, 10)), abort=draw(st.sampled_from([None] * 5 + [1, 3]))))
    # the pool holds the largest request (beams side by side), and often little more
    need = max(-(-(len(r["prompt"]) + r["params"].max_tokens) // block_size)
               * (r["params"].beam_width if r["params"].use_beam_search else 1) for r in requests)
    return dict(
        arch=draw(st.sampled_from(["llama", "gemma3"])),
        block_size=block_size,
        num_blocks=need + draw(st.sampled_from([0, 1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([1, 3, 8, 64])),
        max_num_seqs=draw(st.sampled_from([2, 3, 16])),
        enable_prefix_caching=draw(st.booleans()),
        requests=requests,
    )


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads())
def test_every_request_finishes_once_with_its_solo_output(folders, alone, w):
    _check_workload(_engine(folders, w), w, alone)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads())
def test_tp2_every_request_finishes_once_with_its_solo_output(folders, alone, w):
    """The same at ``tensor_parallel_size=2`` (the ``mp`` executor), against the same solo
    outputs at one rank: fewer examples, each engine starts a rank process (~5 s)."""
    engine = _engine(folders, w, tensor_parallel_size=2)
    try:
        assert engine.executor.world_size == 2
        _check_workload(engine, w, alone)
    finally:
        engine.core.shutdown()


def _engine(model_folders, w, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model_folders[w["arch"]], dtype="float32", device="cpu",
                                num_blocks=w["num_blocks"], block_size=w["block_size"], max_model_len=MAX_MODEL_LEN,
                                max_num_batched_tokens=w["max_num_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                                enable_prefix_caching=w["enable_prefix_caching"], **kw))


def _check_workload(engine, w, solo) -> None:
    ids, final = run_workload(engine, w["requests"], STEP_CAP)
    for rid, out in final.items():
        if out == "aborted":
            continue
        r = ids[rid]
        assert out.error is None
        assert _summary(out) == solo(w["arch"], r["prompt"], r["params"]), rid
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # free, or evictable from the prefix cache
    assert not engine.groups
