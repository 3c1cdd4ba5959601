"""Tool calls in generated text → OpenAI ``tool_calls``, whole or streamed.

A :class:`ToolParser` reads one model family's tool-call format (``tool_choice: "auto"``: the
model writes freely and may call tools); :data:`TOOL_PARSERS` maps the server's
``--tool-call-parser`` names to them. :class:`RequiredToolCallStream` and
:class:`NamedToolCallStream` read the grammar-forced JSON of ``tool_choice`` ``"required"`` and
a named function.

Both sides give the same answer: :meth:`ToolParser.extract` reads a finished text,
:meth:`ToolParser.stream` reads it in pieces (the incremental detokenizer's text deltas) and
emits *events*: ``str`` (content) and :class:`ToolCallDelta` (a call's name, then pieces of
its arguments). For a given text, the events joined (:func:`join_events`) equal ``extract``
however the text is split, except where a block turns out malformed after its call was sent
(see :class:`HermesToolParser`).

A call's ``arguments`` is the JSON text of the arguments object exactly as the model wrote it
(checked to be JSON), so a streamed call's pieces add up to the non-streamed string.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import regex

_WS = " \t\n\r"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (JSON text of an object)."""

    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A reply split into its content and its tool calls.

    Attributes:
        content: the text outside the calls; None when there are calls and no text outside
            them but whitespace (with no calls: the whole text, unchanged).
        calls: the calls, in order.
    """

    content: Optional[str]
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: its ``name`` (first piece only; ``arguments`` then
    ``""``), or the next piece of its ``arguments``."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


Event = Union[str, ToolCallDelta]


def join_events(events: list[Event]) -> ExtractedToolCalls:
    """The content and calls that a stream's events add up to."""
    content = "".join(e for e in events if isinstance(e, str))
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                names[e.index] = e.name
            args.setdefault(e.index, []).append(e.arguments)
    calls = [ToolCall(names[i], "".join(args[i])) for i in sorted(names)]
    if calls and not content.strip():
        return ExtractedToolCalls(None, calls)
    return ExtractedToolCalls(content, calls)


def new_tool_call_id() -> str:
    """A tool call id in vLLM's form, ``chatcmpl-tool-<32 hex>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_names(tools: list[dict]) -> list[str]:
    """The function names of OpenAI ``tools`` (already checked by the protocol layer)."""
    return [t["function"]["name"] for t in tools]


class ToolCallStream(ABC):
    """The streaming state of one reply.

    Attributes:
        calls: how many calls were sent so far.
    """

    calls: int = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events that the next piece of the reply's text makes certain."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The events of whatever was held back, at the end of the reply."""


class ToolParser(ABC):
    """A model family's tool-call format.

    Args:
        tools: the request's OpenAI tools (``[{"type": "function", "function": {"name", ...}}]``).
        max_calls: keep at most this many calls (``parallel_tool_calls: false``: 1); later
            well-formed calls are dropped (neither calls nor content). None: no limit.
    """

    name: ClassVar[str]
    tags: ClassVar[tuple[str, ...]] = ()  # the format's markers (kept in the text if they are special tokens)

    def __init__(self, tools: list[dict], max_calls: Optional[int] = None) -> None:
        self.tools = tools
        self.names = set(tool_names(tools))
        self.max_calls = max_calls

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a finished reply; malformed calls stay in the content as text."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new streaming state for one reply."""

    @classmethod
    @abstractmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        """A system message that describes ``tools`` and the call format, for chat templates
        that do not render ``tools`` themselves."""

    @staticmethod
    def alternating(messages: list[dict]) -> list[dict]:
        """For chat templates whose roles must alternate user/assistant (Gemma 3's), applied after
        :meth:`history_as_text`: ``tool`` messages become ``user`` turns, and each run of
        consecutive user or assistant turns is joined into one (a blank line between)."""
        out: list[dict] = []
        for m in messages:
            role = "user" if m.get("role") == "tool" else m.get("role")
            m = {k: v for k, v in m.items() if k not in ("tool_call_id", "name")} | {"role": role}
            if out and out[-1]["role"] == role and role in ("user", "assistant"):
                out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{m.get('content') or ''}"}
            else:
                out.append(m)
        return out

    @classmethod
    def history_as_text(cls, messages: list[dict]) -> list[dict]:
        """``messages`` with earlier tool turns written in the format, for chat templates that
        do not render ``tool_calls`` (the default: unchanged)."""
        return messages


# ---------------------------------------------------------------- scanning helpers
def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may
    become ``tag`` with more text)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _JSONStringState:
    """Whether a stream of characters is inside a JSON string literal (escapes followed)."""

    def __init__(self) -> None:
        self.in_str = self.esc = False

    def step(self, c: str) -> bool:
        """Follow one character; True when it belongs to a string literal (its quotes too)."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
            return True
        if c == '"':
            self.in_str = True
            return True
        return False


class _TagFinder:
    """Finds the first ``tag`` outside JSON strings (``\\`` escapes honoured) in a text that
    grows between calls (each call's text starts with the previous one), scanning each
    character once."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.pos = 0
        self.string = _JSONStringState()

    def find(self, text: str) -> int:
        """Index of the tag in ``text``, or -1 (not yet: a possible beginning of it at the end
        is looked at again next time)."""
        tag, i = self.tag, self.pos
        while i < len(text):
            c = text[i]
            if not self.string.step(c) and c == tag[0]:
                if text.startswith(tag, i):
                    self.pos = i
                    return i
                if tag.startswith(text[i:]):
                    break
            i += 1
        self.pos = i
        return -1


def _find_outside_strings(text: str, tag: str, start: int = 0) -> int:
    """Index of the first ``tag`` in ``text[start:]`` that is not inside a JSON string (string
    state followed from ``start``), or -1."""
    j = _TagFinder(tag).find(text[start:])
    return j + start if j >= 0 else -1


def _json_string(literal: str) -> Optional[str]:
    """The value of a JSON string literal, or None if it is not valid (a bad escape)."""
    try:
        return json.loads(literal)
    except ValueError:
        return None


class _JSONValueEnd:
    """Follows the characters of one JSON object or array and says where it ends (bracket
    depth outside strings); ``broken`` when a character cannot be JSON outside a string."""

    def __init__(self) -> None:
        self.depth = 0
        self.string = _JSONStringState()
        self.done = self.broken = False

    def consume(self, text: str) -> int:
        """Follow ``text``; return how many of its characters belong to the value (all of
        them unless it ended or broke inside ``text``)."""
        for i, c in enumerate(text):
            if self.string.step(c):
                continue
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
            elif c == "<":  # no JSON outside strings: a closing tag came before the value ended
                self.broken = True
                return i
        return len(text)


# -------------------------------------------------------------------- hermes
_HERMES_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"arguments"\s*:\s*\{')


class HermesToolParser(ToolParser):
    """Hermes-style calls (Hermes 2/3, Qwen2.5, Qwen3, SmolLM3 templates; vLLM's ``hermes``):
    ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` blocks anywhere in the
    reply, any number of them.

    A block is a call when its body (between the tags; an unclosed block at the very end of
    the reply counts) is a JSON object whose ``name`` is one of the tools and whose
    ``arguments`` is an object (or absent: ``{}``); other keys are ignored. A block ends at
    the first ``</tool_call>`` outside a JSON string. Anything else (bad JSON, an unknown
    name, arguments that are not an object) stays in the content, tags and all. The content
    is the text outside the calls.

    Streaming sends a call as soon as its header ``{"name": "<a tool>", "arguments": {`` is
    complete, then its arguments as they come; text outside blocks streams as content, except
    a possible beginning of ``<tool_call>`` at the end of what arrived, which waits until
    it is resolved. A block written in another way (keys in another order, no arguments) is
    held until it closes, then sent whole. A call already sent stays sent: if its arguments
    then turn out not to be JSON (a reply cut by ``max_tokens`` or a stop string, a broken
    model), the stream has the call with those arguments and drops the rest of the block,
    where :meth:`extract` would keep the whole block as text.
    """

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    tags = (OPEN, CLOSE)

    def _parse_block(self, body: str) -> Optional[ToolCall]:
        """The call in a block's body, or None if it is malformed."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return None
        m = _HERMES_HEADER.match(body)
        if m is not None and _json_string(m.group(1)) == obj["name"]:  # as written (what a stream sends)
            start = m.end() - 1
            _, end = json.JSONDecoder().raw_decode(body, start)
            return ToolCall(obj["name"], body[start:end])
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:i])
            body_start = i + len(self.OPEN)
            j = _find_outside_strings(text, self.CLOSE, body_start)
            body_end, end = (j, j + len(self.CLOSE)) if j >= 0 else (len(text), len(text))
            call = self._parse_block(text[body_start:body_end])
            if call is None:
                content.append(text[i:end])
            elif self.max_calls is None or len(calls) < self.max_calls:
                calls.append(call)
            pos = end
        out = "".join(content)
        if calls and not out.strip():
            return ExtractedToolCalls(None, calls)
        return ExtractedToolCalls(out, calls)

    def stream(self) -> "_HermesStream":
        return _HermesStream(self)

    @classmethod
    def history_as_text(cls, messages: list[dict]) -> list[dict]:
        """Assistant ``tool_calls`` appended to the content as ``<tool_call>`` blocks, ``tool``
        results wrapped in ``<tool_response></tool_response>`` (as Qwen's templates write them);
        other messages unchanged. A call's ``arguments`` string is written as its JSON value
        when it parses, else as the string."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                blocks = []
                for c in m["tool_calls"]:
                    fn = c.get("function", {}) if isinstance(c, dict) else {}
                    args = fn.get("arguments", {})
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except ValueError:
                            pass
                    call = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                    blocks.append(f"{cls.OPEN}\n{call}\n{cls.CLOSE}")
                text = "\n".join(blocks)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            elif m.get("role") == "tool":
                m = {**m, "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
            out.append(m)
        return out

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to answer the user. The functions, as JSON "
                f"signatures inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments inside "
                "<tool_call></tool_call> tags, one call per block:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')


class _HermesStream(ToolCallStream):
    TEXT, HEADER, ARGS, TAIL, BLOCK = range(5)

    def __init__(self, parser: HermesToolParser) -> None:
        self.p = parser
        self.state = self.TEXT
        self.buf = ""  # text not yet resolved (in HEADER/BLOCK: the block's body so far)
        self.calls = 0
        self.kept = 0  # well-formed calls seen (kept or dropped by max_calls)
        self.pending_ws = ""  # leading whitespace content, sent once real content comes
        self.sent_text = False
        self.scan: Optional[_JSONValueEnd] = None
        self.finder = _TagFinder(parser.CLOSE)

    def _content(self, out: list[Event], s: str) -> None:
        if not s:
            return
        if not self.sent_text and not s.strip(_WS):
            self.pending_ws += s
            return
        out.append(self.pending_ws + s)
        self.pending_ws, self.sent_text = "", True

    def _room(self) -> bool:
        return self.p.max_calls is None or self.kept < self.p.max_calls

    def _call(self, out: list[Event], call: ToolCall) -> None:
        if self._room():
            out.append(ToolCallDelta(self.calls, name=call.name))
            out.append(ToolCallDelta(self.calls, arguments=call.arguments))
            self.calls += 1
        self.kept += 1

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._run(out, final=True)
        if self.pending_ws and self.calls == 0:  # no calls: the text is the content, as written
            out.append(self.pending_ws)
        self.pending_ws = ""
        return out

    def _run(self, out: list[Event], final: bool) -> None:
        p = self.p
        while True:
            if self.state == self.TEXT:
                i = self.buf.find(p.OPEN)
                if i >= 0:
                    self._content(out, self.buf[:i])
                    self.buf, self.state = self.buf[i + len(p.OPEN):], self.HEADER
                    continue
                keep = 0 if final else _held_back(self.buf, p.OPEN)
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            if self.state == self.HEADER:
                m = _HERMES_HEADER.match(self.buf)
                if m is not None:
                    name = _json_string(m.group(1))
                    if name in p.names and self._room():
                        out.append(ToolCallDelta(self.calls, name=name))
                        self.buf, self.state = self.buf[m.end() - 1:], self.ARGS
                        self.scan = _JSONValueEnd()
                        continue
                elif not final and len(self.buf) <= 512 and _HERMES_HEADER.match(self.buf, partial=True):
                    return  # may still become a header (names are short: a longer one cannot)
                self.state, self.finder = self.BLOCK, _TagFinder(p.CLOSE)
                continue
            if self.state == self.ARGS:
                n = self.scan.consume(self.buf)
                if n:
                    out.append(ToolCallDelta(self.calls, arguments=self.buf[:n]))
                self.buf = self.buf[n:]
                if self.scan.done or self.scan.broken or final:
                    self.calls += 1
                    self.kept += 1
                    self.state, self.finder = self.TAIL, _TagFinder(p.CLOSE)
                    continue
                return
            if self.state == self.TAIL:  # after a sent call's arguments: skip to the end of the block
                j = self.finder.find(self.buf)
                if j >= 0:
                    self.buf, self.state = self.buf[j + len(p.CLOSE):], self.TEXT
                    continue
                if final:
                    self.buf = ""
                return  # (kept whole and scanned again with more text: a block's tail is short)
            if self.state == self.BLOCK:
                j = self.finder.find(self.buf)
                if j < 0 and not final:
                    return
                body = self.buf if j < 0 else self.buf[:j]
                end = len(self.buf) if j < 0 else j + len(p.CLOSE)
                call = p._parse_block(body)
                if call is None:
                    self._content(out, p.OPEN + self.buf[:end])
                else:
                    self._call(out, call)
                self.buf, self.state = self.buf[end:], self.TEXT
                continue


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
DEFAULT_TOOL_PARSER = HermesToolParser.name


def get_tool_parser(name: str) -> type[ToolParser]:
    """The :class:`ToolParser` class called ``name``.

    Raises:
        ValueError: no parser has that name (the message lists the choices).
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


# ------------------------------------------------- grammar-forced tool calls
class NamedToolCallStream(ToolCallStream):
    """``tool_choice`` naming a function: the whole reply is that function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if self.calls == 0:
            out.append(ToolCallDelta(0, name=self.name))
            self.calls = 1
        out.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> list[Event]:
        return []


_REQUIRED_ITEM = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"parameters"\s*:\s*[\{\[]')


class RequiredToolCallStream(ToolCallStream):
    """``tool_choice: "required"``: the reply is a JSON array of ``{"name", "parameters"}``
    objects (generated under a grammar, keys in that order); each becomes a call whose
    arguments are the ``parameters`` JSON as written. Text the grammar allows between items
    (whitespace, ``,``, ``[``, ``]``) is not content."""

    BETWEEN, ITEM, ARGS, TAIL = range(4)

    def __init__(self) -> None:
        self.state = self.BETWEEN
        self.buf = ""
        self.calls = 0
        self.scan: Optional[_JSONValueEnd] = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
            if self.state == self.BETWEEN:
                self.buf = self.buf.lstrip(_WS + "[,]")
                if not self.buf:
                    return out
                self.state = self.ITEM
            if self.state == self.ITEM:
                m = _REQUIRED_ITEM.match(self.buf)
                if m is None:
                    if _REQUIRED_ITEM.match(self.buf, partial=True) is None:
                        self.buf = ""  # (not the grammar's shape: nothing more to read)
                    return out
                out.append(ToolCallDelta(self.calls, name=_json_string(m.group(1)) or ""))
                self.buf, self.state, self.scan = self.buf[m.end() - 1:], self.ARGS, _JSONValueEnd()
            if self.state == self.ARGS:
                n = self.scan.consume(self.buf)
                if n:
                    out.append(ToolCallDelta(self.calls, arguments=self.buf[:n]))
                self.buf = self.buf[n:]
                if not (self.scan.done or self.scan.broken):
                    return out
                self.calls += 1
                self.state, self.finder = self.TAIL, _TagFinder("}")
            if self.state == self.TAIL:
                j = self.finder.find(self.buf)
                if j < 0:
                    return out
                self.buf, self.state = self.buf[j + 1:], self.BETWEEN

    def finish(self) -> list[Event]:
        if self.state == self.ARGS:  # cut inside the arguments: the call was sent
            self.calls += 1
            self.state = self.TAIL
        return []


def forced_tool_calls(text: str, name: Optional[str]) -> list[ToolCall]:
    """The calls of a finished grammar-forced reply (``name``: the named function, or None
    for ``"required"``'s array), arguments as written.

    Raises:
        ValueError: ``text`` is not JSON (a reply cut by ``max_tokens`` or a stop string).
    """
    json.loads(text)
    stream: ToolCallStream = NamedToolCallStream(name) if name is not None else RequiredToolCallStream()
    return join_events(stream.feed(text) + stream.finish()).calls
