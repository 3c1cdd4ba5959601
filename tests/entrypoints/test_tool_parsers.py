"""Tool-call parsers (server/tool_parsers.py): Hermes ``<tool_call>`` blocks read whole and
streamed (the streamed events add up to the whole reading for every split of the text), and
the streams of grammar-forced ``required``/named replies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    HermesToolParser,
    NamedToolCallStream,
    RequiredToolCallStream,
    ToolCall,
    ToolCallDelta,
    forced_tool_calls,
    get_tool_parser,
    join_events,
)

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
P = HermesToolParser(TOOLS)

TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
             '</tool_call>')
BRACES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b{c \\"q\\" </tool_call> [", '
          '"nested": {"list": [1, {"x": "}"}], "empty": {}}}}\n</tool_call>')
UNICODE = ('Voilà 😀 <tool_call>{"name": "get_weather", "arguments": {"city": "東京", "note": "\\u00e9t\\u00e9"}}'
           '</tool_call> fin ✓')
MALFORMED = ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> and <tool_call>\n{bad json}\n</tool_call>'
             ' and <tool_call>{"name": "get_time", "arguments": "zone=2"}</tool_call>'
             '<tool_call>{"arguments": {"zone": -3}, "name": "get_time"}</tool_call> end')
SAMPLES = [TWO_CALLS, BRACES, UNICODE, MALFORMED,
           'a < b, <tool_ and <tool_call without a tag, then a real one:\n<tool_call>\n{"name": "get_time", '
           '"arguments": {"zone": 1}}\n',  # an unclosed block at the end that is complete JSON is a call
           '\n\n<tool_call>\n{"name": "get_time"}\n</tool_call>\n\n',  # no arguments: {}
           'no calls at all, just text </tool_call> "quoted',
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}',  # cut: the JSON never ended
           '   ', '']


def test_two_calls_with_text_before():
    got = P.extract(TWO_CALLS)
    assert got == ExtractedToolCalls("Let me check both.\n\n", [
        ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), ToolCall("get_time", '{"zone": 2}')])


def test_braces_and_closing_tags_inside_strings_stay_in_the_arguments():
    got = P.extract(BRACES)
    assert got.content is None and len(got.calls) == 1
    args = json.loads(got.calls[0].arguments)
    assert args == {"city": 'a}b{c "q" </tool_call> [', "nested": {"list": [1, {"x": "}"}], "empty": {}}}


def test_unicode_text_and_arguments_as_written():
    got = P.extract(UNICODE)
    assert got.content == "Voilà 😀  fin ✓"
    assert got.calls == [ToolCall("get_weather", '{"city": "東京", "note": "\\u00e9t\\u00e9"}')]
    assert json.loads(got.calls[0].arguments) == {"city": "東京", "note": "été"}


def test_malformed_blocks_stay_in_the_content():
    got = P.extract(MALFORMED)
    # unknown name, bad JSON, arguments not an object: text, tags and all; keys in another order: a call
    assert got.content == ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> and <tool_call>\n{bad json}'
                           '\n</tool_call> and <tool_call>{"name": "get_time", "arguments": "zone=2"}</tool_call> end')
    assert got.calls == [ToolCall("get_time", '{"zone": -3}')]


def test_no_calls_leaves_the_text_unchanged_and_whitespace_only_content_is_null():
    for text in ("just text", "   ", "", "a <tool_call> b"):
        assert P.extract(text) == ExtractedToolCalls(text, [])
    assert P.extract(SAMPLES[5]) == ExtractedToolCalls(None, [ToolCall("get_time", "{}")])
    assert P.extract(SAMPLES[4]).calls == [ToolCall("get_time", '{"zone": 1}')]
    assert P.extract(SAMPLES[4]).content.startswith("a < b, <tool_ and <tool_call without")
    assert P.extract(SAMPLES[7]) == ExtractedToolCalls(SAMPLES[7], [])


def test_max_calls_drops_the_later_calls():
    got = HermesToolParser(TOOLS, max_calls=1).extract(TWO_CALLS)
    assert got == ExtractedToolCalls("Let me check both.\n\n", [
        ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])


def _streamed(parser, pieces):
    s = parser.stream()
    events = []
    for piece in pieces:
        events += s.feed(piece)
    return events + s.finish()


# every sample except the one cut inside its arguments, whose call a stream has already sent
CONSISTENT = [s for s in SAMPLES if s != SAMPLES[7]]


@pytest.mark.parametrize("text", CONSISTENT)
def test_stream_equals_extract_for_every_split_in_two_and_three(text):
    want = P.extract(text)
    for i in range(len(text) + 1):
        assert join_events(_streamed(P, [text[:i], text[i:]])) == want, i
    step = max(1, len(text) // 25)
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert join_events(_streamed(P, [text[:i], text[i:j], text[j:]])) == want, (i, j)


# all in one text (the unclosed block last: followed by text it would be malformed, and already sent)
JOINED = "x".join(s for s in CONSISTENT if s != SAMPLES[4]) + "x" + SAMPLES[4]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CONSISTENT + [JOINED]), st.lists(st.integers(0, 10_000), max_size=40),
       st.integers(1, 2))
def test_stream_equals_extract_for_random_splits(text, cuts, max_calls):
    parser = HermesToolParser(TOOLS, max_calls=None if max_calls == 2 else 1)
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert join_events(_streamed(parser, pieces)) == parser.extract(text)


def test_stream_holds_back_a_partial_tag_and_sends_the_call_early():
    s = P.stream()
    assert s.feed("Hi <tool_") == ["Hi "]
    assert s.feed("x") == ["<tool_x"]  # resolved: not a tag
    assert s.feed(" <tool_call>\n") == [" "]
    assert s.feed('{"name": "get_weather", ') == []  # the header is not complete yet
    assert s.feed('"arguments": {"ci') == [ToolCallDelta(0, name="get_weather"), ToolCallDelta(0, arguments='{"ci')]
    assert s.feed('ty": "Rome"}}\n</tool_') == [ToolCallDelta(0, arguments='ty": "Rome"}')]
    assert s.feed("call>") == []
    assert s.finish() == [] and s.calls == 1


def test_a_stream_cut_after_the_header_keeps_the_call_it_sent():
    """The documented difference: extract keeps a block that never became JSON as text."""
    events = _streamed(P, [SAMPLES[7][:30], SAMPLES[7][30:]])  # the arguments ended, the object did not
    assert join_events(events) == ExtractedToolCalls(None, [ToolCall("get_weather", '{"city": "Oslo"}')])
    assert P.extract(SAMPLES[7]) == ExtractedToolCalls(SAMPLES[7], [])
    cut = SAMPLES[7][:-4]  # inside the arguments (max_tokens)
    assert join_events(_streamed(P, [cut])) == ExtractedToolCalls(None, [ToolCall("get_weather", '{"city": "Os')])
    assert P.extract(cut) == ExtractedToolCalls(cut, [])


def test_system_prompt_lists_the_tools_and_the_format():
    text = HermesToolParser.system_prompt(TOOLS)
    assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>' in text


def test_get_tool_parser():
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'xml'; choose one of \['hermes', "):
        get_tool_parser("xml")


REQUIRED = ('[{"name":"get_weather","parameters":{"city":"[x]}","unit":"celsius"}},'
            '{"name":"get_time","parameters":{"zone":-2}}]')


def test_forced_replies_give_the_arguments_as_generated():
    assert forced_tool_calls(REQUIRED, None) == [ToolCall("get_weather", '{"city":"[x]}","unit":"celsius"}'),
                                                 ToolCall("get_time", '{"zone":-2}')]
    assert forced_tool_calls('{"zone":3}', "get_time") == [ToolCall("get_time", '{"zone":3}')]
    with pytest.raises(ValueError):
        forced_tool_calls('[{"name":"get_time","parameters":{"zo', None)


@pytest.mark.parametrize("text, name", [(REQUIRED, None), ('{"zone":3}', "get_time")])
def test_forced_streams_equal_the_whole_reply_for_every_split(text, name):
    want = forced_tool_calls(text, name)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            s = NamedToolCallStream(name) if name else RequiredToolCallStream()
            events = s.feed(text[:i]) + s.feed(text[i:j]) + s.feed(text[j:]) + s.finish()
            assert join_events(events) == ExtractedToolCalls(None, want), (i, j)
            assert s.calls == len(want)


def test_a_long_unclosed_block_is_scanned_once():
    """A block that never closes is held as it grows; each feed scans only the new text (a rescan
    of the held text per token took 8.3 s here for these 5,608 feeds; now ~10 ms)."""
    import time

    text = "<tool_call>" + 'word "quoted" and more text ' * 800 + "</tool_call> after"
    t = time.perf_counter()
    events = _streamed(P, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert time.perf_counter() - t < 1.0
    assert join_events(events) == ExtractedToolCalls(text, [])


def test_the_server_option_names_the_parsers():
    from kvserve.entrypoints.cli import build_parser
    from kvserve.entrypoints.openai import build_app

    assert build_parser().parse_args(["serve"]).tool_call_parser == "hermes"
    assert build_parser().parse_args(["serve", "--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    for name in ("llama3_json", "mistral", "pythonic"):
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "xml"])
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        build_app(None, ["m"], tool_call_parser="xml")  # (checked before the engine is touched)


def test_history_as_text_writes_earlier_tool_turns_as_blocks():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C."}]
    got = HermesToolParser.history_as_text(history)
    assert got[0] == history[0] and got[3] == history[3]
    assert got[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                      '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "not json"}\n'
                      '</tool_call>'}
    assert got[2] == {"role": "tool", "tool_call_id": "c1", "content": "<tool_response>\n21 C\n</tool_response>"}
    assert P.extract(got[1]["content"]).calls == [ToolCall("get_weather", '{"city": "Paris"}')]  # (round trip)
    assert "tool_calls" in history[1]  # (the input is not changed)
