"""Fair share between users, end to end on a tiny model: a user's n=16 request holding every
sequence slot does not make another user's request wait for it; with one user it would."""

import pytest

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def _steps_until_done(engine, rid) -> int:
    for step in range(1, 1000):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return step
    raise AssertionError("never finished")


@pytest.mark.parametrize("other_user", ["b", "a"])
def test_a_burst_of_one_user_does_not_starve_another(folder, other_user):
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", max_num_seqs=16, num_blocks=512,
                                  block_size=4, max_model_len=256))
    burst = engine.add_request([5, 6, 7], SamplingParams(n=16, max_tokens=200, ignore_eos=True, temperature=1.0,
                                                         seed=0), user="a")
    for _ in range(3):  # the burst takes all 16 slots
        engine.step()
    assert engine.core.stats()["num_running"] == 16
    small = engine.add_request([9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), user=other_user)
    steps = _steps_until_done(engine, small)
    if other_user == "b":
        assert steps <= 10, steps  # a slot at once: its prefill and 7 more tokens
        assert engine.core.stats()["num_fair_preemptions"] == 1
    else:  # the same user: FCFS, it waits for the burst's samples
        assert steps >= 190, steps
        assert engine.core.stats()["num_fair_preemptions"] == 0
    while engine.has_unfinished_requests():  # the burst still finishes, every sample in full
        for out in engine.step():
            if out.request_id == burst and out.finished:
                assert [len(o.token_ids) for o in out.outputs] == [200] * 16
    engine.shutdown()


def _running_per_user(engine) -> dict:
    counts: dict = {}
    for r in engine.core.scheduler.running:
        counts[r.user] = counts.get(r.user, 0) + 1
    return counts


def test_max_num_seqs_per_user_caps_a_burst(folder):
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", max_num_seqs=16, num_blocks=512,
                                  block_size=4, max_model_len=256, max_num_seqs_per_user=4))
    burst = engine.add_request([5, 6, 7], SamplingParams(n=12, max_tokens=30, ignore_eos=True, temperature=1.0,
                                                         seed=0), user="a")
    burst2 = engine.add_request([8, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0), user="a")
    for _ in range(4):  # alone too, user a runs at most 4 sequences (the prompt, then samples)
        engine.step()
        assert _running_per_user(engine)["a"] <= 4
    assert _running_per_user(engine) == {"a": 4}
    small = engine.add_request([9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), user="b")
    done = {}
    for step in range(1, 1000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (step, out)
        if len(done) == 3:
            break
        assert _running_per_user(engine).get("a", 0) <= 4, (step, _running_per_user(engine))
        if small not in done:
            assert _running_per_user(engine).get("b") == 1, step
    assert done[small][0] == 8  # its prefill and 7 more tokens: one per step
    assert [len(o.token_ids) for o in done[burst][1].outputs] == [30] * 12  # every sample in full
    assert len(done[burst2][1].outputs[0].token_ids) == 10
    assert engine.core.stats()["num_preemptions"] == 0
    with pytest.raises(ValueError, match="beam_width=5 exceeds max_num_seqs_per_user=4"):
        engine.add_request([5, 6], SamplingParams(n=5, use_beam_search=True, max_tokens=4))
    engine.shutdown()


@pytest.mark.parametrize("value", [0, 17, 2.5])
def test_max_num_seqs_per_user_range(value):
    with pytest.raises(ValueError, match=r"max_num_seqs_per_user must be .*\[1, max_num_seqs=16\]|"
                                         r"max_num_seqs_per_user must be an integer"):
        EngineArgs(max_num_seqs=16, max_num_seqs_per_user=value).check()
