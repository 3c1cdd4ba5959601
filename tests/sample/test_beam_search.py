"""Beam search returns transformers' best sequence; beams share KV blocks copy-on-write."""

import pytest
import torch

from kvserve import LLM, SamplingParams
import math

from kvserve.sample.beam_search import BeamSearchState, length_normalized_score


def _hf_beam(hf, ids, width, max_new, eos):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=1, length_penalty=1.0,
                          early_stopping=True, max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_state_finishes_on_eos_and_scores_by_length():
    st = BeamSearchState(beam_width=2, max_tokens=10, length_penalty=1.0, eos_token_ids=(0,))
    # one beam; candidates: EOS (rank 1) and tokens 5, 6, 7
    live = st.step([[]], [0.0], [[0, 5, 6, 7]], [[-0.1, -0.5, -1.0, -3.0]])
    assert [(c.parent, c.token) for c in live] == [(0, 5), (0, 6)]
    assert st.finished[0].token_ids == (0,) and st.finished[0].score == pytest.approx(-0.1)
    # beam 0 (=5) proposes EOS at -0.2: cum -0.7 over 2 tokens = -0.35 ranks first of 4 candidates
    live = st.step([[5], [6]], [-0.5, -1.0], [[0, 9, 8, 7], [0, 9, 8, 7]], [[-0.2, -2, -3, -4]] * 2)
    assert st.done and live == []
    assert [h.token_ids for h in st.best(2)] == [(0,), (5, 0)]


def test_length_normalized_score_outside_the_float_range():
    assert length_normalized_score(-3.0, 4, 0.5) == -1.5
    assert length_normalized_score(-3.0, 1, 1e308) == -3.0  # 1 ** anything
    assert length_normalized_score(-3.0, 2, 1e308) == 0.0  # 2 ** 1e308 overflows: -3 / inf
    assert length_normalized_score(-3.0, 2, -1e308) == -math.inf  # 2 ** -1e308 underflows to 0
    assert length_normalized_score(0.0, 2, -1e308) == 0.0


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 2000.0])
def test_extreme_length_penalty_runs_beside_other_requests(tiny_model_dir, length_penalty):
    # the score used to raise OverflowError / ZeroDivisionError inside engine.step(), which
    # failed every request in flight
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    beam = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=6, temperature=0,
                          length_penalty=length_penalty)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 17, 99], [40, 41, 42]], [beam, plain])
    assert 1 <= len(outs[0].outputs[0].token_ids) <= 6 and len(outs[1].token_ids) == 6
    assert llm.engine.kv.num_used_blocks == 0


def test_tiny_model_matches_transformers_and_frees_blocks(tiny_model_dir):
    folder, hf = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    for prompt in ([5, 17, 99, 3, 250], [40, 41, 42, 43, 44, 45, 46]):
        out = llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=3, max_tokens=10, temperature=0))[0]
        assert out.outputs[0].token_ids == _hf_beam(hf, prompt, 3, 10, eos=2)
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [
    "The capital of France is",
    "Once upon a time, there was a little",
    "The best way to learn a new language is",
])
def test_smollm2_beam4_matches_transformers(llm_fp32, hf_smollm2, prompt):
    ids = llm_fp32.engine.encode(prompt)
    out = llm_fp32.generate([ids], SamplingParams(use_beam_search=True, beam_width=4, max_tokens=24, length_penalty=1.0, temperature=0))[0]
    assert out.outputs[0].token_ids == _hf_beam(hf_smollm2, ids, 4, 24, eos=2)
    assert llm_fp32.engine.kv.num_used_blocks == 0
