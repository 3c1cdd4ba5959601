"""Inference-time compute (kvserve.inference_time): best-of-N with verifiers, self-consistency,
thinking budgets. Tiny random Llama in float32; one SmolLM2 judge test."""

import dataclasses
import math
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.inference_time import (
    LLMJudge,
    MeanLogprobVerifier,
    best_of_n,
    generate_with_thinking_budget,
    last_number,
    self_consistency,
)

PROMPTS = ["Once upon a time", "Paris is the capital of"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    folder, hf = tiny_model_dir("llama")
    return LLM(model=str(folder), dtype="float32", num_blocks=256, block_size=4, max_model_len=256), hf


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


# ------------------------------------------------------------------------------ best-of-N
def test_best_of_n_returns_the_samples_and_the_verifiers_choice(tiny):
    llm, _ = tiny
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    calls = []

    def verifier(prompt, completion):
        calls.append((prompt, completion))
        return completion.count("e") - 0.01 * len(completion)

    res = best_of_n(llm, PROMPTS, 5, verifier, sp)
    direct = llm.generate(PROMPTS, dataclasses.replace(sp, n=5))
    assert len(res) == 2 and len(calls) == 10
    for r, d, p in zip(res, direct, PROMPTS):
        assert [c.token_ids for c in r.candidates] == [o.token_ids for o in d.outputs]
        assert len({tuple(c.token_ids) for c in r.candidates}) > 1  # they really are different samples
        scores = [verifier(p, c.text) for c in r.candidates]
        assert [c.score for c in r.candidates] == pytest.approx(scores)
        assert r.best is r.candidates[scores.index(max(scores))]
        assert r.text == r.best.text
    one = best_of_n(llm, PROMPTS[0], 5, verifier, sp)  # one prompt: one result
    assert [c.token_ids for c in one.candidates] == [c.token_ids for c in res[0].candidates]
    calls.clear()
    best_of_n(llm, [llm.engine.encode(PROMPTS[0])], 2, verifier, sp, verifier_prompts=["the question"])
    assert [p for p, _ in calls] == ["the question"] * 2
    with pytest.raises(ValueError, match="verifier_prompts must be 2 string"):
        best_of_n(llm, PROMPTS, 2, verifier, sp, verifier_prompts=["only one"])


def test_mean_logprob_verifier_scores_with_the_models_logprobs(tiny):
    llm, hf = tiny
    prompt = llm.engine.encode(PROMPTS[1])
    res = best_of_n(llm, [prompt], 4, MeanLogprobVerifier(), SamplingParams(max_tokens=6, seed=3))[0]
    for c in res.candidates:
        lp = _hf_logprobs(hf, prompt + c.token_ids)
        want = sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(c.token_ids)) / len(c.token_ids)
        assert c.score == pytest.approx(want, abs=1e-4)
    assert res.best.score == max(c.score for c in res.candidates)


def test_llm_judge_scores_p_yes_over_yes_and_no(tiny):
    llm, hf = tiny
    judge = LLMJudge(llm, template=lambda p, c: f"Q: {p} A: {c} Correct?", yes=" yes", no=" no")
    res = best_of_n(llm, PROMPTS[0], 3, judge, SamplingParams(max_tokens=5, seed=5))
    for c in res.candidates:
        head = judge.judge_prompt_ids(PROMPTS[0], c.text)
        lp = {}
        for name, ids in (("yes", judge.yes_ids), ("no", judge.no_ids)):
            full = _hf_logprobs(hf, head + ids)
            lp[name] = sum(full[len(head) - 1 + i, t].item() for i, t in enumerate(ids))
        want = lp["yes"] - math.log(math.exp(lp["yes"]) + math.exp(lp["no"]))
        assert c.score == pytest.approx(want, abs=1e-4)
        assert c.score < 0
    with pytest.raises(ValueError, match="yes and no"):
        LLMJudge(llm, yes="")
    with pytest.raises(ValueError, match="same tokens"):
        LLMJudge(llm, yes=" yes", no=" yes")


# ----------------------------------------------------------------------- self-consistency
def test_last_number():
    assert last_number("first 3 then 1,200.50 and finally -7.") == "-7"
    assert last_number("it costs 1,200.50") == "1200.50"
    assert last_number("no digits here") is None


def test_self_consistency_counts_and_weights_votes(tiny):
    llm, _ = tiny
    sp = SamplingParams(max_tokens=4, temperature=1.5, seed=2)

    def extract(text):  # the first character as the "answer"; an empty completion gives none
        return text.strip()[:1] or None

    res = self_consistency(llm, PROMPTS, 12, extract, sp)
    direct = llm.generate(PROMPTS, dataclasses.replace(sp, n=12))
    for r, d in zip(res, direct):
        answers = [extract(o.text) for o in d.outputs]
        assert [c.answer for c in r.candidates] == answers
        counts = Counter(a for a in answers if a is not None)
        assert r.votes == {a: float(v) for a, v in counts.items()}
        top = max(counts.values())
        assert r.answer == next(a for a in counts if counts[a] == top)  # ties: first seen
        assert r.agreement == pytest.approx(top / sum(counts.values()))
    weighted = self_consistency(llm, PROMPTS[0], 12, extract, sp, weighting="probability")
    want: dict = {}
    for o in direct[0].outputs:
        a = extract(o.text)
        if a is not None:
            want[a] = want.get(a, 0.0) + math.exp(o.cumulative_logprob / len(o.token_ids))
    assert weighted.votes == pytest.approx(want)
    assert weighted.answer == max(want, key=want.get)


def test_self_consistency_without_answers(tiny):
    llm, _ = tiny
    r = self_consistency(llm, PROMPTS[0], 3, lambda t: None, SamplingParams(max_tokens=2, seed=1))
    assert r.answer is None and r.votes == {} and r.agreement == 0.0


# ------------------------------------------------------------------------ thinking budget
def test_thinking_budget_forces_the_delimiter(tiny):
    llm, _ = tiny
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = llm.engine.encode(PROMPTS[0])
    end = "QZQZ"  # never written by this model (checked below): the budget must end the thinking
    out = generate_with_thinking_budget(llm, prompt, 5, greedy, think_end=end)
    plain = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert end not in plain.text
    assert out.forced_end and out.num_waits == 0 and out.num_thinking_tokens == 5
    assert out.thinking_token_ids == plain.token_ids
    end_ids = llm.tokenizer.encode(end, add_special_tokens=False)
    answer = llm.generate([prompt + plain.token_ids + end_ids], greedy)[0]
    assert out.answer.token_ids == answer.token_ids and out.text == answer.text


def _single_token_texts(llm, ids):
    """Token texts that no earlier token's text contains (a stop string there stops at that token)."""
    out = []
    for i, t in enumerate(ids):
        s = llm.tokenizer.decode([t])
        before = llm.tokenizer.decode(ids[:i])
        if s.strip() and s not in before and len(llm.tokenizer.encode(s, add_special_tokens=False)) == 1:
            out.append((i, s, t))
    return out


def test_thinking_budget_replaces_an_early_delimiter_with_wait(tiny):
    llm, _ = tiny
    prompt = llm.engine.encode(PROMPTS[1])
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    i, end, end_id = _single_token_texts(llm, plain.token_ids)[1]  # the model writes it as token i
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    # without a minimum the model's own delimiter ends the thinking after i + 1 tokens
    out = generate_with_thinking_budget(llm, prompt, 20, greedy, think_end=end)
    assert not out.forced_end and out.num_waits == 0 and out.num_thinking_tokens == i + 1
    assert out.thinking_token_ids == plain.token_ids[: i + 1]
    assert out.answer.token_ids == llm.generate([prompt + plain.token_ids[: i + 1]], greedy)[0].token_ids

    # with a minimum beyond it, "Wait" replaces the delimiter and the model thinks on
    wait_ids = llm.tokenizer.encode("Wait", add_special_tokens=False)
    out = generate_with_thinking_budget(llm, prompt, 20, greedy, think_end=end, min_thinking_tokens=i + 2,
                                        max_waits=1)
    assert out.num_waits == 1
    head = plain.token_ids[:i] + wait_ids
    assert out.thinking_token_ids[: len(head)] == head
    cont = llm.generate([prompt + head], SamplingParams(max_tokens=20 - (i + 1), temperature=0, ignore_eos=True,
                                                        stop=[end], include_stop_str_in_output=True))[0]
    assert out.thinking_token_ids == head + cont.token_ids
    assert out.num_thinking_tokens == i + 1 + len(cont.token_ids) <= 20
    assert out.forced_end == (cont.finish_reason == "length")


# ------------------------------------------------------------------------------ bad input
class NanVerifier:
    def score(self, prompts, completions):
        return [math.nan] * len(completions)


def test_bad_arguments_name_the_field(tiny):
    llm, _ = tiny
    sp = SamplingParams(max_tokens=2)
    for n in (0, 129, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer in \\[1, 128\\]"):
            best_of_n(llm, "a", n, lambda p, c: 0.0, sp)
    with pytest.raises(ValueError, match="sampling_params.temperature"):
        self_consistency(llm, "a", 4, sampling_params=SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="sampling_params.use_beam_search"):
        best_of_n(llm, "a", 2, lambda p, c: 0.0, SamplingParams(use_beam_search=True, beam_width=2, temperature=0))
    with pytest.raises(TypeError, match="verifier must have a score"):
        best_of_n(llm, "a", 2, 42, sp)
    with pytest.raises(TypeError, match="verifier: the function returned str"):
        best_of_n(llm, "a", 2, lambda p, c: "good", sp)
    with pytest.raises(ValueError, match="verifier: the function returned NaN"):
        best_of_n(llm, "a", 2, lambda p, c: float("nan"), sp)
    with pytest.raises(ValueError, match="verifier: a score is NaN"):
        best_of_n(llm, "a", 2, NanVerifier(), sp)
    with pytest.raises(TypeError, match="extract_answer returned int"):
        self_consistency(llm, "a", 2, lambda t: 3, sp)
    with pytest.raises(TypeError, match="extract_answer must be a function"):
        self_consistency(llm, "a", 2, "last", sp)
    with pytest.raises(ValueError, match="weighting must be"):
        self_consistency(llm, "a", 2, sampling_params=sp, weighting="loudest")
    with pytest.raises(TypeError, match="prompts must be"):
        best_of_n(llm, [], 2, lambda p, c: 0.0, sp)
    with pytest.raises(ValueError, match="max_tokens"):  # the engine's own error, per prompt
        best_of_n(llm, "a", 2, lambda p, c: 0.0, SamplingParams(max_tokens=10_000))
    for kwargs, field in (({"max_thinking_tokens": 0}, "max_thinking_tokens"),
                          ({"max_thinking_tokens": 10**9}, r"max_thinking_tokens must be an integer in \[1, 255\]"),
                          ({"min_thinking_tokens": 9}, "min_thinking_tokens"),
                          ({"max_waits": -1}, "max_waits"),
                          ({"think_end": ""}, "think_end"),
                          ({"wait": None}, "wait"),
                          ({"sampling_params": SamplingParams(n=2)}, "sampling_params")):
        args = {"max_thinking_tokens": 8, **kwargs}
        with pytest.raises(ValueError, match=field):
            generate_with_thinking_budget(llm, "a", **args)
    # nothing was left running in the engine by the refused calls
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_llm_judge_on_smollm2_prefers_the_right_answer(smollm2_path):
    llm = LLM(dtype="float32", max_model_len=512)
    judge = LLMJudge(llm)
    q = "What is the capital of France?"
    from kvserve.inference_time import Candidate

    right, wrong = (Candidate(t, [], "stop", 0.0) for t in ("The capital of France is Paris.",
                                                           "The capital of France is Berlin."))
    s_right, s_wrong = judge.score([q, q], [right, wrong])
    assert s_right > s_wrong
