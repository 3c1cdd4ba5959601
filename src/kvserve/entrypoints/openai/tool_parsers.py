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
however the text is split, except where a JSON call turns out malformed after it was sent
(see :class:`HermesToolParser`; the same holds for :class:`Llama3JsonToolParser` and
:class:`MistralToolParser`; :class:`PythonicToolParser` sends a call whole and has no exception).

A call's ``arguments`` is the JSON text of the arguments object exactly as the model wrote it
(checked to be JSON), so a streamed call's pieces add up to the non-streamed string (a Python
call's: ``json.dumps`` of its values).
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import unicodedata
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


# ------------------------------------------------- llama3_json, mistral, pythonic: shared parts
_JSON_STR = r'"(?:[^"\\\x00-\x1f]|\\.)*"'
_JSON_OUTSIDE = frozenset(" \t\n\r{}[]:,-+.0123456789eEtrufalsn")  # what JSON may hold outside strings
_HEADER_MAX = 512  # a call's header is at most this long (names are at most 64 characters)
_WAIT = object()


def _header(pattern: regex.Pattern, text: str, final: bool):
    """``pattern`` (a call's header) matched at the start of ``text``: the match, :data:`_WAIT`
    (more text may complete it), or None (it cannot). The answer depends on ``text`` only through
    the header's own characters, so a stream and a whole text decide the same."""
    m = pattern.match(text)
    if m is not None:
        return m if m.end() <= _HEADER_MAX else None
    if not final and len(text) < _HEADER_MAX and pattern.match(text, partial=True) is not None:
        return _WAIT
    return None


def _json_loads(text: str):
    """``json.loads`` without NaN / Infinity (not JSON).

    Raises:
        ValueError: not JSON.
    """
    def reject(c: str):
        raise ValueError(f"{c} is not JSON")
    return json.loads(text, parse_constant=reject)


class _Scan:
    """Follows JSON or Python text in pieces: string literals (escapes followed; with ``python``,
    single quotes and triple quotes too) and brackets, and says where the scanned item ends.

    ``value``: the item is one bracketed value; it ends after the bracket that closes it
    (``end = "done"``). Otherwise it ends before a ``,`` outside brackets (``"sep"``) or before
    a bracket of ``close`` outside brackets (``"close"``). Either way it ends before a character
    outside strings that cannot belong to it (``"broken"``): one not in ``allowed`` (when given),
    ``<`` (a special token), or a closing bracket that does not match.
    """

    def __init__(self, python: bool = False, value: bool = False, close: str = "",
                 allowed: Optional[frozenset] = None) -> None:
        self.python, self.value, self.close, self.allowed = python, value, close, allowed
        self.stack: list[str] = []  # the closing brackets expected
        self.quote = ""  # the open string's quote (", ', \"\"\" or '''); "" outside strings
        self.esc = False
        self.end: Optional[str] = None

    def consume(self, text: str, final: bool = False) -> int:
        """Follow ``text`` (what comes after the characters already followed); return how many of
        its characters were followed: all of them, unless the item ended (``end`` is set) or a
        quote at the very end may start or close a triple quote (then call again with it)."""
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == self.quote[0]:
                    if len(self.quote) == 3:
                        if i + 3 > n and not final:
                            return i
                        if text.startswith(self.quote, i):
                            self.quote = ""
                            i += 3
                            continue
                    else:
                        self.quote = ""
                i += 1
                continue
            if c == '"' or (self.python and c == "'"):
                if self.python:
                    if i + 3 > n and not final:
                        return i
                    if text.startswith(c * 3, i):
                        self.quote = c * 3
                        i += 3
                        continue
                self.quote = c
            elif c in "{[" or (self.python and c == "("):
                self.stack.append("}" if c == "{" else "]" if c == "[" else ")")
            elif c in "}])":
                if not self.stack:
                    self.end = "close" if c in self.close else "broken"
                    return i
                if self.stack.pop() != c:
                    self.end = "broken"
                    return i
                if self.value and not self.stack:
                    self.end = "done"
                    return i + 1
            elif c == "," and not self.stack and not self.value:
                self.end = "sep"
                return i
            elif c == "<" or (self.allowed is not None and c not in self.allowed):
                self.end = "broken"
                return i
            i += 1
        return n


class _FormatStream(ToolCallStream):
    """What the llama3_json, mistral and pythonic streams share: ``buf`` (the text not yet
    resolved), content whose leading whitespace waits for real text, and ``max_calls``.

    With ``strict`` the stream is the parser's :meth:`~ToolParser.extract`: the whole reply is
    in ``buf`` and :meth:`finish` runs once, and a call is checked whole before it is given;
    without it a call is sent as soon as its header is complete (the documented difference)."""

    def __init__(self, parser: "_FormatParser", strict: bool = False) -> None:
        self.p = parser
        self.strict = strict
        self.buf = ""
        self.calls = 0
        self.kept = 0  # well-formed calls seen (kept or dropped by max_calls)
        self.pending_ws = ""
        self.sent_text = False

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
        """A whole call: sent if there is room (else dropped)."""
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

    @abstractmethod
    def _run(self, out: list[Event], final: bool) -> None:
        """Resolve as much of ``buf`` as can be (all of it when ``final``), appending events."""


class _FormatParser(ToolParser):
    """A format read by one state machine: :meth:`stream` sends calls early, :meth:`extract`
    runs the same machine over the whole reply, checking each call whole first."""

    _stream_cls: ClassVar[type[_FormatStream]]

    def extract(self, text: str) -> ExtractedToolCalls:
        s = self._stream_cls(self, strict=True)
        s.buf = text
        return join_events(s.finish())

    def stream(self) -> _FormatStream:
        return self._stream_cls(self)


def _tool_calls_of(message: dict) -> list[tuple[str, object]]:
    """(name, arguments) of an assistant message's ``tool_calls``; the arguments as their JSON
    value when the string parses, else the string."""
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), args))
    return out


def _calls_as_text(messages: list[dict], write, tool_result=None) -> list[dict]:
    """``messages`` with each assistant message's ``tool_calls`` appended to its content as
    ``write(calls)`` and, with ``tool_result``, each ``tool`` message's content replaced by
    ``tool_result(content)``; the input is not changed."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = write(_tool_calls_of(m))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        elif m.get("role") == "tool" and tool_result is not None:
            m = {**m, "content": tool_result(m.get("content") or "")}
        out.append(m)
    return out


def _tools_listed(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


# -------------------------------------------------------------------- llama3_json
class Llama3JsonToolParser(_FormatParser):
    """Llama 3.x JSON calls (Meta's JSON tool calling; vLLM's ``llama3_json``):
    ``{"name": "f", "parameters": {...}}`` (``"arguments"`` is read too), optionally after
    ``<|python_tag|>``, several separated by ``;``, anywhere in the reply.

    A call is a JSON object whose first key is ``name`` (one of the tools), whose second is
    ``parameters`` or ``arguments`` (an object); later keys are ignored. Its arguments are
    the object as written. ``<|python_tag|>`` before a call (whitespace between) and a ``;``
    after one (whitespace around it) are dropped; the content is the rest. Anything else stays
    in the content: an object written another way, an unknown name, bad JSON, and a
    ``<|python_tag|>`` that no call follows (Llama's built-in tools).

    Streaming sends a call when ``{"name": "<a tool>", "parameters": {`` is complete, then its
    arguments as they come; a possible beginning of a call (a ``{`` or the tag) waits until it
    is resolved; other objects with such a header (an unknown name) are held until they end. A
    call already sent stays sent: if its object then turns out not to be JSON (cut by
    ``max_tokens`` or a stop string), the stream has the call, and drops the rest of the object
    up to where it breaks off, where :meth:`extract` keeps the text.
    """

    name = "llama3_json"
    TAG = "<|python_tag|>"
    tags = (TAG,)
    HEADER = regex.compile(r'\{\s*"name"\s*:\s*(' + _JSON_STR + r')\s*,\s*"(?:parameters|arguments)"\s*:\s*'
                           r'(?P<args>\{)')

    def _unit_call(self, unit: str) -> Optional[ToolCall]:
        """The call that a whole object ``unit`` is, or None."""
        m = self.HEADER.match(unit)
        if m is None or _json_string(m.group(1)) not in self.names:
            return None
        try:
            obj = _json_loads(unit)
            args, end = json.JSONDecoder().raw_decode(unit, m.start("args"))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(args, dict):
            return None
        return ToolCall(_json_string(m.group(1)), unit[m.start("args"):end])

    @classmethod
    def _write(cls, calls: list[tuple[str, object]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    @classmethod
    def history_as_text(cls, messages: list[dict]) -> list[dict]:
        """Assistant ``tool_calls`` appended to the content as ``{"name": ..., "parameters":
        ...}`` objects joined by ``; ``; other messages unchanged."""
        return _calls_as_text(messages, cls._write)

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        return ("You may call functions to answer the user. The functions, as JSON signatures:\n"
                f"{_tools_listed(tools)}\n\n"
                "To call a function, reply with a JSON object in the format "
                '{"name": <function-name>, "parameters": <arguments-object>} and nothing else; '
                "separate several calls with ';'. Do not use variables.")


class _Llama3Stream(_FormatStream):
    TEXT, AFTER_TAG, HEADER, ARGS, TAIL, UNIT, SEP, AFTER_SEP = range(8)

    def __init__(self, parser: Llama3JsonToolParser, strict: bool = False) -> None:
        super().__init__(parser, strict)
        self.state = self.TEXT
        self.prefix = ""  # the tag and whitespace before the object (dropped if it is a call)
        self.scan: Optional[_Scan] = None  # the whole object, from its "{"
        self.scanned = 0
        self.args: Optional[_Scan] = None  # a sent call's arguments
        self.pos = 0

    def _run(self, out: list[Event], final: bool) -> None:
        p = self.p
        while True:
            if self.state == self.TEXT:
                t, b = self.buf.find(p.TAG), self.buf.find("{")
                if t >= 0 and (b < 0 or t < b):
                    self._content(out, self.buf[:t])
                    self.prefix, self.buf, self.state = p.TAG, self.buf[t + len(p.TAG):], self.AFTER_TAG
                elif b >= 0:
                    self._content(out, self.buf[:b])
                    self.prefix, self.buf, self.state = "", self.buf[b:], self.HEADER
                else:
                    keep = 0 if final else _held_back(self.buf, p.TAG)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
            elif self.state == self.AFTER_TAG:
                rest = self.buf.lstrip(_WS)
                if not rest and not final:
                    return
                if rest.startswith("{"):
                    self.prefix += self.buf[:len(self.buf) - len(rest)]
                    self.buf, self.state = rest, self.HEADER
                else:  # not a call: the tag is text
                    self._content(out, self.prefix)
                    self.prefix, self.state = "", self.TEXT
            elif self.state == self.HEADER:
                m = _header(p.HEADER, self.buf, final)
                if m is _WAIT:
                    return
                if m is None:  # not a call: the "{" (and a tag before it) is text
                    self._content(out, self.prefix + "{")
                    self.prefix, self.buf, self.state = "", self.buf[1:], self.TEXT
                    continue
                name = _json_string(m.group(1))
                self.scan, self.scanned = _Scan(value=True, allowed=_JSON_OUTSIDE), 0
                if name in p.names and self._room() and not self.strict:
                    out.append(ToolCallDelta(self.calls, name=name))
                    self.args, self.pos = _Scan(value=True, allowed=_JSON_OUTSIDE), m.start("args")
                    self.state = self.ARGS
                else:
                    self.state = self.UNIT
            elif self.state == self.ARGS:
                n = self.args.consume(self.buf[self.pos:])
                if n:
                    out.append(ToolCallDelta(self.calls, arguments=self.buf[self.pos:self.pos + n]))
                self.pos += n
                if self.args.end is None and not final:
                    return
                self.calls += 1
                self.kept += 1
                self.state = self.TAIL
            elif self.state in (self.UNIT, self.TAIL):
                self.scanned += self.scan.consume(self.buf[self.scanned:], final)
                if self.scan.end is None and not final:
                    return
                unit, self.buf = self.buf[:self.scanned], self.buf[self.scanned:]
                done = self.scan.end == "done"
                if self.state == self.UNIT:
                    call = p._unit_call(unit) if done else None
                    if call is None:  # text, the tag before it too
                        self._content(out, self.prefix + unit)
                        self.prefix, self.state = "", self.TEXT
                        continue
                    self._call(out, call)
                self.prefix, self.state = "", self.SEP if done else self.TEXT
            elif self.state == self.SEP:  # after a call: a ";" and the whitespace around it are dropped
                rest = self.buf.lstrip(_WS)
                if not rest and not final:
                    return
                if rest.startswith(";"):
                    self.buf, self.state = rest[1:], self.AFTER_SEP
                else:
                    self.state = self.TEXT
            elif self.state == self.AFTER_SEP:
                self.buf = self.buf.lstrip(_WS)
                if not self.buf and not final:
                    return
                self.state = self.TEXT


Llama3JsonToolParser._stream_cls = _Llama3Stream


# ----------------------------------------------- lists of calls: mistral and pythonic
class _ListParser(_FormatParser):
    """A format whose calls come in a bracketed list, ``,`` between them, opened by
    ``OPEN_TAG`` (and what :meth:`_opening` accepts after it).

    A list with at least one well-formed call: each well-formed element is a call, each other
    element's text is content, and the rest (tag, brackets, commas) is dropped. A list with no
    well-formed call is content, all of it. A list that does not close ends with the reply, or
    where something outside strings cannot belong to it: a ``<`` (a special token), a bracket
    that does not match, and in JSON any character JSON does not allow there (the text from
    there on is read as text again). With ``FIRST_MUST_BE_CALL``, an opening whose first
    element does not start like a call is not a list at all (its tag is text).
    """

    OPEN_TAG: ClassVar[str]
    FIRST_MUST_BE_CALL: ClassVar[bool] = False
    STREAMED_ARGS: ClassVar[bool] = True  # a call is sent at its header, its arguments as they come
    HEADER: ClassVar[regex.Pattern]  # an element that starts like a call; group 1 its name, group "args"

    def _opening(self, text: str, final: bool):
        """After ``OPEN_TAG``: how many characters of ``text`` open the list, None (not a
        list), or :data:`_WAIT`."""
        return 0

    @abstractmethod
    def _header_name(self, m: regex.Match) -> Optional[str]:
        """The called name in a header match (None: not a name)."""

    @abstractmethod
    def _elem_scan(self) -> _Scan:
        """A scanner of one element, from its first character."""

    def _args_stream(self):
        """With ``STREAMED_ARGS``, the streamer of a sent call's arguments: ``consume(text,
        final) -> (characters followed, [argument pieces])`` and ``end`` (None, ``"done"`` or
        ``"broken"``)."""
        raise NotImplementedError

    @abstractmethod
    def _element_call(self, text: str) -> Optional[ToolCall]:
        """The call that an element's whole text is, or None."""


class _ListStream(_FormatStream):
    TEXT, OPEN, ELEM_START, ARGS, TAIL, ELEM = range(6)

    def __init__(self, parser: _ListParser, strict: bool = False) -> None:
        super().__init__(parser, strict)
        self.state = self.TEXT
        self.raw: Optional[list[str]] = None  # the list's text while it has no well-formed call
        self.bad: list[str] = []  # its malformed elements meanwhile
        self.first = True
        self.scan: Optional[_Scan] = None  # the element, from its first character (kept in buf)
        self.scanned = 0
        self.args = None
        self.pos = 0

    def _take(self, n: int) -> None:
        if self.raw is not None:
            self.raw.append(self.buf[:n])
        self.buf = self.buf[n:]

    def _well_formed(self, out: list[Event]) -> None:
        for b in self.bad:
            self._content(out, b)
        self.bad, self.raw = [], None

    def _end_list(self, out: list[Event]) -> None:
        if self.raw is not None:
            self._content(out, "".join(self.raw))
        self.raw, self.bad, self.state = None, [], self.TEXT

    def _not_a_list(self, out: list[Event]) -> None:
        raw = "".join(self.raw)
        n = len(self.p.OPEN_TAG)
        self._content(out, raw[:n])
        self.buf = raw[n:] + self.buf
        self.raw, self.bad, self.state = None, [], self.TEXT

    def _run(self, out: list[Event], final: bool) -> None:
        p = self.p
        while True:
            if self.state == self.TEXT:
                i = self.buf.find(p.OPEN_TAG)
                if i < 0:
                    keep = 0 if final else _held_back(self.buf, p.OPEN_TAG)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                self._content(out, self.buf[:i])
                self.buf, self.raw, self.bad = self.buf[i:], [], []
                self._take(len(p.OPEN_TAG))
                self.state = self.OPEN
            elif self.state == self.OPEN:
                n = p._opening(self.buf, final)
                if n is _WAIT:
                    return
                if n is None:
                    self._not_a_list(out)
                    continue
                self._take(n)
                self.state, self.first = self.ELEM_START, True
            elif self.state == self.ELEM_START:
                self._take(len(self.buf) - len(self.buf.lstrip(_WS)))
                must = self.first and p.FIRST_MUST_BE_CALL
                if not self.buf:
                    if not final:
                        return
                    self._end_list(out)
                    continue
                if self.buf[0] in ",]" and not must:
                    c = self.buf[0]
                    self._take(1)
                    if c == "]":
                        self._end_list(out)
                    continue
                m = _header(p.HEADER, self.buf, final)
                if m is _WAIT:
                    return
                if m is None and must:
                    self._not_a_list(out)
                    continue
                self.first = False
                self.scan, self.scanned = p._elem_scan(), 0
                name = p._header_name(m) if m is not None else None
                if name in p.names and self._room() and p.STREAMED_ARGS and not self.strict:
                    self._well_formed(out)
                    out.append(ToolCallDelta(self.calls, name=name))
                    self.args, self.pos = p._args_stream(), m.start("args")
                    self.state = self.ARGS
                else:
                    self.state = self.ELEM
            elif self.state == self.ARGS:
                n, pieces = self.args.consume(self.buf[self.pos:], final)
                out.extend(ToolCallDelta(self.calls, arguments=s) for s in pieces if s)
                self.pos += n
                if self.args.end is None and not final:
                    return
                self.calls += 1
                self.kept += 1
                self.state = self.TAIL
            elif self.state in (self.ELEM, self.TAIL):
                self.scanned += self.scan.consume(self.buf[self.scanned:], final)
                if self.scan.end is None and not final:
                    return
                text = self.buf[:self.scanned]
                if self.state == self.ELEM:
                    call = p._element_call(text)
                    if call is not None:
                        self._well_formed(out)
                        self._call(out, call)
                    elif self.raw is None:
                        self._content(out, text.strip(_WS))
                    else:
                        self.bad.append(text.strip(_WS))
                self._take(self.scanned)
                end = self.scan.end
                if end in ("sep", "close"):
                    self._take(1)
                if end == "sep":
                    self.state = self.ELEM_START
                else:
                    self._end_list(out)


_ListParser._stream_cls = _ListStream


# ------------------------------------------------------------------------ mistral
class _JSONArgs:
    """A sent call's JSON arguments object, streamed as written."""

    def __init__(self) -> None:
        self.scan = _Scan(value=True, allowed=_JSON_OUTSIDE)

    @property
    def end(self) -> Optional[str]:
        return self.scan.end

    def consume(self, text: str, final: bool) -> tuple[int, list[str]]:
        n = self.scan.consume(text, final)
        return n, [text[:n]]


class MistralToolParser(_ListParser):
    """Mistral calls (Mistral 7B Instruct v0.3 and other pre-v11 tokenizers; vLLM's ``mistral``):
    ``[TOOL_CALLS]`` then a JSON list of ``{"name": "f", "arguments": {...}}`` objects, after
    any content.

    An element is a call when it is a JSON object whose ``name`` is one of the tools and whose
    ``arguments`` (or ``parameters``) is an object (absent: ``{}``); other keys are ignored.
    Its arguments are the object as written when ``name`` comes first, else re-serialized.
    What a list without calls, malformed elements and a tag not followed by ``[`` become:
    see :class:`_ListParser`.

    Streaming sends a call when ``{"name": "<a tool>", "arguments": {`` is complete, then its
    arguments as they come; other elements are held until they end. A call already sent stays
    sent: if its element then turns out not to be JSON (cut by ``max_tokens`` or a stop
    string), the stream has the call, and drops the rest of the element up to where it breaks
    off (ending the list there), where :meth:`extract` keeps the text.
    """

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    OPEN_TAG = TAG
    tags = (TAG,)
    HEADER = regex.compile(r'\{\s*"name"\s*:\s*(' + _JSON_STR + r')\s*,\s*"(?:arguments|parameters)"\s*:\s*'
                           r'(?P<args>\{)')

    def _opening(self, text: str, final: bool):
        rest = text.lstrip(_WS)
        if not rest:
            return None if final else _WAIT
        return len(text) - len(rest) + 1 if rest[0] == "[" else None

    def _header_name(self, m: regex.Match) -> Optional[str]:
        return _json_string(m.group(1))

    def _elem_scan(self) -> _Scan:
        return _Scan(close="]", allowed=_JSON_OUTSIDE)

    def _args_stream(self) -> _JSONArgs:
        return _JSONArgs()

    def _element_call(self, text: str) -> Optional[ToolCall]:
        text = text.strip(_WS)
        try:
            obj = _json_loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.names:
            return None
        m = self.HEADER.match(text)
        if m is not None and _json_string(m.group(1)) == obj["name"]:  # as written (what a stream sends)
            _, end = json.JSONDecoder().raw_decode(text, m.start("args"))
            return ToolCall(obj["name"], text[m.start("args"):end])
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    @classmethod
    def _write(cls, calls: list[tuple[str, object]]) -> str:
        return f"{cls.TAG} " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    @classmethod
    def history_as_text(cls, messages: list[dict]) -> list[dict]:
        """Assistant ``tool_calls`` appended to the content as ``[TOOL_CALLS] [...]``, ``tool``
        results wrapped in ``[TOOL_RESULTS]`` / ``[/TOOL_RESULTS]``; other messages unchanged."""
        return _calls_as_text(messages, cls._write, lambda c: f"[TOOL_RESULTS] {c} [/TOOL_RESULTS]")

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        return ("You may call one or more functions to answer the user. The functions, as JSON signatures:\n"
                f"{_tools_listed(tools)}\n\n"
                "To call functions, write [TOOL_CALLS] followed by a JSON list of calls:\n"
                '[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-object>}]')


# ----------------------------------------------------------------------- pythonic
_PY_NAME = r"[^\W\d]\w*"
_PY_KW = regex.compile(r"\s*(" + _PY_NAME + r")\s*=[^=]")  # (the character after "=" rules out "==")


def _identifier(text: str) -> Optional[str]:
    """``text`` as Python reads an identifier (NFKC-normalized), or None (not one, or a keyword)."""
    name = unicodedata.normalize("NFKC", text)
    return name if name.isidentifier() and not keyword.iskeyword(name) else None


def _py_value(node: ast.AST):
    """The JSON value of a Python literal: constants (str, int, finite float, True/False/None,
    and JSON's true/false/null), lists and tuples, dicts with string keys, and negated numbers.

    Raises:
        ValueError: anything else (names, calls, operators, bytes, sets).
    """
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return _py_value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("dict keys must be strings")
            out[k.value] = _py_value(v)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def _py_parse(text: str) -> ast.AST:
    """The expression ``text`` (surrounding whitespace ignored).

    Raises:
        ValueError: not one Python expression.
    """
    try:
        return ast.parse(text.strip(_WS), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(str(e)) from None


def _py_text(value) -> str:
    """A JSON value written as a Python literal (the inverse of :func:`_py_value`)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_py_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py_text(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)  # (a JSON string or number is a Python literal too)


class PythonicToolParser(_ListParser):
    """Python-style calls (Llama 3.2 and 4, ToolACE; vLLM's ``pythonic``): a Python list of
    calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``, read with
    :mod:`ast` (nothing is evaluated), anywhere in the reply.

    An element is a call when it is ``name(key=value, ...)`` with ``name`` one of the tools,
    no positional arguments, no key twice, and literal values (strings, numbers,
    ``True``/``False``/``None`` or JSON's ``true``/``false``/``null``, lists, tuples, dicts
    with string keys); its arguments are those values as a JSON object (``json.dumps``). A
    ``[`` whose first element does not start like a call (``name(`` then ``)`` or ``key=``)
    is text (as are ``[1]`` and ``[a link](url)``); for a list that does: see :class:`_ListParser`.

    Streaming sends a call whole when its element ends (its ``,`` or ``]``, or the reply's end),
    checked as :meth:`extract` checks it, so a stream's calls and content equal the whole
    reply's for any split of the text, malformed and cut calls included. (The arguments of a
    Python call are whole values, not text to pass on as it comes.)
    """

    name = "pythonic"
    OPEN_TAG = "["
    FIRST_MUST_BE_CALL = True
    STREAMED_ARGS = False
    HEADER = regex.compile("(" + _PY_NAME + r")\s*\((?P<args>\s*(?:\)|" + _PY_NAME + r"\s*=[^=]))")

    def _header_name(self, m: regex.Match) -> Optional[str]:
        return _identifier(m.group(1))

    def _elem_scan(self) -> _Scan:
        return _Scan(python=True, close="]")

    def _element_call(self, text: str) -> Optional[ToolCall]:
        try:
            node = _py_parse(text)
        except ValueError:
            return None
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.names
                and not node.args):
            return None
        args: dict = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in args:
                return None
            try:
                args[kw.arg] = _py_value(kw.value)
            except ValueError:
                return None
        return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))

    @classmethod
    def _write(cls, calls: list[tuple[str, object]]) -> str:
        def one(name, args) -> str:
            if not isinstance(args, dict):
                args = {"arguments": args}
            return f"{name}(" + ", ".join(f"{k}={_py_text(v)}" for k, v in args.items()) + ")"
        return "[" + ", ".join(one(n, a) for n, a in calls) + "]"

    @classmethod
    def history_as_text(cls, messages: list[dict]) -> list[dict]:
        """Assistant ``tool_calls`` appended to the content as ``[f(a=1), g()]``; other messages
        unchanged. Arguments that are not a JSON object are written as ``arguments=...``."""
        return _calls_as_text(messages, cls._write)

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        return ("You may call one or more functions to answer the user. The functions, as JSON signatures:\n"
                f"{_tools_listed(tools)}\n\n"
                "To call functions, write them as a Python list of calls with keyword arguments and "
                "literal values, and nothing else:\n"
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)]")


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    c.name: c for c in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}
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
