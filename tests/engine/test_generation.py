"""Generation features on SmolLM2 (float32): logprobs against transformers, stop strings,
streaming, UTF-8 safety, seeds, n > 1."""

import itertools
import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.llm import GenerationError

pytestmark = pytest.mark.slow


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_generated_logprobs_match_reference(llm_fp32, reference):
    """The reference ran with EOS masked (min_new_tokens) and reports logprobs of that
    processed distribution; kvserve reports raw logprobs. Renormalizing kvserve's raw
    values without EOS must give the reference's within 1e-4."""
    case = reference["cases"][0]
    eos = 2
    others = [c["prompt_ids"] for c in reference["cases"][1:4]]
    params = [SamplingParams(max_tokens=4, min_tokens=4, temperature=0, logprobs=20)] + [
        SamplingParams(max_tokens=6, temperature=0)
    ] * len(others)
    out = llm_fp32.generate([case["prompt_ids"]] + others, params)[0]
    assert len(out.outputs[0].token_logprobs) == 4
    for step, (lp, ref_top) in enumerate(zip(out.outputs[0].token_logprobs, case["top5_logprobs_first4"])):
        assert lp.token_id == case["greedy_ids"][step] and lp.rank == 1
        p_eos = math.exp(dict(lp.top).get(eos, float("-inf")))
        renorm = [(t, v - math.log1p(-p_eos)) for t, v in lp.top if t != eos][:5]
        assert [t for t, _ in renorm] == [t for t, _ in ref_top]
        for (_, a), (_, b) in zip(renorm, ref_top):
            assert abs(a - b) < 1e-4


def test_logprobs_match_transformers_in_a_batch(llm_fp32, hf_smollm2):
    prompt = llm_fp32.engine.encode("The quick brown fox jumps over the lazy dog because")
    others = [llm_fp32.engine.encode("Once upon a time"), llm_fp32.engine.encode("1, 2, 3,")]
    p = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    outs = llm_fp32.generate([others[0], prompt, others[1]], [SamplingParams(max_tokens=5), p, SamplingParams(max_tokens=3)])
    out = outs[1]
    full = prompt + out.outputs[0].token_ids
    ref = _hf_logprobs(hf_smollm2, full)
    # prompt logprobs: position 0 has none, position i scores prompt[i] given prompt[:i]
    assert out.prompt_token_logprobs[0] is None and len(out.prompt_token_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        lp = out.prompt_token_logprobs[i]
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert lp.rank == 1 + int((ref[i - 1] > ref[i - 1, prompt[i]]).sum())
        top = torch.topk(ref[i - 1], 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
    # a one-token prompt has one entry too (None), as in vLLM
    one = llm_fp32.generate([prompt[:1]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert one.prompt_token_logprobs == [None]
    for j, lp in enumerate(out.outputs[0].token_logprobs):
        pos = len(prompt) + j - 1
        assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4
    assert math.isclose(out.outputs[0].cumulative_logprob, sum(l.logprob for l in out.outputs[0].token_logprobs),
                        abs_tol=1e-4)


def _stream(llm, prompt, params):
    deltas, last = [], None
    for out in llm.generate([prompt], params, stream=True):
        deltas.append(out.outputs[0].delta_text)
        last = out
    return deltas, last.outputs[0]


def test_stop_string_spanning_tokens(llm_fp32):
    # greedy continuation is " 6, 7, 8, 9, 10, ..." with " 7", ",", " 8" separate tokens
    out = llm_fp32.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=20, temperature=0, stop=["7, 8"]))[0]
    o = out.outputs[0]
    assert o.text == " 6, " and o.finish_reason == "stop" and o.stop_reason == "7, 8"
    out = llm_fp32.generate(["1, 2, 3, 4, 5,"], SamplingParams(
        max_tokens=20, temperature=0, stop=["7, 8"], include_stop_str_in_output=True))[0]
    assert out.outputs[0].text == " 6, 7, 8"


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm_fp32):
    # " ", "6", ",", " ", "7", ",", " ", "8": the eighth token completes "7, 8" and is max_tokens' last
    params = SamplingParams(max_tokens=8, temperature=0, stop=["7, 8"])
    o = llm_fp32.generate(["1, 2, 3, 4, 5,"], params)[0].outputs[0]
    assert len(o.token_ids) == 8
    assert (o.text, o.finish_reason, o.stop_reason) == (" 6, ", "stop", "7, 8")
    deltas, last = _stream(llm_fp32, "1, 2, 3, 4, 5,", params)
    assert ("".join(deltas), last.finish_reason, last.stop_reason) == (" 6, ", "stop", "7, 8")


def test_stop_string_inside_a_token(llm_fp32):
    # " Paris" is one token; "ari" is inside it
    assert llm_fp32.tokenizer.encode(" Paris") == [7042]
    o = llm_fp32.generate(["The capital of France is"], SamplingParams(max_tokens=10, temperature=0, stop=["ari"]))[0].outputs[0]
    assert o.text == " P" and o.stop_reason == "ari" and o.finish_reason == "stop"


def test_streamed_deltas_never_show_the_stop_string(llm_fp32):
    deltas, o = _stream(llm_fp32, "1, 2, 3, 4, 5,", SamplingParams(max_tokens=30, temperature=0, stop=[" 9,"]))
    assert "".join(deltas) == o.text == " 6, 7, 8,"
    assert not any("9" in d for d in deltas)


def test_min_tokens_delays_stop_string(llm_fp32):
    o = llm_fp32.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=40, min_tokens=20, temperature=0, stop=[","]))[0].outputs[0]
    assert len(o.token_ids) >= 20 and o.finish_reason == "stop"
    assert o.text == " 6, 7, 8, 9, 10, 11"  # the 20th token is "," and may stop it
    assert len(o.token_ids) == 20
    without = llm_fp32.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=40, temperature=0, stop=[","]))[0].outputs[0]
    assert without.text == " 6"


@pytest.mark.parametrize("prompt, max_tokens", [("你好，世界！我喜欢吃", 20), ("Emoji story: 🌍🚀🌍🚀🌍🚀", 18)])
def test_utf8_streaming(llm_fp32, prompt, max_tokens):
    deltas, o = _stream(llm_fp32, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert "".join(deltas) == o.text
    assert o.text == llm_fp32.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)
    assert any(ord(c) > 0x2000 for c in o.text)  # really produced CJK / emoji


def test_streaming_concatenation_equals_final_text(llm_fp32):
    deltas, o = _stream(llm_fp32, "Once upon a time, there was a little", SamplingParams(max_tokens=24, temperature=0))
    assert "".join(deltas) == o.text and len(o.token_ids) == 24
    assert o.text.startswith(" girl")  # the leading space of the first token survives


def test_seeded_request_independent_of_batch(llm_fp32):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    prompt = "Write a short poem about the sea:"
    alone = llm_fp32.generate([prompt], seeded)[0].token_ids
    others = [f"Story number {i}:" for i in range(8)]
    unseeded = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm_fp32.generate(others[:4] + [prompt] + others[4:], [unseeded] * 4 + [seeded] + [unseeded] * 4)
    assert batch[4].token_ids == alone
    rev = llm_fp32.generate(list(reversed(others)) + [prompt], [unseeded] * 8 + [seeded])
    assert rev[8].token_ids == alone


def test_n_samples_share_the_prompt(llm_fp32):
    prompt = llm_fp32.engine.encode("Here is a list of fruit names: apple, banana, cherry, grape, mango, and")
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7)
    before = llm_fp32.engine.num_prompt_tokens_computed
    out = llm_fp32.generate([prompt], params)[0]
    computed = llm_fp32.engine.num_prompt_tokens_computed - before
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    # the prompt is computed once; each other sample recomputes only the last prompt token
    assert computed == len(prompt) + 3
    again = llm_fp32.generate([prompt], params)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == samples


def test_best_of_returns_highest_cumulative_logprob(llm_fp32):
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3)
    out = llm_fp32.generate(["The weather today is"], params)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    all5 = llm_fp32.generate(["The weather today is"], SamplingParams(n=5, max_tokens=6, temperature=1.0, seed=3))[0]
    best = sorted((o.cumulative_logprob for o in all5.outputs), reverse=True)[:2]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx(best)


def test_streams_only_yield_their_own_requests_and_closing_one_aborts_it(llm_fp32):
    """A paused stream's requests keep their outputs for it while another call runs; a stream
    closed early (``break``) cancels its unfinished requests instead of leaking them into the
    next call."""
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = {p: llm_fp32.generate([p], sp)[0].outputs[0].text for p in ("Hello", "The capital of France is")}
    paused = llm_fp32.generate(["Hello"], sp, stream=True)
    first = next(paused)
    others = list(llm_fp32.generate(["The capital of France is"], sp, stream=True))
    assert {o.request_id for o in others} == {others[-1].request_id} != first.request_id
    assert others[-1].outputs[0].text == want["The capital of France is"]
    assert llm_fp32.generate(["The capital of France is"], sp)[0].outputs[0].text == want["The capital of France is"]
    rest = list(paused)
    assert {o.request_id for o in rest} == {first.request_id}
    assert rest[-1].finished and rest[-1].outputs[0].text == want["Hello"]
    assert first.outputs[0].delta_text + "".join(o.outputs[0].delta_text for o in rest) == want["Hello"]

    for _ in llm_fp32.generate(["Hello", "Hello"], sp, stream=True):
        break  # the generator is closed here: both requests are aborted
    assert not llm_fp32.engine.has_unfinished_requests()
    assert llm_fp32.generate(["Hello"], sp)[0].outputs[0].text == want["Hello"]


def test_streams_iterated_in_turn_each_get_their_deltas_in_order(llm_fp32):
    # Each stream's step outputs are all filed before one is yielded: a stream resumed after
    # the other one stepped used to file the rest of its old step's outputs for the other
    # stream behind newer ones (deltas out of order, the last ones never delivered).
    sp = SamplingParams(max_tokens=10, temperature=0)
    prompts = ["Once upon a time", "The capital of France is"]
    want = [o.outputs[0].text for o in llm_fp32.generate(prompts, sp)]
    a, b = (llm_fp32.generate([p], sp, stream=True) for p in prompts)
    got = [[], []]
    for ua, ub in itertools.zip_longest(a, b):
        for i, u in enumerate((ua, ub)):
            if u is not None:
                got[i].append(u)
    for i in range(2):
        assert "".join(u.outputs[0].delta_text for u in got[i]) == want[i] == got[i][-1].outputs[0].text
        assert got[i][-1].finished and not any(u.finished for u in got[i][:-1])
        assert [len(u.outputs[0].token_ids) for u in got[i]] == sorted(len(u.outputs[0].token_ids) for u in got[i])
    assert not llm_fp32._pending


@pytest.mark.parametrize("engine_kw", [dict(max_num_batched_tokens=1), dict(max_num_batched_tokens=4),
                                       dict(max_num_batched_tokens=4, num_blocks=4)])
def test_prompt_logprobs_do_not_depend_on_chunking(tiny_model_dir, engine_kw):
    # 1-token prefill chunks run on the decode path; they must score their prompt position too
    folder, _ = tiny_model_dir("llama")
    prompts = [[5, 17, 99, 3, 250, 8, 9], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    ref = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4,
              enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, enable_prefix_caching=False,
              **{"num_blocks": 64, **engine_kw})
    outs = llm.generate(prompts, params)
    if "num_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    for o, r, p in zip(outs, ref, prompts):
        assert o.prompt_token_logprobs[0] is None and len(o.prompt_token_logprobs) == len(p)
        assert [x.token_id for x in o.prompt_token_logprobs[1:]] == p[1:]
        for a, b in zip(o.prompt_token_logprobs[1:], r.prompt_token_logprobs[1:]):
            assert abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank
        assert o.token_ids == r.token_ids


def test_stream_n_gt_1_each_delta_and_finish_once(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=seed, stop_token_ids=[7, 9, 11, 13])
        final = llm.generate([[5, 17, 99]], params)[0]
        texts, finishes = {i: "" for i in range(3)}, {i: [] for i in range(3)}
        for up in llm.generate([[5, 17, 99]], params, stream=True):
            for o in up.outputs:
                texts[o.index] += o.delta_text
                if o.finish_reason is not None:
                    finishes[o.index].append(o.finish_reason)
        assert texts == {o.index: o.text for o in final.outputs}
        assert finishes == {o.index: [o.finish_reason] for o in final.outputs}
    # the best sequences of these are only known at the end
    for bad in (SamplingParams(max_tokens=4, n=1, best_of=3, seed=0),
                SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, temperature=0)):
        with pytest.raises(GenerationError, match="not supported with stream"):
            next(iter(llm.generate([[5, 17, 99]], bad, stream=True)))
    assert not llm.engine.has_unfinished_requests()


def test_stop_token_text_left_out_unless_asked(tiny_model_dir):
    # vLLM: the EOS / stop token that ends a sequence adds no text (its id stays in token_ids)
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    free = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    i = next(i for i in range(1, 6) if free.token_ids[i] not in free.token_ids[:i])  # a token new at step i
    stop = free.token_ids[i]
    dec = llm.engine.tokenizer.decode
    for keep in (False, True):
        out = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                         stop_token_ids=[stop], include_stop_str_in_output=keep))[0]
        assert out.token_ids == free.token_ids[: i + 1] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason == stop
        assert out.text == dec(out.token_ids if keep else out.token_ids[:i])
        streamed = "".join(u.outputs[0].delta_text for u in llm.generate(
            [[5, 17, 99]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                                         include_stop_str_in_output=keep), stream=True))
        assert streamed == out.text


def test_bad_words_as_strings_like_vllm(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    tok = llm.engine.tokenizer
    free = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    word = tok.decode(free.token_ids[1:2]).strip()  # a word the model says when free
    assert word
    as_text = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                         bad_words=[word]))[0]
    ids = [list(tok.encode(v, add_special_tokens=False)) for v in (word, " " + word)]
    as_ids = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                        bad_words=ids))[0]
    assert as_text.token_ids == as_ids.token_ids != free.token_ids
    for w in ids:  # no banned sequence is ever completed
        assert not any(as_text.token_ids[i:i + len(w)] == w for i in range(len(as_text.token_ids)))
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings or non-empty token id"):
        SamplingParams(bad_words=[""])
