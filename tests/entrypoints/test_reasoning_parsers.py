"""Reasoning parsers (entrypoints/openai/reasoning_parsers.py): the thinking of sample replies
read whole, and streamed over every split into two and three pieces (the pieces joined equal
the whole reading)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    ExtractedReasoning,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)

R1, Q3 = DeepSeekR1ReasoningParser, Qwen3ReasoningParser

# (text, deepseek_r1's reading, qwen3's reading)
SAMPLES = [
    ("<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
     ("\nLet me add: 2 + 2 = 4.\n", "\n\nThe answer is 4."), ("\nLet me add: 2 + 2 = 4.\n", "\n\nThe answer is 4.")),
    # the template opened <think>: the model writes only the closing tag
    ("Paris is in France.</think>Paris.", ("Paris is in France.", "Paris."), (None, "Paris is in France.</think>Paris.")),
    # cut by max_tokens while thinking
    ("<think>still thinking about", ("still thinking about", None), ("still thinking about", None)),
    ("no tags at all", ("no tags at all", None), (None, "no tags at all")),
    # text before the model's own <think> (kept: content for qwen3, reasoning for deepseek_r1)
    ("Sure. <think>hmm</think> Done.", ("Sure. hmm", " Done."), ("hmm", "Sure.  Done.")),
    # only the first block is read; look-alike tags are text
    ("<think>a < b, </thin k> <thinker></think>x<think>y</think>z",
     ("a < b, </thin k> <thinker>", "x<think>y</think>z"), ("a < b, </thin k> <thinker>", "x<think>y</think>z")),
    ("<think></think>", (None, None), (None, None)),
    ("Unicode: é 😀 東京<think>思考 ✓</think>答え 😀",
     ("Unicode: é 😀 東京思考 ✓", "答え 😀"), ("思考 ✓", "Unicode: é 😀 東京答え 😀")),
    # a partial tag at the very end is text
    ("<think>x</think>the end </thi", ("x", "the end </thi"), ("x", "the end </thi")),
    ("<thi", ("<thi", None), (None, "<thi")),
    ("", (None, None), (None, None)),
]


def streamed(parser, pieces: list[str]) -> tuple[str, str]:
    s = parser.stream()
    reasoning, content = [], []
    for p in pieces:
        r, c = s.feed(p)
        reasoning.append(r)
        content.append(c)
    r, c = s.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("text,r1,q3", SAMPLES)
def test_whole_replies(text, r1, q3):
    assert R1.extract(text) == ExtractedReasoning(*r1)
    assert Q3.extract(text) == ExtractedReasoning(*q3)


@pytest.mark.parametrize("parser", [R1, Q3])
@pytest.mark.parametrize("text", [s[0] for s in SAMPLES])
def test_every_split_in_two_and_three_equals_the_whole_reading(parser, text):
    whole = parser.extract(text)
    want = (whole.reasoning_content or "", whole.content or "")
    n = len(text)
    for i in range(n + 1):
        assert streamed(parser, [text[:i], text[i:]]) == want, i
    for i, j in itertools.combinations(range(n + 1), 2):
        assert streamed(parser, [text[:i], text[i:j], text[j:]]) == want, (i, j)
    assert streamed(parser, list(text)) == want  # one character at a time


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "a", " b\n", "é😀"]),
                max_size=12),
       st.lists(st.integers(0, 200), max_size=6))
def test_random_tag_soup_splits(tokens, cuts):
    text = "".join(tokens)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    for parser in (R1, Q3):
        whole = parser.extract(text)
        assert streamed(parser, pieces) == (whole.reasoning_content or "", whole.content or "")
        # nothing is lost but the tags the parser read
        r, c = whole.reasoning_content or "", whole.content or ""
        assert len(r) + len(c) <= len(text)


def test_partial_tags_are_held_back_only_while_they_may_be_tags():
    s = R1.stream()
    assert s.feed("abc</th") == ("abc", "")
    assert s.in_reasoning
    assert s.feed("ink>Hi") == ("", "Hi")
    assert not s.in_reasoning
    assert s.feed("</think> <") == ("", "</think> <")  # after the block: no more tags
    s = Q3.stream()
    assert s.feed("Hello <") == ("", "Hello ")
    assert s.feed("b") == ("", "<b")
    assert s.feed("<think") == ("", "")
    assert s.finish() == ("", "<think")


def test_get_reasoning_parser_and_the_server_option():
    from kvserve.entrypoints.cli import build_parser

    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser("qwen3") is Q3 and get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'; choose one of \['deepseek_r1', 'qwen3'\]"):
        get_reasoning_parser("granite")
    assert build_parser().parse_args(["serve"]).reasoning_parser is None
    assert build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])
