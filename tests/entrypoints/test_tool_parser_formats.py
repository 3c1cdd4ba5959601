"""The llama3_json, mistral and pythonic tool-call parsers (server/tool_parsers.py): sample replies
read whole, and streamed over every split of their text into two and three pieces (and random
splits into many) with the same calls and content; malformed calls stay content; then each parser
behind the server with the openai client, on a tiny model made to write a sample by a regex."""

from __future__ import annotations

import json
import time

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import ServerThread, accumulate_chat_stream

from kvserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolCall,
    ToolCallDelta,
    get_tool_parser,
    join_events,
)

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
W, T = "get_weather", "get_time"


def _streamed(parser, pieces):
    s = parser.stream()
    events = []
    for piece in pieces:
        events += s.feed(piece)
    return events + s.finish()


# ------------------------------------------------------------------ samples: text -> (content, calls)
LLAMA = {
    # several, ";" between them, "arguments" for "parameters", whitespace around
    ' {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}} ;\n'
    '{"name":"get_time","arguments":{"zone":-2}};':
        (None, [(W, '{"city": "Oslo", "unit": "celsius"}'), (T, '{"zone":-2}')]),
    # Llama 3.1's usual reply: one call after <|python_tag|>
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}':
        (None, [(W, '{"city": "Paris"}')]),
    # content before and after; braces, quotes, ";" and the tag inside strings
    'Let me check. <|python_tag|> {"name": "get_weather", "parameters": {"city": "a}b{c \\"q\\"; <|python_tag|>", '
    '"nested": {"list": [1, {"x": "}"}], "empty": {}}}} Done.':
        ("Let me check.  Done.", [(W, '{"city": "a}b{c \\"q\\"; <|python_tag|>", "nested": {"list": [1, {"x": "}"}], '
                                      '"empty": {}}}')]),
    # unicode, and a later key that is ignored
    'Voilà 😀 {"name": "get_weather", "parameters": {"city": "東京", "note": "\\u00e9t\\u00e9"}, "id": 7} fin ✓':
        ("Voilà 😀  fin ✓", [(W, '{"city": "東京", "note": "\\u00e9t\\u00e9"}')]),
    # malformed: unknown name, keys in another order, arguments not an object, bad JSON, a built-in
    # tool's python after the tag, an object that breaks at a "<" -- all text, as written
    '{"name": "nope", "parameters": {"a": {"name": "get_time", "parameters": {}}}} and '
    '{"parameters": {}, "name": "get_time"} and {"name": "get_time", "parameters": "zone=1"} and '
    '{"name": get_time} <|python_tag|>brave_search.call(query="x") {"name": "nope", "parameters": {<|eot_id|>':
        None,
    'a { b } {"name": "Bob"} {"name" x <|python_ and <|python_tag|> [1] no calls': None,
    # a call between malformed text, the ; only after a call
    '{"name": "nope", "parameters": {}}; {"name": "get_time", "parameters": {"zone": 3}} ; x;':
        ('{"name": "nope", "parameters": {}}; x;', [(T, '{"zone": 3}')]),
    "   ": None, "": None,
}
MISTRAL = {
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": 2}}]':
        (None, [(W, '{"city": "Paris", "unit": "celsius"}'), (T, '{"zone": 2}')]),
    # content before; strings with brackets and commas; an extra key; no space after the tag
    'Let me look.[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"a],[b} \\"x\\""},"id":"abc123xyz"}]':
        ("Let me look.", [(W, '{"city":"a],[b} \\"x\\""}')]),
    # keys in another order and no arguments (re-serialized: {}); unicode; text after the list
    'Hé [TOOL_CALLS] [ {"arguments": {"city": "Zürich"}, "name": "get_weather"} , {"name": "get_time"} ] voilà':
        ("Hé  voilà", [(W, '{"city": "Zürich"}'), (T, "{}")]),
    # a list with calls: its malformed elements are content, the rest of the list is not
    '[TOOL_CALLS] [{"name": "nope", "arguments": {}}, {"name": "get_time", "arguments": {"zone": 1}}, '
    '{"name": "get_time", "arguments": "zone=1"}, 42]':
        ('{"name": "nope", "arguments": {}}{"name": "get_time", "arguments": "zone=1"}42', [(T, '{"zone": 1}')]),
    # lists without calls, a tag not followed by a list, a list broken by a special token: text
    '[TOOL_CALLS] [{"name": "nope", "arguments": {}}] [TOOL_CALLS] hello [TOOL_CALL [TOOL_CALLS] []'
    ' [TOOL_CALLS] [{"name": "nope", "arguments": {"zone": 1}</s> end': None,
    "[TOOL_CALLS]": None, "plain [text], {x} no calls": None, "": None,
}
PYTHONIC = {
    '[get_weather(city="Paris", unit=\'celsius\'), get_time()]':
        (None, [(W, '{"city": "Paris", "unit": "celsius"}'), (T, "{}")]),
    # content before and after; literals: negative numbers, nested lists/tuples/dicts, None/True,
    # JSON's null/true, strings with brackets, quotes, commas and a triple quote
    'See [1] and [a link](x): [get_time(zone=-2, x=[1, (2.5, 3)], y={"a": None, "b": [True, null, true]}), '
    'get_weather(city="a),[b\\"", note="""it\'s "quoted", ok""",)] ok':
        ("See [1] and [a link](x):  ok", [
            (T, '{"zone": -2, "x": [1, [2.5, 3]], "y": {"a": null, "b": [true, null, true]}}'),
            (W, '{"city": "a),[b\\"", "note": "it\'s \\"quoted\\", ok"}')]),
    # unicode; whitespace and newlines inside the list
    'Voilà:\n[\n  get_weather(city="東京"),\n  get_time(zone=9)\n]\n✓':
        ("Voilà:\n\n✓", [(W, '{"city": "東京"}'), (T, '{"zone": 9}')]),
    # a list with calls: its malformed elements are content
    '[get_time(zone=1), nope(a=1), get_time(zone=foo()), get_time(1), get_weather(city="x", city="y"), 7]':
        ("nope(a=1)get_time(zone=foo())get_time(1)get_weather(city=\"x\", city=\"y\")7", [(T, '{"zone": 1}')]),
    # lists without calls (a value that is not a literal, a positional argument, **kwargs, an
    # unknown tool, a cut call), and brackets that are no list of calls: text
    '[get_time(zone=foo())] [get_time(3)] [get_time(**k)] [nope()] [get_weather(city=x)] '
    '[get_time(zone=1) + 1] [] [[1]] [get_time(zone=1': None,
    "[get_time(zone=1)": (None, [(T, '{"zone": 1}')]),  # a list cut after a whole call: the call
    "[get_weather(city='Par": None,  # cut inside the call: text
    "": None, "no [calls] here": None,
}
FORMATS = {"llama3_json": (Llama3JsonToolParser, LLAMA), "mistral": (MistralToolParser, MISTRAL),
           "pythonic": (PythonicToolParser, PYTHONIC)}
CASES = [(name, text) for name, (_, samples) in FORMATS.items() for text in samples]


def _want(name, text):
    got = FORMATS[name][1][text]
    if got is None:  # no calls: the text unchanged
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls(got[0], [ToolCall(n, a) for n, a in got[1]])


@pytest.mark.parametrize("name, text", CASES)
def test_extract_reads_the_sample(name, text):
    got = FORMATS[name][0](TOOLS).extract(text)
    assert got == _want(name, text)
    for c in got.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("name, text", CASES)
def test_stream_equals_extract_for_every_split_in_two_and_three(name, text):
    parser = FORMATS[name][0](TOOLS)
    want = _want(name, text)
    for i in range(len(text) + 1):
        assert join_events(_streamed(parser, [text[:i], text[i:]])) == want, i
    step = max(1, len(text) // 30)
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert join_events(_streamed(parser, [text[:i], text[i:j], text[j:]])) == want, (i, j)


@pytest.mark.parametrize("name", list(FORMATS))
def test_one_character_at_a_time(name):
    parser = FORMATS[name][0](TOOLS)
    for text in FORMATS[name][1]:
        assert join_events(_streamed(parser, list(text))) == _want(name, text), text


# all of a format's samples in one text, joined by a letter (but those cut inside a call)
CUT = ("zone=1", "zone=1)", "'Par")  # (an unclosed list would take in the next sample)
JOINED = {name: "x".join(t for t in samples if not t.endswith(CUT)) for name, (_, samples) in FORMATS.items()}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(CASES + [(n, JOINED[n]) for n in FORMATS]), st.lists(st.integers(0, 10_000), max_size=40),
       st.booleans())
def test_stream_equals_extract_for_random_splits(case, cuts, one_call):
    name, text = case
    parser = FORMATS[name][0](TOOLS, max_calls=1 if one_call else None)
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert join_events(_streamed(parser, pieces)) == parser.extract(text)


def test_the_joined_samples_have_every_call():
    for name, (cls, samples) in FORMATS.items():
        got = cls(TOOLS).extract(JOINED[name])
        want = [c for t in samples if not t.endswith(CUT) for c in _want(name, t).calls]
        assert got.calls == want, name


@pytest.mark.parametrize("name", list(FORMATS))
def test_max_calls_keeps_the_first_call_and_drops_the_others(name):
    cls, samples = FORMATS[name]
    text = next(iter(samples))  # (each format's first sample has two calls)
    got = cls(TOOLS, max_calls=1).extract(text)
    assert got == ExtractedToolCalls(None, _want(name, text).calls[:1])
    assert join_events(_streamed(cls(TOOLS, max_calls=1), list(text))) == got


def test_llama3_json_streams_a_call_at_its_header_and_its_arguments_as_they_come():
    s = Llama3JsonToolParser(TOOLS).stream()
    assert s.feed("Hi <|python") == ["Hi "]
    assert s.feed("_tag|> ") == []
    assert s.feed('{"name": "get_time", ') == []  # not yet a header
    assert s.feed('"parameters": {"zo') == [ToolCallDelta(0, name=T), ToolCallDelta(0, arguments='{"zo')]
    assert s.feed('ne": 1}}; {') == [ToolCallDelta(0, arguments='ne": 1}')]  # (the "; " is dropped)
    assert s.feed("x") == ["{", "x"]  # resolved: not a call
    assert s.finish() == [] and s.calls == 1


def test_mistral_streams_a_call_at_its_header_and_holds_other_elements():
    s = MistralToolParser(TOOLS).stream()
    assert s.feed("Ok [TOOL_") == ["Ok "]
    assert s.feed("CALLS] [") == []
    assert s.feed('{"name": "nope", "arguments": {}}, ') == []  # held: malformed (content if a call comes)
    assert s.feed('{"name": "get_weather", "arguments": {"ci') == [
        '{"name": "nope", "arguments": {}}', ToolCallDelta(0, name=W), ToolCallDelta(0, arguments='{"ci')]
    assert s.feed('ty": "Rome"}}]') == [ToolCallDelta(0, arguments='ty": "Rome"}')]
    assert s.finish() == [] and s.calls == 1


def test_pythonic_sends_each_call_whole_when_it_ends():
    s = PythonicToolParser(TOOLS).stream()
    assert s.feed("Ok [") == ["Ok "]
    assert s.feed('get_weather(city="Rome"') == []
    assert s.feed("), ") == [ToolCallDelta(0, name=W), ToolCallDelta(0, arguments='{"city": "Rome"}')]
    assert s.feed("get_time(zone=1)") == []  # (a "+ 1" may still come)
    assert s.feed("]") == [ToolCallDelta(1, name=T), ToolCallDelta(1, arguments='{"zone": 1}')]
    assert s.finish() == [] and s.calls == 2


@pytest.mark.parametrize("cls, text, cut", [
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Oslo"}', 40),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}', 52)])
def test_a_json_stream_cut_after_the_header_keeps_the_call_it_sent(cls, text, cut):
    """The documented difference (as with hermes): a call already sent stays sent when its object
    then never ends; extract keeps such a text as content."""
    parser = cls(TOOLS)
    assert join_events(_streamed(parser, [text[:cut], text[cut:]])) == ExtractedToolCalls(None, [
        ToolCall(W, '{"city": "Oslo"}')])
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    cut_args = text[:-4]  # inside the arguments (max_tokens)
    assert join_events(_streamed(parser, [cut_args])) == ExtractedToolCalls(None, [ToolCall(W, '{"city": "Os')])
    assert parser.extract(cut_args) == ExtractedToolCalls(cut_args, [])


@pytest.mark.parametrize("cls, piece", [
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"text": "' + 'word "quoted" and more ' * 400),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "nope", "arguments": {"text": "' + 'word \\"quoted\\" and more ' * 400),
    (PythonicToolParser, '[get_weather(text="""' + 'word "quoted" and more ' * 400)])
def test_a_long_call_is_scanned_once(cls, piece):
    """A call (or held element) that grows by small pieces is scanned once, not once per piece."""
    parser = cls(TOOLS)
    t = time.perf_counter()
    events = _streamed(parser, [piece[i:i + 3] for i in range(0, len(piece), 3)])
    assert time.perf_counter() - t < 1.0
    assert join_events(events) == join_events(_streamed(parser, [piece]))


HISTORY = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": W, "arguments": '{"city": "Paris", "days": [1, 2], '
                                                                             '"metric": true, "x": null}'}},
        {"id": "c2", "type": "function", "function": {"name": T, "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C."}]


@pytest.mark.parametrize("cls, written, result", [
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2], "metric": true, '
                           '"x": null}}; {"name": "get_time", "parameters": {}}', "21 C"),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
                        '"metric": true, "x": null}}, {"name": "get_time", "arguments": {}}]',
     "[TOOL_RESULTS] 21 C [/TOOL_RESULTS]"),
    (PythonicToolParser, '[get_weather(city="Paris", days=[1, 2], metric=True, x=None), get_time()]', "21 C")])
def test_history_as_text_writes_earlier_calls_in_the_format_and_reads_back(cls, written, result):
    got = cls.history_as_text(HISTORY)
    assert got[1] == {"role": "assistant", "content": written}
    assert got[2]["content"] == result and got[0] == HISTORY[0] and got[3] == HISTORY[3]
    assert cls(TOOLS).extract(written).calls == [
        ToolCall(W, json.dumps({"city": "Paris", "days": [1, 2], "metric": True, "x": None})), ToolCall(T, "{}")]
    assert "tool_calls" in HISTORY[1]  # (the input is not changed)


@pytest.mark.parametrize("cls, fmt", [
    (Llama3JsonToolParser, '{"name": <function-name>, "parameters": <arguments-object>}'),
    (MistralToolParser, '[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-object>}]'),
    (PythonicToolParser, "[func_name1(param1=value1, param2=value2), func_name2(param=value)]")])
def test_system_prompt_lists_the_tools_and_the_format(cls, fmt):
    text = cls.system_prompt(TOOLS)
    assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text and fmt in text


def test_the_parsers_are_named_and_the_tags_kept():
    assert {n: get_tool_parser(n) for n in ("hermes", "llama3_json", "mistral", "pythonic")} == TOOL_PARSERS
    assert Llama3JsonToolParser.tags == ("<|python_tag|>",) and MistralToolParser.tags == ("[TOOL_CALLS]",)
    assert PythonicToolParser.tags == ()
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'xml'; choose one of \['hermes', 'llama3_json', "
                                         r"'mistral', 'pythonic'\]"):
        get_tool_parser("xml")


# ------------------------------------------------------------------ behind the server, openai client
CHAT_TEMPLATE = ("{% if tools %}<s>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s>\n{% endif %}"
                 "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Weather and time?"}]
# a reply per format with text before, two calls (the city chosen by the model) and text after
REPLIES = {
    "llama3_json": (r'Let me look\. <\|python_tag\|>\{"name": "get_weather", "parameters": '
                    r'\{"city": "(Paris|Oslo|Rome)", "unit": "celsius"\}\}; \{"name": "get_time", "parameters": '
                    r'\{"zone": [1-9]\}\} Done\.'),
    "mistral": (r'Let me look\. \[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo|Rome)", '
                r'"unit": "celsius"\}\}, \{"name": "get_time", "arguments": \{"zone": [1-9]\}\}\] Done\.'),
    "pythonic": (r'Let me look\. \[get_weather\(city="(Paris|Oslo|Rome)", unit="celsius"\), get_time\(zone=[1-9]\)\] '
                 r'Done\.'),
}
# and one with a malformed call only: text, whole and streamed
MALFORMED = {
    "llama3_json": r'\{"name": "get_wind", "parameters": \{\}\}',
    "mistral": r'\[TOOL_CALLS\] \[\{"name": "get_wind", "arguments": \{\}\}\]',
    "pythonic": r'\[get_time\(zone=now\(\)\)\]',
}


@pytest.fixture(scope="module", params=list(FORMATS))
def format_client(request, tiny_model_dir):
    from kvserve.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir("llama")[0]), dtype="float32", num_blocks=256,
                                  block_size=4, max_model_len=512))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    with ServerThread(engine, names=["tiny"], tool_call_parser=request.param) as s:
        yield request.param, openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)


def test_each_format_over_http_whole_and_streamed(format_client):
    name, client = format_client
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in (W, T)]
    for seed in (0, 1):
        kw = dict(model="tiny", messages=MESSAGES, tools=tools, max_tokens=400, temperature=1.0, seed=seed,
                  extra_body={"structured_outputs": {"regex": REPLIES[name]}})
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert whole.message.content == "Let me look.  Done."
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
        assert [c[0] for c in calls] == [W, T]
        assert calls[0][1]["city"] in ("Paris", "Oslo", "Rome") and calls[0][1]["unit"] == "celsius"
        assert 1 <= calls[1][1]["zone"] <= 9
        content, s_calls, finishes = accumulate_chat_stream(client.chat.completions.create(stream=True, **kw),
                                                            no_text=('"name"', "python_tag", "TOOL_CALLS", "get_"))
        assert (content, finishes) == (whole.message.content, ["tool_calls"])
        assert [c[1:] for c in s_calls] == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    kw = dict(model="tiny", messages=MESSAGES, tools=tools, max_tokens=400, temperature=0,
              extra_body={"structured_outputs": {"regex": MALFORMED[name]}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    assert whole.message.content == MALFORMED[name].replace("\\", "")
    content, s_calls, finishes = accumulate_chat_stream(client.chat.completions.create(stream=True, **kw),
                                                        no_text=())
    assert (content, s_calls, finishes) == (whole.message.content, [], ["stop"])
