"""The server on the real model (SmolLM2-135M-Instruct, float32): greedy results over HTTP
equal the offline ``LLM.generate()`` / ``LLM.chat()`` results, alone and under 64 concurrent
streaming clients."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_helpers import ServerThread

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Germany?"},
]


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = LLMEngine(EngineArgs(dtype="float32", max_model_len=1024, kv_cache_memory=0.5))
    with ServerThread(engine, names=["smollm2"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def test_greedy_completions_equal_offline(client, llm_fp32):
    refs = llm_fp32.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    r = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=16, temperature=0)
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [o.text for o in refs]
    assert [c.finish_reason for c in got] == [o.finish_reason for o in refs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in refs)
    stream = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == refs[0].text


def test_greedy_chat_equal_offline(client, llm_fp32):
    ref = llm_fp32.chat(CONVERSATION, SamplingParams(max_tokens=24, temperature=0))
    r = client.chat.completions.create(model="smollm2", messages=CONVERSATION, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CONVERSATION, max_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_64_concurrent_streaming_clients_equal_offline(server, llm_fp32):
    prompts = [f"{PROMPTS[i % 4]} {'(%d) ' % i * (i % 5)}".strip() for i in range(64)]
    lengths = [3 + (i * 7) % 22 for i in range(64)]
    refs = llm_fp32.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model="smollm2", prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True)
        text, finish = "", None
        async for ch in stream:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert [t for t, _ in results] == [o.text for o in refs]
    assert [f for _, f in results] == [o.finish_reason for o in refs]
    server.wait_idle()
    assert server.engine_call(lambda e: e.kv.num_used_blocks if hasattr(e.kv, "num_used_blocks") else 0) == 0


def test_logprobs_on_real_text(client):
    r = client.chat.completions.create(model="smollm2", messages=CONVERSATION[:2], max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8")
    assert text.startswith(r.choices[0].message.content)  # the final EOS token adds only its own name
    for e in content:
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
    c = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert max(top, key=top.get) == tok


def test_seeds_and_n(client):
    kw = dict(model="smollm2", prompt=PROMPTS[2], max_tokens=12, temperature=0.9)
    a = client.completions.create(seed=42, n=2, **kw)
    b = client.completions.create(seed=42, n=2, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # each sample has its own seed
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_stop_string(client):
    full = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert "." in text
    r = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=["."])
    assert r.choices[0].text == text[: text.index(".")]
    assert r.choices[0].finish_reason == "stop"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in the capital of France?"}]


def test_auto_tool_choice_on_smollm2(client, llm_fp32):
    """SmolLM2's template ignores tools: under tool_choice auto they come in a Hermes-style system
    message, so the reply equals the offline chat with that message, read by the hermes parser
    (this model answers in prose: no calls). A reply forced into a <tool_call> block by a regex
    (the city is the model's choice) comes back as the same call whole and streamed."""
    from kvserve.entrypoints.openai.tool_parsers import HermesToolParser

    system = [{"role": "system", "content": HermesToolParser.system_prompt([WEATHER])}]
    ref = llm_fp32.chat(system + ASK, SamplingParams(max_tokens=24, temperature=0))
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    want = HermesToolParser([WEATHER]).extract(ref.text)
    assert r.choices[0].message.content == want.content
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []] == \
        [(c.name, c.arguments) for c in want.calls]
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}\n</tool_call>'
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    pieces, names = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for tc in chunk.choices[0].delta.tool_calls or []:
            names += [tc.function.name] if tc.function.name else []
            pieces.append(tc.function.arguments)
        assert not chunk.choices[0].delta.content
    assert names == ["get_weather"] and "".join(pieces) == '{"city": "Paris"}' and len(pieces) > 2
