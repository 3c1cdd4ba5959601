"""Reasoning replies over HTTP on the real model (SmolLM2-135M-Instruct, float32), through the
openai client: ``--reasoning-parser`` splits the reply as the parser reads the offline text
(whole and streamed), and ``max_thinking_tokens`` gives what
:func:`kvserve.inference_time.generate_with_thinking_budget` gives offline.

SmolLM2 does not think on its own: a regex (structured output) makes it write the tags, and the
thinking budget needs none (deepseek_r1's reply starts in the thinking).
"""

from __future__ import annotations

import openai
import pytest
from server_helpers import ServerThread

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.engine.tokenizer import apply_chat_template
from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from kvserve.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
#: parser → a regex that makes the model write a thinking block the parser reads
REGEX = {"qwen3": r"<think>[A-Za-z ,.']{8,60}</think>[A-Za-z ,.!']{3,40}",
         "deepseek_r1": r"[A-Za-z ,.']{8,60}</think>[A-Za-z ,.!']{3,40}"}


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return LLMEngine(EngineArgs(dtype="float32", max_model_len=1024, kv_cache_memory=0.25))


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request, engine):
    with ServerThread(engine, names=["smollm2"], reasoning_parser=request.param) as s:
        yield request.param, openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)


def _stream(client, **kw) -> tuple[str, str, list, object]:
    reasoning, content, finish, usage = [], [], [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            content.append(d.content or "")
            assert not (getattr(d, "reasoning_content", None) and d.content)  # one side per chunk
            finish += [c.finish_reason] if c.finish_reason else []
    return "".join(reasoning), "".join(content), finish, usage


def test_thinking_forced_by_a_regex_is_split_whole_and_streamed(served, llm_fp32):
    name, client = served
    regex = REGEX[name]
    ref = llm_fp32.chat(ASK, SamplingParams(max_tokens=60, temperature=0,
                                            structured_outputs=StructuredOutputsParams(regex=regex)))
    want = REASONING_PARSERS[name].extract(ref.text)
    assert want.reasoning_content and want.content and "<think>" not in want.reasoning_content
    kw = dict(model="smollm2", messages=ASK, max_tokens=60, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (want.reasoning_content, want.content)
    assert r.choices[0].finish_reason == ref.finish_reason
    reasoning, content, finish, usage = _stream(client, **kw)
    assert (reasoning, content) == (want.reasoning_content, want.content)
    assert finish == [ref.finish_reason] and usage.completion_tokens == len(ref.token_ids)


def test_a_reply_without_tags(served, llm_fp32):
    """deepseek_r1: the template opened the thinking, so an untagged reply is all reasoning (as
    vLLM reads it); qwen3: no <think>, all content."""
    name, client = served
    ref = llm_fp32.chat(ASK, SamplingParams(max_tokens=12, temperature=0))
    m = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=12, temperature=0).choices[0].message
    reasoning, content, _, _ = _stream(client, model="smollm2", messages=ASK, max_tokens=12, temperature=0)
    if name == "deepseek_r1":
        assert (m.reasoning_content, m.content) == (ref.text, None) and (reasoning, content) == (ref.text, "")
    else:
        assert (m.reasoning_content, m.content) == (None, ref.text) and (reasoning, content) == ("", ref.text)


@pytest.mark.parametrize("budget,answer_tokens", [(5, 12), (3, 0)])
def test_thinking_budget_equals_generate_with_thinking_budget(served, llm_fp32, budget, answer_tokens):
    """The thinking stops at the budget, ``</think>`` is appended, and the answer follows: the
    same text and tokens as offline. ``max_tokens`` counts the whole reply (thinking, the
    appended delimiter, answer): with none left for the answer the reply ends at the thinking
    with finish_reason "length". (qwen3 reads thinking only after the model's own ``<think>``,
    which SmolLM2 never writes: there the whole reply, delimiter included, is content.)"""
    from kvserve.inference_time import generate_with_thinking_budget

    name, client = served
    prompt = apply_chat_template(llm_fp32.tokenizer, ASK)
    ref = generate_with_thinking_budget(llm_fp32, prompt, budget, SamplingParams(max_tokens=max(answer_tokens, 1),
                                                                                 temperature=0))
    assert ref.forced_end and ref.num_thinking_tokens == budget
    end_ids = llm_fp32.tokenizer.encode("</think>", add_special_tokens=False)
    total = budget + len(end_ids) + answer_tokens
    kw = dict(model="smollm2", messages=ASK, max_tokens=total, temperature=0, extra_body={"max_thinking_tokens": budget})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    answer = ref.answer.text if answer_tokens else None
    want = (ref.thinking_text, answer) if name == "deepseek_r1" else (None, ref.thinking_text + "</think>" + (answer or ""))
    assert (c.message.reasoning_content, c.message.content) == want
    assert r.usage.completion_tokens == budget + len(end_ids) + (len(ref.answer.token_ids) if answer_tokens else 0)
    assert r.usage.prompt_tokens == len(prompt)
    assert c.finish_reason == (ref.answer.finish_reason if answer_tokens else "length")
    reasoning, content, finish, usage = _stream(client, **kw)
    assert (reasoning, content) == (want[0] or "", want[1] or "")
    assert finish == [c.finish_reason] and usage.completion_tokens == r.usage.completion_tokens
