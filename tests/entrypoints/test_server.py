"""The OpenAI-compatible server, driven by the official openai client, on a tiny random model.

Protocol shapes, streaming, errors, auth, queue limits, disconnects and metrics; the
greedy-equals-offline checks on the real model are in test_server_smollm2.py.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import CHAT_TEMPLATE, ServerThread, tiny_chat_engine

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine

PROMPT = "The quick brown fox"


def _engine(folder, **kw) -> LLMEngine:
    return tiny_chat_engine(folder, **{"num_blocks": 512, "max_model_len": 512, **kw})


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny", "tiny-alias"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", num_blocks=512, block_size=4, max_model_len=512)
    llm.engine.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


def _greedy(max_tokens=8, **kw):
    return dict(max_tokens=max_tokens, temperature=0, **kw)


def _metrics(server) -> dict:
    """name → value of every sample (labels folded in as name{k=v,...} for labelled ones)."""
    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            if "le" in s.labels:
                continue
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


# ------------------------------------------------------------------ basics
def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].owned_by == "kvserve"
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_completion_shape_and_greedy_equals_offline(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, **_greedy(8, extra_body={"ignore_eos": True}))
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and isinstance(r.created, int)
    assert r.model == "tiny"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_alias_and_token_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    a = client.completions.create(model="tiny-alias", prompt=ids, **_greedy(6))
    b = client.completions.create(model="tiny", prompt=PROMPT, **_greedy(6))
    assert a.model == "tiny" and a.choices[0].text == b.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Once upon a time"], n=2, **_greedy(6))
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] == b.choices[0].text
    single = client.completions.create(model="tiny", prompt="Once upon a time", **_greedy(6))
    assert by_index[2] == by_index[3] == single.choices[0].text


def test_completion_stream_matches_and_ends_with_done(server, client):
    full = client.completions.create(model="tiny", prompt=PROMPT, **_greedy(12))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **_greedy(12)))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    # include_usage: one more chunk with empty choices and the usage
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **_greedy(12)))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stream_events_stay_one_line_whatever_the_text(server):
    """U+0085, U+2028 and U+2029 are line breaks to ``str.splitlines`` and to httpx's
    ``iter_lines`` but not to JSON: the server escapes them, so each event stays one line (an
    echoed prompt puts them in the streamed text; raw, httpx cut the event in two)."""
    prompt = "The quick\u2028brown\x85fox\u2029jumps"
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events), events
    text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1])
    assert text.startswith(prompt), text


def test_chat_roles_multi_turn_and_stream(client, offline):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown"},
        {"role": "assistant", "content": "fox jumps"},
        {"role": "user", "content": [{"type": "text", "text": "Once upon "}, {"type": "text", "text": "a time"}]},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, **_greedy(8, extra_body={"ignore_eos": True}))
    flat = msgs[:3] + [{"role": "user", "content": "Once upon a time"}]
    ref = offline.chat(flat, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **_greedy(8, extra_body={"ignore_eos": True})))
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text
    assert stream[-2].choices[0].finish_reason == "length"
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == r.usage.total_tokens


def test_n2_and_seeds(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 20
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       n=2, max_tokens=6, temperature=1.0, seed=7, stream=True)
    texts = {0: "", 1: ""}
    roles = set()
    for ch in c:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_n2_stream_sends_each_delta_and_finish_once(client, seed):
    # choices of one request finish at different steps (stop strings): the stream must carry
    # exactly the non-streamed texts, and one finish_reason per choice
    kw = dict(model="tiny", max_tokens=12, temperature=1.0, n=3, seed=seed, stop=["e", "a"])
    for chat in (False, True):
        if chat:
            api, kw2 = client.chat.completions, dict(kw, messages=[{"role": "user", "content": "hi"}])
            text = lambda c: c.message.content  # noqa: E731
            delta = lambda c: c.delta.content or ""  # noqa: E731
        else:
            api, kw2 = client.completions, dict(kw, prompt=PROMPT)
            text = lambda c: c.text  # noqa: E731
            delta = lambda c: c.text  # noqa: E731
        ref = {c.index: (text(c), c.finish_reason) for c in api.create(**kw2).choices}
        texts, finishes = {i: "" for i in ref}, {i: [] for i in ref}
        for ch in api.create(stream=True, **kw2):
            for c in ch.choices:
                texts[c.index] += delta(c)
                if c.finish_reason is not None:
                    finishes[c.index].append(c.finish_reason)
        assert {i: (texts[i], finishes[i]) for i in ref} == {i: (t, [f]) for i, (t, f) in ref.items()}


def test_logprobs_shapes(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3, **_greedy(5))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert isinstance(e.token, str) and isinstance(e.bytes, list) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the chosen token is the top one
    assert all(0 <= b < 256 for e in content for b in e.bytes)
    c = client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, echo=True, **_greedy(4))
    lp = c.choices[0].logprobs
    n_prompt = c.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert c.choices[0].text.startswith(PROMPT)
    s = list(client.completions.create(model="tiny", prompt=PROMPT, logprobs=1, stream=True, **_greedy(4)))
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in s) == 4


def test_infinite_logprobs_are_json_safe():
    from kvserve.core.request import TokenLogprob
    from kvserve.entrypoints.openai.tokens import TokenTexts

    class Tok:
        def convert_ids_to_tokens(self, i):
            return "a"

        def decode(self, ids):
            return "a"

    texts = TokenTexts(Tok())
    entries = [TokenLogprob(1, -math.inf, 5, [(2, -math.inf), (3, float("nan"))])]
    body = {"chat": texts.chat_logprobs(entries, 2), "cmpl": texts.completion_logprobs(entries, [1], 2)}
    s = json.dumps(body, allow_nan=False)
    assert "-9999.0" in s


def test_stop_strings(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, **_greedy(16, extra_body={"ignore_eos": True}))
    text = full.choices[0].text
    i = next(i for i in range(2, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    stop = text[i:i + 2]
    r = client.completions.create(model="tiny", prompt=PROMPT, stop=[stop], **_greedy(16))
    cut = text[: text.find(stop)]
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    s = list(client.completions.create(model="tiny", prompt=PROMPT, stop=stop, stream=True, **_greedy(16)))
    assert "".join(c.choices[0].text for c in s) == cut and s[-1].choices[0].finish_reason == "stop"
    inc = client.completions.create(model="tiny", prompt=PROMPT, stop=[stop], **_greedy(16),
                                    extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == cut + stop


def test_vllm_parameters_accepted(client, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.entrypoints.openai"):
        r = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
            frequency_penalty=0.2, logit_bias={"5": -100}, user="u1", seed=3,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                        "stop_token_ids": [2], "ignore_eos": False, "skip_special_tokens": True,
                        "prompt_logprobs": 1, "cache_salt": "tenant-a", "priority": 1,
                        "bad_words": ["fox"], "allowed_token_ids": None, "some_future_field": 1},
        )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == r.usage.prompt_tokens
    assert "some_future_field" in caplog.text
    m = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0)
    assert m.usage.completion_tokens <= 3


def test_tokenize_detokenize(server, offline):
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == offline.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    d = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == offline.tokenizer.decode(r["tokens"])
    c = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert c["count"] > 3
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ------------------------------------------------------------------ errors
BAD_REQUESTS = [
    # (endpoint, raw body, status, param, words in the message)
    ("completions", b'{"prompt": "hi", "max_tokens": ', 400, None, "malformed JSON"),
    ("completions", b'[1, 2]', 400, None, "JSON object"),
    ("completions", b'{"prompt": "\\ud800 hi"}', 400, None, "lone one is not Unicode text"),
    ("completions", {"prompt": "a" * 10_000_000}, 400, "prompt", "10000000 characters"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    ("completions", {"prompt": "hi", "n": 1000}, 400, "n", "n must"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("completions", {"prompt": []}, 400, "prompt", "empty"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a" * 10_000_000}]}, 400, "messages",
     "characters"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "no content"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages", "no content"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ("chat/completions", {"messages": "hello"}, 400, "messages", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400, "logprobs", "bool"),
    # errors name the request's field, not the SamplingParams field it sets
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "top_logprobs must satisfy 0 ≤ top_logprobs ≤ 20, got 21"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "max_completion_tokens must satisfy 1 ≤ max_completion_tokens, got 0"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens", "max_tokens must satisfy 1 ≤ max_tokens, got 0"),
    # prompt + output beyond max_model_len (512): the field the request sent is named
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000_000}, 400,
     "max_completion_tokens", "max_completion_tokens (10000000)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000_000}, 400,
     "max_tokens", "max_tokens (10000000)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
     400, "response_format", "response_format.json_schema.schema: invalid JSON schema: Invalid type: nope"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a(("}}, 400, "structured_outputs",
     "structured_outputs.regex: invalid regex"),
    ("completions", {"prompt": "hi", "guided_regex": "[0-9]+"}, 400, "guided_regex", "not supported"),
    ("completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", "at least 1 character"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, 400, "cache_salt",
     "at least 1 character"),
]


@pytest.mark.parametrize("endpoint, body, status, param, words", BAD_REQUESTS)
def test_bad_input_gets_4xx_while_a_normal_request_completes(server, endpoint, body, status, param, words):
    result = {}

    def normal():
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True})
        result["events"] = [e for e in r.text.split("\n\n") if e]

    t = threading.Thread(target=normal)
    t.start()
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.base_url}/v1/{endpoint}", timeout=60, headers={"content-type": "application/json"}, **kw)
    t.join(60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert words.lower() in err["message"].lower()
    assert result["events"][-1] == "data: [DONE]"
    tokens = sum(1 for e in result["events"][:-1] if json.loads(e[6:])["choices"])
    assert tokens >= 1


USER = {"messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


_REJECTED = [
    ("tools", [TOOL], "tool calling on /v1/completions"),
    ("tool_choice", "auto", "tool calling on /v1/completions"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool calling on /v1/completions"),
    ("functions", [TOOL["function"]], "deprecated functions"),
    ("function_call", "auto", "deprecated functions"),
    ("guided_json", {"type": "object"}, "use 'structured_outputs'"),
    ("guided_regex", "[0-9]+", "use 'structured_outputs'"),
    ("guided_choice", ["yes", "no"], "use 'structured_outputs'"),
    ("guided_grammar", "root ::= \"a\"", "use 'structured_outputs'"),
    ("kv_transfer_params", {"do_remote_decode": True}, "kvserve serve --prefill-replicas P --decode-replicas D"),
]


# (chat takes tools and tool_choice: test_server_structured_output.py)
@pytest.mark.parametrize("cls, field, value, feature", [
    (cls, *case) for cls in ("ChatCompletionRequest", "CompletionRequest") for case in _REJECTED
    if not (cls == "ChatCompletionRequest" and case[0] in ("tools", "tool_choice"))])
def test_guided_fields_and_tools_are_rejected(cls, field, value, feature):
    from kvserve.entrypoints.openai import protocol

    body = {**(USER if cls == "ChatCompletionRequest" else {"prompt": "hi"}), field: value}
    with pytest.raises(protocol.APIError) as ei:
        protocol.parse_request(getattr(protocol, cls), json.dumps(body).encode())
    e = ei.value
    assert e.status == 400 and e.param == field and e.code == "unsupported_parameter"
    assert e.type == "invalid_request_error"
    assert feature in e.message and "not supported" in e.message and repr(field) in e.message
    assert set(e.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_fields_that_ask_for_nothing_are_accepted(caplog):
    from kvserve.entrypoints.openai import protocol

    body = {**USER, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": None,
            "guided_json": None, "structured_outputs": None, "kv_transfer_params": None, "some_future_field": 1}
    with caplog.at_level(logging.WARNING, logger="kvserve.entrypoints.openai"):
        req = protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode())
    assert req.response_format == {"type": "text"}
    assert "some_future_field" in caplog.text  # other unknown fields are still ignored with a warning
    req = protocol.parse_request(protocol.CompletionRequest, json.dumps({"prompt": "hi", "tool_choice": None,
                                                                         "response_format": None,
                                                                         "kv_transfer_params": {}}).encode())
    assert req.prompt == "hi"


def test_openai_client_gets_automatic_tool_choice_by_default(client):
    """tools without tool_choice: "auto" (the model may answer in text: this one does; the parsing
    of calls is tested in test_server_structured_output.py)."""
    r = client.chat.completions.create(model="tiny", messages=USER["messages"], tools=[TOOL], max_tokens=2,
                                       temperature=0)
    free = client.chat.completions.create(model="tiny", messages=USER["messages"], max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    # the template ignores tools, so they come in a system message: a longer prompt
    assert r.usage.prompt_tokens > free.usage.prompt_tokens + 50
    ok = client.chat.completions.create(model="tiny", messages=USER["messages"], max_tokens=2,
                                        response_format={"type": "text"}, tool_choice="none")
    assert ok.choices[0].message.content is not None


def test_prompt_beyond_context_window(client, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=4)
    msg = ei.value.body["message"]
    assert "600 tokens" in msg and "512" in msg and ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt=[5] * 500, max_tokens=100)
    assert "500 tokens" in ei.value.body["message"] and "512" in ei.value.body["message"]
    assert ei.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fox " * 700}])
    assert "512" in ei.value.body["message"] and "tokens" in ei.value.body["message"]


@pytest.mark.parametrize("prompt, words", [
    ([[1, 2], [99999999]], "99999999"),
    (["Hi", ""], "prompt is empty"),
    ([[5, 6], [5] * 600], "600 tokens"),
    ([[5, 6], [5] * 500], "500 tokens"),  # fits, but not with max_tokens
])
def test_batch_with_one_bad_prompt_runs_nothing(server, prompt, words):
    server.wait_idle()
    adds = []

    def spy(engine):
        def add_request(*args, **kwargs):
            adds.append(args)
            return type(engine).add_request(engine, *args, **kwargs)
        engine.add_request = add_request

    server.engine_call(spy)
    try:
        before = _metrics(server)
        stats_before = server.engine_call(lambda e: e.stats())
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and "prompt 1 of the batch" in r.json()["error"]["message"]
        time.sleep(0.2)  # an engine step, if anything had been queued
        server.wait_idle()
        after = _metrics(server)
        stats_after = server.engine_call(lambda e: e.stats())
    finally:
        server.engine_call(lambda e: e.__dict__.pop("add_request", None))
    assert adds == []
    assert not server.engine_call(lambda e: e.has_unfinished_requests() or e.groups)
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_success_total{finished_reason=abort}"):
        assert after.get(f"kvserve:{name}", 0.0) == before.get(f"kvserve:{name}", 0.0), name
    for key in ("prompt_tokens_computed", "generated_tokens", "num_running", "num_waiting"):
        assert stats_after[key] == stats_before[key], key


def test_truncate_prompt_tokens(client, offline):
    long = [3 + i % 380 for i in range(600)]  # beyond max_model_len = 512
    r = client.completions.create(model="tiny", prompt=long, **_greedy(4), extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10
    want = offline.generate([long[-10:]], SamplingParams(**_greedy(4)))[0].outputs[0].text
    assert r.choices[0].text == want
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          **_greedy(2), extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="tiny", prompt="hi", extra_body={"truncate_prompt_tokens": 0})
    for call in (lambda: client.completions.create(model="tiny", prompt=long, extra_body={"truncate_prompt_tokens": 513}),
                 lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        extra_body={"truncate_prompt_tokens": 10**30})):
        with pytest.raises(openai.BadRequestError, match=r"truncate_prompt_tokens \(\d+\) exceeds max_model_len \(512\)"):
            call()


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["code"] == "model_not_found"


def test_unknown_route_is_openai_error(server):
    r = httpx.get(server.base_url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key(tiny_folder):
    with ServerThread(_engine(tiny_folder, num_blocks=64), names=["tiny"], api_key="sekret") as s:
        bad = openai.OpenAI(base_url=s.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert ei.value.status_code == 401 and ei.value.body["type"] == "authentication_error"
        assert httpx.post(s.base_url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(s.base_url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=s.base_url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
        assert httpx.get(s.base_url + "/health").status_code == 200


def test_queue_full_503(tiny_folder):
    with ServerThread(_engine(tiny_folder, num_blocks=64, max_waiting=1), names=["tiny"]) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        s.api.async_engine.pause()
        first = {}
        t = threading.Thread(target=lambda: first.update(r=client.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})))
        t.start()
        deadline = time.monotonic() + 10
        while s.engine_call(lambda e: len(e.scheduler.waiting)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model="tiny", prompt="y", max_tokens=2)
        assert ei.value.status_code == 503 and ei.value.body["code"] == "queue_full"
        s.api.async_engine.resume()
        t.join(30)
        assert first["r"].usage.completion_tokens == 2


def test_max_waiting_counts_only_requests_waiting_to_start(tiny_folder):
    """Forked samples waiting for their first step do not fill the queue (issue #21: 503s while
    sequence slots were free); requests none of whose sequences has started do."""
    with ServerThread(_engine(tiny_folder, max_num_seqs=8, max_waiting=2), names=["tiny"]) as s:
        s.api.async_engine.pause()  # (commands still run: requests are queued, no step is taken)

        def forked(e):  # a group of 6 samples: its prompt computed, the 5 others forked, waiting
            e.add_request([5, 6, 7], SamplingParams(max_tokens=50, n=6, ignore_eos=True), request_id="forks")
            e.step()
            return len(e.scheduler.waiting), len(e.scheduler.running), e.scheduler.num_waiting_to_start()

        assert s.engine_call(forked) == (5, 1, 0)  # 5 waiting sequences, 7 free slots: none waits to start
        done = []
        threads = [threading.Thread(target=lambda: done.append(httpx.post(
            s.base_url + "/v1/completions", json={"prompt": [8, 9], "max_tokens": 2}, timeout=60)))
            for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.engine_call(lambda e: e.scheduler.num_waiting_to_start()) < 2:
            assert time.monotonic() < deadline and not done, done  # (not refused)
            time.sleep(0.01)
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": [8, 9], "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert "max_waiting=2): 2 requests wait to start" in r.json()["error"]["message"]
        s.engine_call(lambda e: e.abort_request("forks"))
        s.api.async_engine.resume()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in done] == [200, 200]


def test_serve_max_waiting_defaults_to_the_pool():
    from kvserve.entrypoints.cli import build_parser
    from kvserve.entrypoints.openai.cli import MAX_WAITING_PER_SEQ, serve_max_waiting

    assert serve_max_waiting(build_parser().parse_args(["serve"])) == MAX_WAITING_PER_SEQ * 128 == 512
    assert serve_max_waiting(build_parser().parse_args(["serve", "--max-num-seqs", "16"])) == 64
    assert serve_max_waiting(build_parser().parse_args(["serve", "--max-waiting", "0"])) == 0  # unbounded


def test_batch_that_overfills_the_queue_runs_nothing(tiny_folder):
    with ServerThread(_engine(tiny_folder, num_blocks=64, max_waiting=2), names=["tiny"]) as s:
        s.api.async_engine.pause()  # nothing leaves the waiting queue
        s.engine_call(lambda e: e.add_request([5, 6], SamplingParams(max_tokens=2), request_id="waiting"))
        r = httpx.post(s.base_url + "/v1/completions", timeout=60,
                       json={"prompt": [[5, 6], [7, 8]], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert s.engine_call(lambda e: (len(e.scheduler.waiting), list(e.groups))) == (1, ["waiting"])
        s.engine_call(lambda e: e.abort_request("waiting"))
        # a batch larger than the whole queue could never run: 400, not "retry later"
        r = httpx.post(s.base_url + "/v1/completions", timeout=60,
                       json={"prompt": [[5, 6], [7, 8], [9, 10]], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "a batch of 3 prompts exceeds the waiting-queue limit of this server (2 requests" in r.text
        s.api.async_engine.resume()
        r = httpx.post(s.base_url + "/v1/completions", timeout=60,
                       json={"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        metrics = _metrics(s)
        assert metrics.get("kvserve:request_success_total{finished_reason=abort}", 0.0) == 0.0
        assert metrics["kvserve:prompt_tokens_total"] == 4


# -------------------------------------------------------------- disconnects
def test_disconnects_free_kv_blocks(server):
    free_before = server.engine_call(lambda e: e.kv.num_free_blocks)
    metrics_before = _metrics(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}

    def client_that_leaves(i):
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "seed": i}, timeout=60) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=client_that_leaves, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.wait_idle(timeout=30)
    assert server.engine_call(lambda e: e.kv.num_free_blocks) == free_before
    assert server.engine_call(lambda e: len(e.scheduler.running) + len(e.scheduler.waiting)) == 0
    after = _metrics(server)
    aborted = after["kvserve:request_success_total{finished_reason=abort}"] - \
        metrics_before["kvserve:request_success_total{finished_reason=abort}"]
    assert aborted == 16
    generated = after["kvserve:generation_tokens_total"] - metrics_before["kvserve:generation_tokens_total"]
    assert generated < 16 * 400 / 2  # cancelled long before the end


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_while_sending_the_body_logs_no_traceback(server, client):
    import socket

    handler = _Records()
    # uvicorn's loggers do not propagate to the root logger: listen on them directly
    loggers = [logging.getLogger(n) for n in ("kvserve", "uvicorn", "uvicorn.access")]
    server_logger = logging.getLogger("kvserve.entrypoints.openai")
    old_level = server_logger.level
    for lg in loggers:
        lg.addHandler(handler)
    server_logger.setLevel(logging.DEBUG)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.2)  # the handler is reading the body
        deadline = time.monotonic() + 10
        while not any("disconnected" in r.getMessage() for r in handler.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in handler.records]
            time.sleep(0.02)
        r = client.completions.create(model="tiny", prompt=PROMPT, **_greedy(3))
        assert r.usage.completion_tokens == 3
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        server_logger.setLevel(old_level)
    bad = [r for r in handler.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.name, r.getMessage()) for r in bad]
    notes = [r for r in handler.records if "disconnected" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno <= logging.INFO and "\n" not in notes[0].getMessage()


def test_non_streaming_disconnect_aborts(server):
    free_before = server.engine_call(lambda e: e.kv.num_free_blocks)
    key = "kvserve:request_success_total{finished_reason=abort}"
    aborted_before = _metrics(server)[key]

    def slow_down(e):  # 5 ms per step: the request outlives the client's timeout on any machine
        step = e.step

        def slow_step():
            time.sleep(0.005)
            return step()

        e.step = slow_step

    server.engine_call(slow_down)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", timeout=0.3,
                       json={"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "n": 4})
        server.wait_idle(timeout=30)
    finally:
        server.engine_call(lambda e: delattr(e, "step"))
    assert server.engine_call(lambda e: e.kv.num_free_blocks) == free_before
    assert _metrics(server)[key] > aborted_before  # cancelled, not run to the end


# ------------------------------------------------------------------ metrics
def test_metrics_tell_the_truth(server, client):
    server.wait_idle()
    before = _metrics(server)
    usages = []
    for i in range(3):
        usages.append(client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", **_greedy(5 + i)).usage)
    usages.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 n=2, max_tokens=4, temperature=0.5, seed=1,
                                                 extra_body={"ignore_eos": True}).usage)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **_greedy(7)))
    usages.append(chunks[-1].usage)
    after = _metrics(server)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvserve:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    # one observation per returned sequence, as vLLM's child requests (the chat request has n=2: 6 in all)
    assert delta("kvserve:time_to_first_token_seconds_count") == 6
    assert delta("kvserve:e2e_request_latency_seconds_count") == 6
    assert delta("kvserve:request_queue_time_seconds_count") == 6
    tokens = [u.completion_tokens for u in usages]  # (greedy ones: 5, 6, 7; then 2 x 4; then 7)
    assert tokens == [5, 6, 7, 8, 7]
    assert delta("kvserve:time_per_output_token_seconds_count") == 6
    # a gap per token after each sequence's first, if every step returns one token per sequence
    assert delta("kvserve:inter_token_latency_seconds_count") == sum(tokens) - 6
    finished = sum(delta(f"kvserve:request_success_total{{finished_reason={r}}}") for r in ("stop", "length"))
    assert finished == 6
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"):
        assert f"kvserve:{g}" in after
    assert after["kvserve:num_requests_running"] == 0
    assert 0.0 <= after["kvserve:prefix_cache_hit_rate"] <= 1.0
    assert "kvserve:num_preemptions_total" in after


# ------------------------------------------------------------ CLI and bench
def test_cli_has_serve_and_bench():
    from kvserve.entrypoints.cli import build_parser

    a = build_parser().parse_args(["serve", "--port", "8123", "--served-model-name", "a", "b", "--api-key", "k"])
    assert a.host == "127.0.0.1" and a.port == 8123 and a.served_model_name == ["a", "b"] and a.api_key == ["k"]
    b = build_parser().parse_args(["bench", "serve", "--max-concurrency", "8", "--request-rate", "4"])
    assert b.max_concurrency == 8 and b.request_rate == 4.0 and b.dataset == "random"


def test_serve_fails_fast_when_the_port_is_taken(tmp_path, capsys):
    import socket

    from kvserve.entrypoints.cli import main

    missing = str(tmp_path / "nope.gguf")  # the address is checked first, so no model is ever loaded
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        rc = main(["serve", "--host", "127.0.0.1", "--port", str(port), "--model", missing])
        err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 10
    assert f"port {port} is already in use" in err and "--port" in err and "does not exist" not in err
    rc = main(["serve", "--host", "192.0.2.1", "--port", str(port), "--model", missing])  # TEST-NET-1: not ours
    err = capsys.readouterr().err
    assert rc == 2 and "192.0.2.1 is not an address of this machine" in err and "does not exist" not in err
    rc = main(["serve", "--host", "no-such-host.invalid", "--port", str(port), "--model", missing])
    err = capsys.readouterr().err
    assert rc == 2 and "'no-such-host.invalid' is not a valid address" in err
    rc = main(["serve", "--port", "70000", "--model", missing])
    assert rc == 2 and "--port 70000 is not a valid TCP port" in capsys.readouterr().err
    rc = main(["serve", "--max-body-bytes", "-1", "--model", missing])
    assert rc == 2 and "--max-body-bytes must be ≥ 1, got -1" in capsys.readouterr().err
    # a free address passes the check, and the model is looked at next
    loggers = [logging.getLogger(n) for n in ("kvserve", "kvserve.entrypoints.openai")]
    levels = [lg.level for lg in loggers]
    try:
        rc = main(["serve", "--host", "127.0.0.1", "--port", str(port), "--model", missing])
    finally:
        for lg, level in zip(loggers, levels):  # run_server configured them
            lg.setLevel(level)
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_bench_serve_measures_the_server(server, tiny_folder, tmp_path, capsys):
    from kvserve.bench.report import markdown
    from kvserve.entrypoints.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_folder),
               "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "8",
               "--max-concurrency", "3", "--label", "kvserve c=3", "--save-json", str(out)])
    assert rc == 0
    assert "Output token throughput" in capsys.readouterr().out
    s = json.loads(out.read_text())
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_input_tokens"] == 6 * 16 and s["total_output_tokens"] == 6 * 8
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] and s["mean_tpot_ms"] > 0 and s["mean_itl_ms"] > 0
    assert s["output_throughput"] == pytest.approx(48 / s["duration_s"])
    table = markdown([s, {**s, "label": "peer c=3"}])
    assert "| kvserve | 3 | 6 / 0 |" in table and "1.00x" in table
    rc = main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_folder),
               "--endpoint", "chat", "--dataset", "shared-prefix", "--shared-prefix-len", "12", "--num-prefixes", "2",
               "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4", "--request-rate", "50",
               "--save-json", str(out)])
    s = json.loads(out.read_text())
    assert rc == 0 and s["completed"] == 4 and s["total_output_tokens"] == 16


def test_bench_counts_failures(server):
    import asyncio

    from kvserve.bench.serve import BenchConfig, run_benchmark

    cfg = BenchConfig(base_url=server.base_url, model="no-such-model", num_prompts=2, input_len=4, output_len=2,
                      warmup=0)
    s = asyncio.run(run_benchmark(cfg, [[5, 6, 7, 8]] * 2))
    assert s["completed"] == 0 and s["failed"] == 2 and "HTTP 404" in s["errors"][0]


def test_beam_search(server, client):
    before = _metrics(server)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2, temperature=0,
                                  extra_body={"use_beam_search": True, "beam_width": 3, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    after = _metrics(server)
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 10
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
                                  extra_body={"use_beam_search": True})
    assert ei.value.body["param"] == "use_beam_search"


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **_greedy(6),
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_body_size_limit(server):
    old = server.api.max_body_bytes
    server.api.max_body_bytes = 1000
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x" * 2000})
    finally:
        server.api.max_body_bytes = old
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_engine_failure_fails_live_requests_only(server, client):
    def break_step(engine):
        def boom():
            del engine.step  # fail once, then the class's step again
            raise RuntimeError("boom")
        engine.step = boom

    server.wait_idle()  # (a request left from an earlier test would take the failed step instead)
    server.engine_call(break_step)
    with pytest.raises(openai.InternalServerError) as ei:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert ei.value.status_code == 503 and "boom" in ei.value.body["message"]
    server.wait_idle()
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_streamed_echo_with_logprobs_equals_the_non_streamed_response(server):
    # the echoed prompt's logprobs come with its text in the first chunk (they were null)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, **_greedy(6)}
    full = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == full["text"]
    assert choices[0]["text"].startswith(PROMPT)
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in choices for v in c["logprobs"][field]] == full["logprobs"][field], field
    assert full["logprobs"]["token_logprobs"][0] is None and len(full["logprobs"]["tokens"]) > 6


def test_streamed_text_offsets_equal_the_non_streamed_ones_when_text_is_held_back(server):
    # a stop string that starts like the text holds a delta's tail back: the offsets still
    # come from the tokens' own strings, as in the whole response
    base = {"prompt": PROMPT, "logprobs": 1, **_greedy(8), "ignore_eos": True}
    text = httpx.post(server.base_url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    body = {**base, "stop": [c + "\u2603" for c in sorted(set(text))][:16]}
    full = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert full["text"] == text
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    offsets = [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["text_offset"]]
    assert offsets == full["logprobs"]["text_offset"]
    assert offsets == sorted(offsets)


def test_prompt_logprobs_with_stream_is_rejected(server):
    for path, extra in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server.base_url + path, json={**extra, "max_tokens": 2, "stream": True, "prompt_logprobs": 1},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", path


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server):
    # lm-eval's loglikelihood requests: echo the prompt, score it, generate nothing
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}
    full = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=60).json()
    only = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    choice = only["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    n_prompt = only["usage"]["prompt_tokens"]
    assert only["usage"]["completion_tokens"] == 0 and only["usage"]["total_tokens"] == n_prompt
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert choice["logprobs"][field] == full["choices"][0]["logprobs"][field][:n_prompt], field
    assert choice["logprobs"]["token_logprobs"][0] is None
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 0, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # without echo: nothing to return


def test_errors_name_the_field_the_client_sent(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={**chat, "use_beam_search": True, "n": 2, "logprobs": True}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logprobs"
    assert "got logprobs=0" in err["message"] and "top_logprobs" not in err["message"]
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={**chat, "use_beam_search": True, "n": 2, "logprobs": True, "top_logprobs": 2}, timeout=60)
    assert r.json()["error"]["param"] == "top_logprobs" and "got top_logprobs=2" in r.json()["error"]["message"]
    tok = server.api.engine.tokenizer
    word, tid = next((w, t) for t in range(100, 1000) for w in [tok.decode([t])]
                     if w.strip() and tok.encode(w, add_special_tokens=False) == [t])
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": [tid], "bad_words": [word]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_a_too_long_prompt_stops_the_batch_before_the_rest_is_tokenized(server):
    seen = []
    real = server.api.engine.encode

    def encode(text):
        seen.append(text)
        return real(text)

    server.api.engine.encode = encode
    try:
        long = "fox " * 2000
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": [PROMPT, long, PROMPT + " again", PROMPT + " more"], "max_tokens": 2}, timeout=60)
    finally:
        del server.api.engine.encode
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "(prompt 1 of the batch)" in r.json()["error"]["message"]
    assert seen == [PROMPT, long]


def test_bad_words_are_tokenized_off_the_event_loop(server, monkeypatch):
    import kvserve.entrypoints.openai.protocol as protocol

    release = threading.Event()
    real = protocol.bad_words_token_ids

    def slow(tokenizer, words):
        assert release.wait(30), "the event loop was blocked"
        return real(tokenizer, words)

    monkeypatch.setattr(protocol, "bad_words_token_ids", slow)
    res = {}
    t = threading.Thread(target=lambda: res.update(r=httpx.post(
        server.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "bad_words": ["fox"]},
        timeout=60)))
    t.start()
    time.sleep(0.2)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # answered meanwhile
    release.set()
    t.join(60)
    assert res["r"].status_code == 200


def test_metrics_of_echo_only_and_beam_search_requests(server):
    def deltas(body):
        server.wait_idle()
        before = _metrics(server)
        t0 = time.perf_counter()
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, **body}, timeout=60)
        wall = time.perf_counter() - t0
        after = _metrics(server)
        assert r.status_code == 200, r.text
        return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}, r.json()["usage"], wall

    # echo with max_tokens 0: the token the engine samples is dropped, so it is not counted
    d, usage, _ = deltas({"echo": True, "max_tokens": 0, "logprobs": 1})
    assert usage["completion_tokens"] == 0 and d["kvserve:generation_tokens_total"] == 0
    assert d["kvserve:time_to_first_token_seconds_count"] == 0 and d["kvserve:time_per_output_token_seconds_count"] == 0
    assert d["kvserve:e2e_request_latency_seconds_count"] == 1
    assert d["kvserve:request_success_total{finished_reason=length}"] == 1
    # ... also when the dropped token would have stopped it (the response's reason is length: so is the count)
    d, usage, _ = deltas({"echo": True, "max_tokens": 0, "logit_bias": {"5": 100}, "stop_token_ids": [5]})
    assert usage["completion_tokens"] == 0
    assert d["kvserve:request_success_total{finished_reason=length}"] == 1
    assert d["kvserve:request_success_total{finished_reason=stop}"] == 0
    # beam search: TTFT is the search's first token, not its end; TPOT spreads the rest over the tokens
    d, usage, wall = deltas({"use_beam_search": True, "n": 2, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert d["kvserve:generation_tokens_total"] == usage["completion_tokens"] == 16
    assert d["kvserve:time_to_first_token_seconds_count"] == 1 and d["kvserve:time_per_output_token_seconds_count"] == 1
    ttft, tpot = d["kvserve:time_to_first_token_seconds_sum"], d["kvserve:time_per_output_token_seconds_sum"]
    e2e = d["kvserve:e2e_request_latency_seconds_sum"]
    assert 0 < ttft < e2e <= wall and tpot > 0
    assert ttft + 7 * tpot == pytest.approx(e2e, rel=1e-6)


@pytest.mark.parametrize("option, value, words", [
    ("--num-prompts", "0", "--num-prompts must be ≥ 1, got 0"),
    ("--random-input-len", "-5", "--random-input-len must be ≥ 1 (tokens), got -5"),
    ("--random-output-len", "0", "--random-output-len must be ≥ 1 (tokens), got 0"),
    ("--random-range-ratio", "5", "--random-range-ratio must be in [0, 1), got 5.0"),
    ("--request-rate", "-3", "--request-rate must be > 0 requests/s (inf: all at once), got -3.0"),
    ("--max-concurrency", "0", "--max-concurrency must be ≥ 1 (omit: unbounded), got 0"),
    ("--warmup", "-1", "--warmup must be ≥ 0 (requests), got -1"),
    ("--base-url", "notaurl", "--base-url must be an http:// or https:// URL, got 'notaurl'"),
    ("--tokenizer", "/nonexistent", "--tokenizer must be an existing GGUF file or folder, got '/nonexistent'"),
])
def test_bench_serve_rejects_bad_options_before_sending(option, value, words, capsys):
    from kvserve.entrypoints.cli import main

    assert main(["bench", "serve", "--model", "x", option, value]) == 2
    assert capsys.readouterr().err == f"error: {words}\n"


def test_bench_serve_against_no_server_is_one_line(tiny_folder, capsys):
    from kvserve.entrypoints.cli import main
    from server_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--base-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot list the models of {url}") and "Traceback" not in err
    assert main(["bench", "serve", "--base-url", url, "--model", "x", "--tokenizer", str(tiny_folder)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: warm-up request failed") and err.count("\n") == 1, err
