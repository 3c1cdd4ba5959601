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
