"""Structured output over HTTP on a tiny random model: OpenAI's ``response_format`` (json_object,
json_schema) and vLLM's ``structured_outputs`` on /v1/completions and /v1/chat/completions,
streamed or not, equal to the offline engine; bad values get a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import ServerThread, accumulate_chat_stream

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ARGS = dict(dtype="float32", num_blocks=512, block_size=4, max_model_len=512)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(folder):
    engine = LLMEngine(EngineArgs(model=str(folder), **ARGS))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    with ServerThread(engine, names=["tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


# a template that renders tools, as Qwen's and Hermes' do (CHAT_TEMPLATE ignores them, so under
# tool_choice auto they would come in a system message, too long for this model's 512 tokens)
TOOLS_TEMPLATE = ("{% if tools %}<s>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s>\n"
                  "{% endif %}" + CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tools_client(folder):
    engine = LLMEngine(EngineArgs(model=str(folder), **ARGS))
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    with ServerThread(engine, names=["tiny"], tool_call_parser="hermes") as s:
        yield openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(folder):
    llm = LLM(model=str(folder), **ARGS)
    llm.engine.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


def test_chat_json_schema_equals_offline_and_validates(client, offline):
    """response_format json_schema: the same text as the offline engine; whitespace is free by
    default (this model may pad with it up to max_tokens), and the outputs that end validate."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    done = 0
    for seed in (None, 1, 2, 3):
        kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, response_format=rf, **kw)
        c = r.choices[0]
        want = offline.chat(MESSAGES, SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(
            json=SCHEMA), **kw)).outputs[0]
        assert (c.message.content, c.finish_reason) == (want.text, want.finish_reason)
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
            done += 1
    assert done


def test_chat_json_object_mode(client):
    outs = []
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        outs.append(r.choices[0])
    done = [c.message.content for c in outs if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)


def test_completions_structured_outputs_each_kind(client):
    cases = [({"regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"grammar": 'start: "n=" NUM\nNUM: /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"n=[0-9]{1,3}", t)),
             ({"json": SCHEMA, "disable_any_whitespace": True},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None
              and t == json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False))]
    for so, ok in cases:
        r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=100, n=3,
                                      temperature=1.0, seed=4, extra_body={"structured_outputs": so})
        assert len(r.choices) == 3
        for c in r.choices:
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_chat_structured_outputs_and_stream(client):
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                                          extra_body={"structured_outputs": so})
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                                                 stream=True, extra_body={"structured_outputs": so}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and finish == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)


CHAT = {"messages": MESSAGES, "max_tokens": 8}
BAD = [
    ({"response_format": {"type": "xml"}}, "response_format", "'type' is one of ['text', 'json_object', 'json_schema']"),
    ({"response_format": "json"}, "response_format", "response_format must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "must be an object with a 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format",
     "with a 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}}, "response_format",
     "name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format.json_schema.schema: invalid JSON schema: Invalid type: nope"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "either response_format or structured_outputs"),
    ({"response_format": {"type": "json_object"}, "use_beam_search": True}, "response_format",
     "response_format is not supported with use_beam_search"),
    ({"structured_outputs": "json"}, "structured_outputs", "structured_outputs must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got 2: regex, choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field(s) ['regexp']"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice must be a non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs", "structured_outputs.choice[1] must be a str"),
    ({"structured_outputs": {"regex": "a(("}}, "structured_outputs", "structured_outputs.regex: invalid regex"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs",
     "structured_outputs.grammar: invalid grammar"),
    ({"structured_outputs": {"json": {"type": "object", "properties": 3}}}, "structured_outputs",
     "structured_outputs.json: invalid JSON schema"),
    ({"structured_outputs": {"regex": "a"}, "use_beam_search": True}, "structured_outputs",
     "structured_outputs is not supported with use_beam_search"),
]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_structured_output_gets_400_naming_the_field(server, endpoint, extra, param, words):
    base = CHAT if endpoint == "chat/completions" else {"prompt": "hi", "max_tokens": 8}
    r = httpx.post(f"{server.base_url}/v1/{endpoint}", json={**base, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert words in err["message"], err["message"]
    ok = httpx.post(f"{server.base_url}/v1/{endpoint}", json=base, timeout=60)  # the server carries on
    assert ok.status_code == 200


# ------------------------------------------------------------------ tool calls
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _tool_calls(client, tool_choice, seeds=(None, 1, 2, 3), **kw):
    """The replies that ended as tool calls (a random model may pad the JSON with whitespace up
    to max_tokens; those end with "length" and their text)."""
    calls = []
    for seed in seeds:
        sample = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=150,
                                           tool_choice=tool_choice, **sample, **kw)
        c = r.choices[0]
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            assert c.message.content is None and c.message.tool_calls
            calls.append(c.message.tool_calls)
        else:
            assert c.message.tool_calls is None and c.message.content
    assert calls
    return calls


def test_named_tool_choice_returns_a_call_with_valid_arguments(client):
    for calls in _tool_calls(client, {"type": "function", "function": {"name": "get_weather"}}):
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert calls[0].id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS["get_weather"])


def test_required_tool_choice_returns_calls_of_the_tools(client):
    names = set()
    for calls in _tool_calls(client, "required", seeds=(None, 1, 2, 3, 4, 5)):
        assert len(calls) == 1  # parallel_tool_calls not set: one call
        names.add(calls[0].function.name)
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS[calls[0].function.name])
    assert names <= set(PARAMS)
    for calls in _tool_calls(client, "required", seeds=(1, 2, 3), parallel_tool_calls=True):
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_none_ignores_the_tools_and_tool_turns_are_accepted(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason != "tool_calls" and r.choices[0].message.tool_calls is None
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       extra_body={"ignore_eos": False})
    assert r.choices[0].finish_reason in ("tool_calls", "length")


def test_a_tool_reply_cut_by_a_stop_string_comes_back_as_text(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       stop=['"unit"', '"city"'])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content.startswith("{")


TOOL_BAD = [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not in tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be 'none', 'auto', 'required'"),
    ({"tools": {"a": 1}, "tool_choice": "required"}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools",
     "tools[0].function.name must be 1-64 characters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "tools[1].function.name 'get_weather' is "
                                                                         "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters",
     "tools[0] (f): tools: a function's parameters: invalid JSON schema"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[1].function.parameters", "tools[1] (f): tools: a function's parameters: invalid JSON schema"),  # auto: checked, though not compiled
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid value for 'parallel_tool_calls'"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "parallel_tool_calls is only allowed when 'tools' are given"),
    ({"tools": [], "parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when 'tools' are given"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "tools[0].function.parameters must be a JSON Schema object, or null or left out for a function without "
     "arguments; got str"),
]


@pytest.mark.parametrize("extra, param, words", TOOL_BAD)
def test_bad_tool_calls_get_400_naming_the_field(server, extra, param, words):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "now"}}])
def test_a_function_whose_parameters_are_null_takes_no_arguments(server, tool_choice):
    """``"parameters": null`` is a function without arguments, as when left out (vLLM's
    ``FunctionDefinition.parameters`` is optional): it was a 400."""
    tools = [{"type": "function", "function": {"name": "now", "description": "the time", "parameters": None}}]
    body = {**CHAT, "max_tokens": 40, "temperature": 0, "tools": tools, "tool_choice": tool_choice}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if tool_choice != "auto":  # generated under {"type": "object", "properties": {}}
        assert c["finish_reason"] == "tool_calls", c
        assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["now"]
        assert isinstance(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]), dict)


# ------------------------------------------------------- streamed tool calls, tool_choice auto
def _whole(message):
    return message.content, [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_forced_tool_calls_equal_the_whole_reply(client, tool_choice):
    done = 0
    for seed in (None, 1, 2, 3):
        sample = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=150, tool_choice=tool_choice,
                  parallel_tool_calls=True, **sample)
        whole = client.chat.completions.create(**kw).choices[0]
        content, calls, finishes = accumulate_chat_stream(client.chat.completions.create(stream=True, **kw))
        assert finishes == [whole.finish_reason]
        if whole.finish_reason != "tool_calls":  # (whitespace padding up to max_tokens: text, cut mid-call)
            assert whole.finish_reason == "length"
            continue
        done += 1
        w_content, w_calls = _whole(whole.message)
        assert content is None and w_content is None
        assert [c[1:] for c in calls] == [c[1:] for c in w_calls]  # (ids are new for each reply)
        for _, name, args in calls:
            jsonschema.validate(json.loads(args), PARAMS[name])
    assert done


# a reply forced through structured_outputs that exercises the parser: text, two calls, text after
AUTO_REGEX = (r'Let me look\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(CITY)", '
              r'"unit": "celsius"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": '
              r'\{"zone": [1-9]\}\}\n</tool_call> Done\.')


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_auto_tool_calls_are_parsed_from_the_reply_whole_and_streamed(tools_client, tool_choice):
    for seed, city in enumerate(["Paris", "Zürich", "東京", "Oslo|Rome"]):
        kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=seed,
                  extra_body={"structured_outputs": {"regex": AUTO_REGEX.replace("CITY", city)}})
        if tool_choice is not None:
            kw["tool_choice"] = tool_choice
        whole = tools_client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls"
        content, calls = _whole(whole.message)
        assert content == "Let me look. \n Done."
        assert [c[1] for c in calls] == ["get_weather", "get_time"]
        assert all(c[0].startswith("chatcmpl-tool-") for c in calls) and calls[0][0] != calls[1][0]
        args = json.loads(calls[0][2])
        assert args["city"] in city.split("|")
        assert calls[0][2] == f'{{"city": "{args["city"]}", "unit": "celsius"}}'  # as the model wrote it
        assert re.fullmatch(r'\{"zone": [1-9]\}', calls[1][2])
        s_content, s_calls, finishes = accumulate_chat_stream(tools_client.chat.completions.create(stream=True, **kw))
        assert (s_content, [c[1:] for c in s_calls], finishes) == (content, [c[1:] for c in calls], ["tool_calls"])


def test_auto_malformed_calls_stay_text_and_parallel_tool_calls_false_keeps_one(tools_client):
    bad = (r'<tool_call>\n\{"name": "get_wind", "arguments": \{\}\}\n</tool_call> and <tool_call>\{"name": '
           r'"get_time", "arguments": \{"zone": 1\}</tool_call>')
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": bad}})
    whole = tools_client.chat.completions.create(**kw).choices[0]
    text = ('<tool_call>\n{"name": "get_wind", "arguments": {}}\n</tool_call> and <tool_call>{"name": "get_time", '
            '"arguments": {"zone": 1}</tool_call>')
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (text, None, "stop")
    # streamed, the first block alone (the second's header is complete, so a stream sends its call
    # before it can see the missing "}": the difference the parser documents)
    first = {**kw, "extra_body": {"structured_outputs": {"regex": bad.split(" and ")[0]}}}
    streamed = accumulate_chat_stream(tools_client.chat.completions.create(stream=True, **first), no_text=())
    assert streamed[:2] == (text.split(" and ")[0], [])
    oslo = {"structured_outputs": {"regex": AUTO_REGEX.replace("CITY", "Oslo")}}
    one = tools_client.chat.completions.create(**{**kw, "parallel_tool_calls": False, "extra_body": oslo}).choices[0]
    assert [t.function.name for t in one.message.tool_calls] == ["get_weather"]
    assert one.message.content == "Let me look. \n Done." and one.finish_reason == "tool_calls"


def test_auto_tools_reach_the_model_through_the_template_or_a_system_prompt(server, client, offline):
    from kvserve.entrypoints.openai.tool_parsers import HermesToolParser

    tok = offline.engine.tokenizer

    def prompt_tokens(**kw):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, **kw).usage.prompt_tokens

    # this template ignores tools: the Hermes description opens a system message (a short tool: this
    # tokenizer makes the description ~400 tokens)
    short = {"type": "function", "function": {"name": "f"}}
    system = [{"role": "system", "content": HermesToolParser.system_prompt([short])}] + MESSAGES
    want = len(tok.encode(tok.apply_chat_template(system, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False))
    assert prompt_tokens(tools=[short]) == want
    assert prompt_tokens(tools=[short], tool_choice="none") == prompt_tokens() < want - 300
    # and earlier tool turns are written as <tool_call> / <tool_response> text
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    as_text = system + [{"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'},
                        {"role": "tool", "tool_call_id": "c1", "content": "<tool_response>\nok\n</tool_response>"}]
    want = len(tok.encode(tok.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False))
    r = client.chat.completions.create(model="tiny", messages=history, tools=[short], max_tokens=1)
    assert r.usage.prompt_tokens == want
    # a template that renders tools gets them, and no system message
    api_tok = server.api.tokenizer
    api_tok.chat_template = "{% if tools %}<s>tools: {{ tools | length }}</s>\n{% endif %}" + CHAT_TEMPLATE
    try:
        with_tools = prompt_tokens(tools=[WEATHER, TIME])
        rendered = api_tok.apply_chat_template(MESSAGES, tools=[WEATHER, TIME], tokenize=False,
                                               add_generation_prompt=True)
    finally:
        api_tok.chat_template = CHAT_TEMPLATE
    assert rendered.startswith("<s>tools: 2</s>\n")
    assert with_tools == len(api_tok.encode(rendered, add_special_tokens=False))


def test_streamed_auto_tool_calls_with_n_2_logprobs_and_usage(tools_client):
    """Each of n choices has its own parser state; logprobs and the usage chunk still come."""
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=7, n=2,
              extra_body={"structured_outputs": {"regex": AUTO_REGEX.replace("CITY", "Paris|Oslo|Rome|Bern")}})
    whole = tools_client.chat.completions.create(**kw)
    chunks = list(tools_client.chat.completions.create(stream=True, logprobs=True,
                                                       stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    n_logprobs = 0
    for i in range(2):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        content, calls, finishes = accumulate_chat_stream(mine)
        w = next(c for c in whole.choices if c.index == i)
        w_content, w_calls = _whole(w.message)
        assert (content, [c[1:] for c in calls], finishes) == (w_content, [c[1:] for c in w_calls], ["tool_calls"])
        n_logprobs += sum(len(c.choices[0].logprobs.content) for c in mine if c.choices[0].logprobs)
    assert n_logprobs == whole.usage.completion_tokens  # one entry per generated token, none lost


def test_special_tool_call_tags_are_kept_in_the_text(folder):
    """A tokenizer whose <tool_call> tags are special tokens would drop them from the text under
    the default skip_special_tokens: the tag check turns it off for that request only."""
    from transformers import AutoTokenizer

    from kvserve.entrypoints.openai.api import keep_tool_tags
    from kvserve.entrypoints.openai.tool_parsers import HermesToolParser

    parser = HermesToolParser([WEATHER])
    tok = AutoTokenizer.from_pretrained(folder)
    params = SamplingParams(max_tokens=4)
    assert keep_tool_tags(params, parser, tok) is params  # plain text tags: nothing changes
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    ids = tok.encode('<tool_call>{"name": "get_weather"}</tool_call>', add_special_tokens=False)
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)
    kept = keep_tool_tags(params, parser, tok)
    assert kept.skip_special_tokens is False and kept.max_tokens == 4 and params.skip_special_tokens is True
    assert tok.decode(ids, skip_special_tokens=kept.skip_special_tokens) == \
        '<tool_call>{"name": "get_weather"}</tool_call>'
    assert keep_tool_tags(SamplingParams(skip_special_tokens=False), parser, tok).skip_special_tokens is False


# roles must alternate after an optional system message, as Gemma 3's template demands
ALTERNATING_TEMPLATE = (
    "{% set ns = namespace(start=0) %}{% if messages[0]['role'] == 'system' %}"
    "<s>system\n{{ messages[0]['content'] }}</s>\n{% set ns.start = 1 %}{% endif %}"
    "{% for m in messages[ns.start:] %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.mark.parametrize("with_tools", [False, True])
def test_tool_turns_reach_a_template_whose_roles_must_alternate(server, client, with_tools):
    """A call -> result -> answer loop on a template that refuses the tool role (Gemma 3's):
    the calls are written as <tool_call> blocks, the results as a user turn, and the prompt is
    exactly that rendering (with tools: after the Hermes system message); a conversation the
    template refuses for another reason is still a 400 naming messages."""
    from kvserve.entrypoints.openai.tool_parsers import HermesToolParser

    short = {"type": "function", "function": {"name": "f"}}
    first = [{"role": "user", "content": "Hi"}]
    history = first + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "So?"}]
    as_text = first + [{"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
                          {"role": "user", "content": "<tool_response>\nok\n</tool_response>\n\nSo?"}]
    if with_tools:
        as_text = [{"role": "system", "content": HermesToolParser.system_prompt([short])}] + as_text
    api_tok = server.api.tokenizer
    api_tok.chat_template = ALTERNATING_TEMPLATE
    try:
        want = len(api_tok.encode(api_tok.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False))
        kw = {"tools": [short]} if with_tools else {}
        r = client.chat.completions.create(model="tiny", messages=history, max_tokens=1, **kw)
        assert r.usage.prompt_tokens == want
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES * 2, max_tokens=1, **kw)
    finally:
        api_tok.chat_template = CHAT_TEMPLATE
    assert e.value.body["param"] == "messages" and "alternate" in e.value.body["message"]


GRAMMAR_LIMIT_CASES = {
    # refused at submission: the first step's mask already fails
    "ref_loop": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, "response_format"),
    # limits hit while the request runs (Earley row size, lexer size, item count)
    "choice": ({"structured_outputs": {"choice": [f"opt{i}" for i in range(10001)]}}, "structured_outputs"),
    "regex": ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
    "endless": ({"structured_outputs": {"grammar": 'start: a\na: "x" a'}}, "structured_outputs"),
}


@pytest.mark.parametrize("case", list(GRAMMAR_LIMIT_CASES))
def test_a_grammar_that_hits_a_limit_is_the_clients_400(server, case):
    """Grammars that compile but hit one of llguidance's limits: a 400 naming the field (at
    submission where the first mask fails, else when the limit is hit), never a 500; a good
    request sent beside it still gets its answer."""
    import concurrent.futures

    body, param = GRAMMAR_LIMIT_CASES[case]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    good = {**chat, "max_tokens": 8, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad_f = pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json={**chat, **body}, timeout=120)
        good_f = pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json=good, timeout=120)
        bad, ok = bad_f.result(), good_f.result()
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and len(err["message"]) < 400, err
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("history, field", [
    ([{"role": "tool", "content": "5C"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "tool_call_id": 7, "content": "5C"}], "messages[1].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": "x"}], "messages[1].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}], "messages[1].tool_calls[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {**_CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}], "messages[1].tool_calls[0]"),
    ([{"role": "user", "content": "x", "tool_calls": [_CALL]}], "messages[1].tool_calls"),
])
def test_tool_turns_in_the_wrong_shape_are_refused_naming_the_field(server, history, field):
    """OpenAI's shapes: a tool message names its call (tool_call_id, a string); tool_calls is a
    list, on an assistant message, of calls whose function has a name and an arguments string."""
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}] + history, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["message"].startswith(field), err
    ok = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "5C"}], "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text
