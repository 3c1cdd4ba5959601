"""Reasoning ("thinking") text in a reply → OpenAI-style ``reasoning_content``, whole or streamed.

Reasoning models write their thinking between ``<think>`` and ``</think>`` before the answer.
With ``kvserve serve --reasoning-parser NAME`` a chat reply's thinking goes to
``message.reasoning_content`` (``delta.reasoning_content`` when streaming, vLLM's shape) and
the rest to ``content``. :data:`REASONING_PARSERS` maps the names to parsers:

- ``deepseek_r1``: the reply *starts* in thinking (DeepSeek-R1's chat template ends the prompt
  with ``<think>\\n``, so the model often writes only the closing tag): everything before the
  first ``</think>`` is reasoning (a ``<think>`` tag the model writes there is dropped), the
  rest is content. A reply with no ``</think>`` is all reasoning (cut by max_tokens while thinking).
- ``qwen3``: thinking starts at the model's own ``<think>``: text before it and after the first
  ``</think>`` is content, text between them reasoning (a ``<think>`` never closed: reasoning
  to the end). A reply without ``<think>`` is all content (Qwen3 with thinking off).

Only the first thinking block is read: later tags stay in the content as written.

Both sides give the same answer: :meth:`ReasoningParser.extract` reads a finished text and
:meth:`ReasoningParser.stream` reads it in pieces (the detokenizer's deltas), holding back only
a possible partial tag at the end of a piece; the streamed pieces joined equal ``extract``
however the text is split (each character's side depends only on the text before it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

START, END = "<think>", "</think>"


@dataclass
class ExtractedReasoning:
    """A reply split into its reasoning and its content (each None when empty)."""

    reasoning_content: Optional[str]
    content: Optional[str]


class ReasoningStream:
    """Reads one reply in pieces: :meth:`feed` each text delta, then :meth:`finish` once.

    Each call returns ``(reasoning, content)``: the text to send now on each side (either may
    be ``""``). A piece that ends in what could be the start of a tag (``"</th"``) keeps it back
    until the next piece (or :meth:`finish`) says whether it is one.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._implicit = starts_in_reasoning
        self._state = "reasoning" if starts_in_reasoning else "before"  # before → reasoning → after
        self._start_seen = False
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text read so far ends inside the thinking block."""
        return self._state == "reasoning"

    def _tags(self) -> tuple[str, ...]:
        if self._state == "before":
            return (START,)
        if self._state == "reasoning":
            return (END,) if not self._implicit or self._start_seen else (END, START)
        return ()

    def feed(self, text: str) -> tuple[str, str]:
        """Read the next piece; returns the ``(reasoning, content)`` text it completes."""
        buf = self._held + text
        out = {"reasoning": [], "content": []}
        while buf:
            side = "reasoning" if self._state == "reasoning" else "content"
            tags = self._tags()
            if not tags:
                out[side].append(buf)
                buf = ""
                break
            hits = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
            if hits:
                i, tag = min(hits)
                out[side].append(buf[:i])
                buf = buf[i + len(tag):]
                if tag == END:
                    self._state = "after"
                elif self._state == "before":
                    self._state = "reasoning"
                else:  # the model's own opening tag inside the implicit block: dropped
                    self._start_seen = True
                continue
            keep = max((_partial_tag(buf, t) for t in tags), default=0)
            out[side].append(buf[:len(buf) - keep])
            buf = buf[len(buf) - keep:]
            break
        self._held = buf
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str]:
        """The end of the reply: a held-back partial tag is text after all."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "reasoning" else ("", held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Splits a model family's replies into reasoning and content.

    Attributes:
        name: the ``--reasoning-parser`` name.
        start, end: the tags around the thinking.
        starts_in_reasoning: the reply begins inside the thinking block (the chat template
            opened it).
    """

    name: ClassVar[str]
    start: ClassVar[str] = START
    end: ClassVar[str] = END
    starts_in_reasoning: ClassVar[bool]

    @classmethod
    def stream(cls) -> ReasoningStream:
        """A reader for one streamed reply."""
        return ReasoningStream(cls.starts_in_reasoning)

    @classmethod
    def extract(cls, text: str) -> ExtractedReasoning:
        """The reasoning and the content of a finished reply."""
        s = cls.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return ExtractedReasoning((r1 + r2) or None, (c1 + c2) or None)

    @classmethod
    def tags(cls) -> tuple[str, str]:
        return cls.start, cls.end


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the reply starts inside ``<think>``; reasoning ends at
    the first ``</think>``."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning is what the model writes between its own ``<think>`` and ``</think>``."""

    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: Optional[str]) -> Optional[type[ReasoningParser]]:
    """The parser named ``name`` (None: no parser).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}") from None


def keep_reasoning_tags(params: Any, parser: type[ReasoningParser], tokenizer: Any) -> Any:
    """``params`` (a :class:`~kvserve.sampling_params.SamplingParams`) with
    ``skip_special_tokens`` off when the parser's tags are special tokens of ``tokenizer``
    (else the text would lose them and nothing could be split).

    Returns:
        ``params`` itself when nothing changes, else a copy.
    """
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    if params.skip_special_tokens and special.intersection(parser.tags()):
        return dataclasses.replace(params, skip_special_tokens=False)
    return params
