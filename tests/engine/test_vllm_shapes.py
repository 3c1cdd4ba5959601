"""The offline outputs in vLLM's shapes: ``CompletionOutput.logprobs`` is one ``{token_id: Logprob}``
dict per generated token (the sampled token and the top ``k``), ``RequestOutput.prompt_logprobs``
the same per prompt token with ``None`` first; vLLM's documented offline example with
``logprobs=1, prompt_logprobs=1`` runs with only its import lines changed; and the dicts agree
with the ``TokenLogprob`` lists (``token_logprobs``) on every path that fills them: plain
sampling, n > 1, best_of, stop strings, speculative decoding, streaming."""

from __future__ import annotations

import math
import runpy
import sys

import pytest

from kvserve import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from kvserve.engine.llm_engine import LLMEngine

ARGS = dict(dtype="float32", num_blocks=256, block_size=4, max_model_len=256)

# vLLM's examples/offline_inference/llm_engine_example.py (vllm-project/vllm, Apache-2.0; the version
# whose FlexibleArgumentParser comes from vllm.utils.argparse_utils), verbatim but for the two
# import lines ("from vllm import ..." and the FlexibleArgumentParser import).
LLM_ENGINE_EXAMPLE = '''
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
This file demonstrates using the `LLMEngine`
for processing prompts with various sampling parameters.
"""

import argparse

from kvserve import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from argparse import ArgumentParser as FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    """Create a list of test prompts with their sampling parameters."""
    return [
        (
            "A robot may not injure a human being",
            SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
        ),
        (
            "To be or not to be,",
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2),
        ),
        (
            "What is the meaning of life?",
            SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1),
        ),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
    """Continuously process a list of prompts and handle the outputs."""
    request_id = 0

    print("-" * 50)
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1

        request_outputs: list[RequestOutput] = engine.step()

        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                print("-" * 50)


def initialize_engine(args: argparse.Namespace) -> LLMEngine:
    """Initialize the LLMEngine from the command line arguments."""
    engine_args = EngineArgs.from_cli_args(args)
    return LLMEngine.from_engine_args(engine_args)


def parse_args():
    parser = FlexibleArgumentParser(
        description="Demo on using the LLMEngine class directly"
    )
    parser = EngineArgs.add_cli_args(parser)
    return parser.parse_args()


def main(args: argparse.Namespace):
    """Main function that sets up and runs the prompt processing."""
    engine = initialize_engine(args)
    test_prompts = create_test_prompts()
    process_requests(engine, test_prompts)


if __name__ == "__main__":
    args = parse_args()
    main(args)
'''


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(model=folder, **ARGS)


def _check_position(d: dict, entry, k: int, token_str) -> None:
    """One position's dict against its TokenLogprob: the token first at its own rank, then the
    top k at ranks 1..k (k or k + 1 entries), values and decoded tokens."""
    assert isinstance(d, dict) and all(isinstance(v, Logprob) for v in d.values())
    assert next(iter(d)) == entry.token_id  # (the sampled/prompt token first, as vLLM builds it)
    top_ids = [t for t, _ in entry.top]
    assert len(d) == (k if entry.token_id in top_ids else k + 1) and len(entry.top) == k
    for rank, (t, lp) in enumerate(entry.top, start=1):
        assert d[t] == Logprob(lp, rank, token_str(t))
    if entry.token_id not in top_ids:
        assert d[entry.token_id] == Logprob(entry.logprob, entry.rank, token_str(entry.token_id))
        assert entry.rank > k
    assert d[entry.token_id].logprob == entry.logprob
    assert all(d[t].logprob >= d[u].logprob for t, u in zip(top_ids, top_ids[1:]))  # most likely first


def _check_output(o: CompletionOutput, k: int, tokenizer) -> None:
    assert len(o.logprobs) == len(o.token_logprobs) == len(o.token_ids)
    assert [e.token_id for e in o.token_logprobs] == o.token_ids
    for d, e in zip(o.logprobs, o.token_logprobs):
        _check_position(d, e, k, lambda t: tokenizer.decode([t]))
    assert math.isclose(o.cumulative_logprob, sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)),
                        abs_tol=1e-4)


def test_vllm_llm_engine_example_runs_unchanged(folder, monkeypatch, capsys, tmp_path):
    """vLLM's documented offline example with logprobs=1 and prompt_logprobs=1 (above), run as a
    script with our engine options; what it printed is checked on the outputs it printed."""
    script = tmp_path / "llm_engine_example.py"
    script.write_text(LLM_ENGINE_EXAMPLE)
    seen: list[RequestOutput] = []
    step = LLMEngine.step

    def recording_step(self):
        outs = step(self)
        seen.extend(o for o in outs if o.finished)
        return outs

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    monkeypatch.setattr(sys, "argv", [str(script), "--model", folder, "--dtype", "float32", "--kv-cache-memory",
                                      "0.01", "--max-model-len", "256", "--block-size", "4", "--device", "cpu"])
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    by_id = {o.request_id: o for o in seen}
    assert sorted(by_id) == ["0", "1", "2"]
    assert printed.count("RequestOutput(") == 3 and printed.count("-" * 50) == 4
    robot, hamlet, life = by_id["0"], by_id["1"], by_id["2"]
    tokenizer = _tokenizer(folder)
    assert robot.prompt == "A robot may not injure a human being" and len(robot.outputs) == 1
    o = robot.outputs[0]
    assert o.finished() and o.token_ids and len(o.logprobs) == len(o.token_ids)
    for d, tid in zip(o.logprobs, o.token_ids):  # greedy, logprobs=1: the sampled token is the top one
        assert list(d) == [tid] and d[tid].rank == 1 and d[tid].decoded_token == tokenizer.decode([tid])
    _check_output(o, 1, tokenizer)
    plp = robot.prompt_logprobs
    assert plp[0] is None and len(plp) == len(robot.prompt_token_ids)
    for d, tid, e in zip(plp[1:], robot.prompt_token_ids[1:], robot.prompt_token_logprobs[1:]):
        assert e.token_id == tid
        _check_position(d, e, 1, lambda t: tokenizer.decode([t]))
    assert f"prompt_logprobs=[None, {{{robot.prompt_token_ids[1]}: Logprob(logprob=" in printed
    for out in (hamlet, life):  # not asked: None, as in vLLM
        assert out.prompt_logprobs is None and all(c.logprobs is None for c in out.outputs)
    assert len(life.outputs) == 2 and all(c.finished() for c in life.outputs)


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_the_example_prompt_through_llm_generate(llm, folder):
    """The example's first request through ``LLM.generate`` (vLLM's offline entry point), with
    more alternatives: the sampled token plus the top k per position, prompt positions after a
    leading None, the same numbers as the TokenLogprob lists."""
    tokenizer = llm.engine.tokenizer
    out = llm.generate(["A robot may not injure a human being"],
                       SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=3, max_tokens=12))[0]
    _check_output(out.outputs[0], 5, tokenizer)
    assert all(next(iter(d.values())).rank == 1 for d in out.outputs[0].logprobs)  # (greedy)
    assert out.prompt_logprobs[0] is None and out.prompt_token_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) == len(out.prompt_token_logprobs)
    for d, e in zip(out.prompt_logprobs[1:], out.prompt_token_logprobs[1:]):
        _check_position(d, e, 3, lambda t: tokenizer.decode([t]))
    # a prompt position whose token is not among the top 3 has 4 entries, the token at its rank
    assert any(len(d) == 4 for d in out.prompt_logprobs[1:])
    # outputs[0].logprobs[0][token_id] (the example: a TypeError before)
    first = out.outputs[0].token_ids[0]
    assert out.outputs[0].logprobs[0][first].logprob == pytest.approx(out.outputs[0].token_logprobs[0].logprob)


@pytest.mark.parametrize("k", [0, 2])
def test_sampled_tokens_outside_the_top_k_come_with_their_rank(llm, k):
    """Sampling at temperature 2 from a random model draws tokens far down the ranking: those
    positions have k + 1 entries, the sampled token's rank > k; greedy ones have k (logprobs=0:
    only the sampled token)."""
    tokenizer = llm.engine.tokenizer
    sampled, greedy = llm.generate(["Once upon a time"] * 2, [
        SamplingParams(temperature=2.0, seed=1, max_tokens=24, logprobs=k, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, logprobs=k, ignore_eos=True)])
    for out in (sampled, greedy):
        _check_output(out.outputs[0], k, tokenizer)
        assert out.prompt_logprobs is None and out.prompt_token_logprobs is None
    assert {len(d) for d in greedy.outputs[0].logprobs} == {max(k, 1)}
    outside = [d for d, e in zip(sampled.outputs[0].logprobs, sampled.outputs[0].token_logprobs) if e.rank > k]
    assert len(outside) > 12 and all(len(d) == k + 1 for d in outside)


def test_n_best_of_and_stop_strings_fill_the_kept_tokens(llm):
    tokenizer = llm.engine.tokenizer
    n2 = llm.generate(["Paris is"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, logprobs=2))[0]
    best = llm.generate(["Paris is"], SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=10,
                                                     logprobs=2))[0]
    for out in (n2, best):
        assert len(out.outputs) == 2
        for o in out.outputs:
            _check_output(o, 2, tokenizer)
    scores = [o.cumulative_logprob for o in best.outputs]
    assert scores == sorted(scores, reverse=True)
    # a stop string that ends the text mid-run: the logprobs are those of the kept tokens
    free = llm.generate(["1, 2, 3,"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop = free.text[3:5]
    cut = llm.generate(["1, 2, 3,"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                    logprobs=1))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and len(cut.token_ids) < len(free.token_ids)
    _check_output(cut, 1, tokenizer)


def test_streamed_outputs_carry_the_logprobs_so_far(llm):
    tokenizer = llm.engine.tokenizer
    last = None
    for update in llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8, logprobs=1,
                                                                    ignore_eos=True), stream=True):
        o = update.outputs[0]
        assert len(o.logprobs) == len(o.token_logprobs) == len(o.token_ids)
        last = update
    assert last.finished and len(last.outputs[0].logprobs) == 8
    _check_output(last.outputs[0], 1, tokenizer)


def test_speculative_decoding_fills_the_same_logprobs(folder, llm):
    """ngram drafts verified several tokens a step: the same tokens and dicts as one token a step."""
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    base = llm.generate([prompt], params)[0].outputs[0]
    spec = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **ARGS)
    got = spec.generate([prompt], params)[0].outputs[0]
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert got.token_ids == base.token_ids
    _check_output(got, 3, spec.engine.tokenizer)
    for a, b in zip(got.logprobs, base.logprobs):
        assert list(a) == list(b) and [v.rank for v in a.values()] == [v.rank for v in b.values()]
        assert [v.logprob for v in a.values()] == pytest.approx([v.logprob for v in b.values()], abs=1e-4)


def test_beam_search_has_scores_and_no_logprobs(llm):
    out = llm.generate(["Paris is"], SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=5,
                                                    temperature=0))[0]
    assert len(out.outputs) == 2 and all(o.logprobs is None and o.token_logprobs is None for o in out.outputs)
    assert all(o.cumulative_logprob < 0 for o in out.outputs)


def test_the_names_are_exported_and_the_repr_reads_like_vllms():
    import kvserve

    assert kvserve.Logprob is Logprob and kvserve.CompletionOutput is CompletionOutput
    assert {"Logprob", "CompletionOutput", "RequestOutput"} <= set(kvserve.__all__)
    assert repr(Logprob(-0.5, 1, " Paris")) == "Logprob(logprob=-0.5, rank=1, decoded_token=' Paris')"
    assert Logprob(-1.0) == Logprob(logprob=-1.0, rank=None, decoded_token=None)
