"""The OpenAI-compatible HTTP API on FastAPI.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /ready, GET /metrics, POST /tokenize, POST /detokenize, GET /version; the web page (``/``,
its dashboard's ``/dashboard/stats``) and the API docs (``/docs``), all offline
(:mod:`kvserve.entrypoints.openai.web`). Request-level guards (the Host check, JSON-only bodies,
CORS, the key on /metrics and the docs, list caps, tool schemas, liveness, time-outs) are in
:mod:`kvserve.entrypoints.openai.guards`.

A handler parses and checks the request (strict types, value ranges, prompt size) on the
event loop, tokenizes in a worker thread, hands the token ids to the :class:`AsyncEngine`
and turns the engine's :class:`RequestOutput` updates into OpenAI's JSON shapes, or into
server-sent events ending in ``data: [DONE]``. A client that disconnects has its request
aborted at once (its KV blocks are freed before the engine's next step).

Tool calls (chat): ``tool_choice`` ``"required"`` or a named function is generated under the
tools' schemas; ``"auto"`` (the default when ``tools`` are given) lets the model write freely,
and the server's tool-call parser (``--tool-call-parser``, :mod:`kvserve.entrypoints.openai.tool_parsers`)
reads its calls into ``message.tool_calls``; all three stream as OpenAI's ``delta.tool_calls``.
A chat template that ignores ``tools`` gets them under "auto" as a system message in the
parser's format.

Reasoning (chat, ``--reasoning-parser``, :mod:`kvserve.entrypoints.openai.reasoning_parsers`):
the reply's thinking goes to ``message.reasoning_content`` / ``delta.reasoning_content`` and
the rest to ``content`` (read by the tool-call parser after that). ``max_thinking_tokens``
bounds the thinking by budget forcing (as :func:`kvserve.inference_time.generate_with_thinking_budget`):
the reply is generated in two engine requests, the thinking (up to the budget or the model's
``</think>``) and, after a ``</think>`` appended when the budget ran out, the answer, under
the request's stop strings and structured output (which the thinking does not follow).

Server-wide defaults: ``chat_template`` replaces the model's chat template, and
``generation_defaults`` (the model's generation config) fill the sampling fields a request
leaves unset.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for an
invalid parameter (``param`` names it: an invalid JSON schema, regex or grammar names
``response_format``, ``structured_outputs`` or ``tools``), a prompt beyond the context window or
a request for what is not supported (OpenAI's deprecated ``functions``, tools on
/v1/completions, vLLM's removed ``guided_*`` fields; code ``unsupported_parameter``), 401
for a missing or wrong API key, 404 for an unknown model, 408 for a request past its time-out,
413 for an oversized body, 415 for a body that is not JSON, 503 when the waiting queue is full.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvserve.engine.llm_engine import LLMEngine, QueueFullError
from kvserve.entrypoints.openai.guards import (
    DEFAULT_HEALTH_TIMEOUT,
    check_caps,
    check_tool_schemas,
    engine_unhealthy,
    install_guards,
    request_deadline,
    timeout_error,
)
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.entrypoints.openai.quotas import ApiKeys, UserQuotas, api_key_users, find_key, request_tokens
from kvserve.core.request import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.core_client import CoreClient
from kvserve.engine.replica_client import ReplicaPool
from kvserve.entrypoints.openai.async_engine import AsyncEngine, EngineStoppedError, MPAsyncEngine
from kvserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ToolCallSpec,
    chat_messages,
    parse_request,
    structured_output_error,
    to_sampling_params,
    tool_call_spec,
)
from kvserve.entrypoints.openai.tokens import TokenTexts, safe_logprob
from kvserve.entrypoints.openai.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    NamedToolCallStream,
    RequiredToolCallStream,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
)
from kvserve.engine.tokenizer import apply_chat_template, chat_template_renders_tools
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser, keep_reasoning_tags
from kvserve.entrypoints.openai.web import add_web_routes

logger = logging.getLogger("kvserve.entrypoints.openai")

DEFAULT_MAX_BODY_BYTES = 32 << 20
MAX_BATCH_PROMPTS = 256
_DISCONNECTED = object()
_DRAINED = object()  # put on a live request's queue when the shutdown's grace period is over
#: (deadline, time-out) of the request being handled (set by _parse, read by _submit)
_DEADLINE: contextvars.ContextVar[Optional[tuple[float, float]]] = contextvars.ContextVar("deadline", default=None)
#: The request's name for the output-length field ("max_completion_tokens" in a chat request that
#: sent it), for the engine's errors about it.
_MAX_TOKENS_FIELD: contextvars.ContextVar[str] = contextvars.ContextVar("max_tokens_field", default="max_tokens")
#: the user name of the request's API key (set by _parse; None: the 'user' field names the user)
_KEY_USER: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("key_user", default=None)


#: Line separators of ``str.splitlines`` that JSON leaves raw (it escapes only U+0000-U+001F):
#: clients that split an event stream with ``splitlines`` semantics (httpx's ``iter_lines``)
#: would cut an event at them, so server-sent events carry them escaped.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    """One server-sent event: ``data: <JSON>`` and a blank line, on one line whatever the text
    holds (U+0085, U+2028 and U+2029 as JSON escapes)."""
    return f"data: {_dumps(obj).translate(_RAW_LINE_BREAKS)}\n\n"


class _AbortOnClose(StreamingResponse):
    """A streaming response that always runs ``on_close`` when it ends, however it ends
    (finished, client disconnected, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclasses.dataclass(eq=False)  # (hashed by identity: OpenAIServer._live)
class _Submitted:
    """The engine requests of one HTTP request (one per prompt) and their shared queue."""

    request_ids: list[str]
    prompt_ids: list[list[int]]
    queue: asyncio.Queue
    engine: AsyncEngine
    finished: set = dataclasses.field(default_factory=set)
    deadline: Optional[float] = None  # time.monotonic() past which the request times out (408)
    timeout: Optional[float] = None  # its time-out in seconds
    charge: Any = None  # what it holds of its user's quotas (quotas.Charge), released by _close

    def abort_unfinished(self) -> None:
        for i, rid in enumerate(self.request_ids):
            if i not in self.finished:
                self.engine.abort(rid)
                self.finished.add(i)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


@dataclasses.dataclass(eq=False)
class _ThinkingRelay(_Submitted):
    """A chat request under a thinking budget: its thinking and its answer are two engine
    requests, whose outputs a task relays to :attr:`queue` as one reply's (see
    :meth:`OpenAIServer._think_then_answer`). ``current`` is the engine request running."""

    current: str = ""
    task: Optional[asyncio.Task] = None

    def abort_unfinished(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if 0 not in self.finished:
            self.engine.abort(self.current)
            self.finished.add(0)


class OpenAIServer:
    """The API's state and handlers around one engine.

    ``quotas`` (a :class:`~kvserve.entrypoints.openai.quotas.UserQuotas`), ``health_timeout`` and
    ``request_timeout`` (attributes, set by :func:`build_app`): see
    :func:`~kvserve.entrypoints.openai.guards.engine_unhealthy` and
    :func:`~kvserve.entrypoints.openai.guards.request_deadline`.

    Args:
        engine: an :class:`LLMEngine` (stepped in a thread of this process, :class:`AsyncEngine`;
            from :meth:`start` on owned by that thread), a started
            :class:`~kvserve.engine.core_client.CoreClient` (the engine core in its own process,
            :class:`MPAsyncEngine`), or a :class:`~kvserve.engine.replica_client.ReplicaPool`
            (engine replicas on Ray Serve, :class:`~kvserve.entrypoints.openai.replica_engine.ReplicatedAsyncEngine`:
            the metrics then carry a ``replica`` label, ``/health`` lists the replicas).
        served_model_names: names clients may use in ``model``; the first is reported.
        api_key: when set, /v1/*, /tokenize and /detokenize need ``Authorization: Bearer KEY``:
            one key, several (each a user), or key → user name (see
            :mod:`kvserve.entrypoints.openai.quotas`).
        max_body_bytes: larger request bodies get 413 before they are read.
        tool_call_parser: the :data:`~kvserve.entrypoints.openai.tool_parsers.TOOL_PARSERS` name of the
            parser that reads the model's tool calls under ``tool_choice: "auto"``.
        reasoning_parser: the :data:`~kvserve.entrypoints.openai.reasoning_parsers.REASONING_PARSERS`
            name of the parser that moves a chat reply's thinking to ``reasoning_content`` (None: none).
        chat_template: a Jinja chat template used instead of the model's (None: the model's).
        generation_defaults: SamplingParams field → value, for the fields a request leaves
            unset (:func:`kvserve.engine.generation_config.generation_defaults`).

    Raises:
        ValueError: no served model name, or an unknown ``tool_call_parser`` or ``reasoning_parser``.
    """

    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    request_timeout: Optional[float] = None
    #: set by :meth:`drain`: new requests get 503, ``/ready`` answers 503
    draining: bool = False

    def __init__(self, engine: LLMEngine | CoreClient | ReplicaPool, served_model_names: Sequence[str], api_key: ApiKeys = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str = DEFAULT_TOOL_PARSER,
                 reasoning_parser: Optional[str] = None, chat_template: Optional[str] = None,
                 generation_defaults: Optional[dict] = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.tool_parser_cls = get_tool_parser(tool_call_parser)
        self.reasoning_parser_cls: Optional[type[ReasoningParser]] = get_reasoning_parser(reasoning_parser)
        self.chat_template = chat_template
        self.generation_defaults = dict(generation_defaults or {})
        self.engine = engine
        self.model_names = list(served_model_names)
        self.model_name = self.model_names[0]
        self.api_keys = api_key_users(api_key)  # key -> its user name (None: the 'user' field's)
        self.api_key = next(iter(self.api_keys), None)  # (a key, or None: no key needed)
        self.quotas = UserQuotas()  # (its limits: set by build_app)
        self.max_body_bytes = max_body_bytes
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        if isinstance(engine, ReplicaPool):  # engine replicas on Ray Serve
            from kvserve.entrypoints.openai.replica_engine import ReplicatedAsyncEngine

            self.metrics = ServerMetrics(self.model_name, replicas=engine.names)
            self.async_engine = ReplicatedAsyncEngine(engine, self.metrics)
        elif isinstance(engine, CoreClient):
            self.metrics = ServerMetrics(self.model_name)
            self.async_engine: AsyncEngine = MPAsyncEngine(engine, self.metrics)
        else:
            self.metrics = ServerMetrics(self.model_name)
            self.async_engine = AsyncEngine(engine, self.metrics)
        self.texts = TokenTexts(self.tokenizer)
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=16)
        # No prompt longer than this many characters can fit in max_model_len tokens.
        self.max_prompt_chars = self.max_model_len * max(longest, 16)
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
        self.created = int(time.time())
        self._live: set[_Submitted] = set()  # the HTTP requests in the engine (see drain)
        self.app = self._build_app()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.async_engine.start(asyncio.get_running_loop())
            self.dashboard.start()
            try:
                yield
            finally:
                await self.dashboard.stop()
                await asyncio.to_thread(self.async_engine.shutdown)
                self._tok_pool.shutdown(wait=False)

        app = FastAPI(title="kvserve", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError):
            return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException):
            err = APIError(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500 else "server_error")
            return JSONResponse(err.to_dict(), status_code=e.status_code)

        @app.exception_handler(Exception)
        async def internal_error(_: Request, e: Exception):
            logger.exception("internal error")
            err = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error")
            return JSONResponse(err.to_dict(), status_code=500)

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/ready")(self.ready)
        app.get("/metrics")(self.metrics_endpoint)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/version")(self.version)
        self.dashboard = add_web_routes(app, self)
        return app

    # -------------------------------------------------------------- helpers
    def _auth(self, request: Request) -> Optional[str]:
        """Check the API key; returns its user name (None: no key needed, or an unnamed one)."""
        if not self.api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        key = find_key(self.api_keys, token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        return self.api_keys[key]

    def _user(self, req) -> Optional[str]:
        """The request's user (quotas, fair share): its key's name where keys have names, else
        its 'user' field (see :mod:`kvserve.entrypoints.openai.quotas`)."""
        key_user = _KEY_USER.get()
        return key_user if key_user is not None else req.user

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the request body is {length} bytes; the limit is {self.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise APIError(413, f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # nobody to answer: no traceback, nothing submitted
            logger.debug("client disconnected while sending the request body (%d bytes received)", size)
            raise APIError(499, "client disconnected while sending the request body") from None
        return b"".join(chunks)

    async def _parse(self, cls, request: Request):
        _KEY_USER.set(self._auth(request))
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests; retry on another "
                           "instance", type="server_error", code="draining")
        body = await self._body(request)
        if len(body) > (1 << 20):  # big bodies are parsed off the event loop
            req = await asyncio.to_thread(parse_request, cls, body)
        else:
            req = parse_request(cls, body)
        check_caps(req, self.max_model_len)  # (400 naming a list that is too long)
        _DEADLINE.set(request_deadline(req, self.request_timeout))
        return req

    async def _next(self, sub: _Submitted) -> tuple:
        """The next ``(tag, output)`` of ``sub``'s queue.

        Raises:
            APIError: 408 when the request's time-out passes first, 503 when the server's
                shutdown ends it (:meth:`drain`); its requests are aborted.
        """
        if sub.deadline is None:
            item = await sub.queue.get()
        else:
            try:
                item = await asyncio.wait_for(sub.queue.get(), max(0.0, sub.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                sub.abort_unfinished()
                raise timeout_error(sub.timeout) from None
        if item[1] is _DRAINED:
            sub.abort_unfinished()
            raise APIError(503, "the server shut down before this request finished (its shutdown time-out "
                           "passed); retry on another instance", type="server_error", code="shutdown")
        return item

    def _check_chars(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt is {n_chars} characters long, but the model's context window is "
                f"max_model_len = {self.max_model_len} tokens, which no prompt of more than "
                f"{self.max_prompt_chars} characters fits; shorten the prompt",
                param=param, code="context_length_exceeded",
            )

    def _check_length(self, ids: Sequence[int], param: str) -> None:
        n = len(ids)
        if n >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt is {n} tokens, but the model's context window is max_model_len = "
                f"{self.max_model_len} tokens (a prompt may have at most {self.max_model_len - 1} tokens, "
                "to leave room for one generated token)",
                param=param, code="context_length_exceeded",
            )

    def _truncate(self, ids: list[int], text: Optional[str], params: SamplingParams) -> tuple[list[int], Optional[str]]:
        """``truncate_prompt_tokens`` applied to one prompt (see :meth:`LLMEngine.truncate_prompt`)."""
        try:
            return self.engine.truncate_prompt(ids, text, params.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens", code="invalid_value") from None

    def _encode_prompts(self, prompts: list, truncate: Optional[int]) -> list[list[int]]:
        """Token ids of a batch's prompts (in the tokenizer thread). Without truncation a
        prompt too long for the context stops the batch at once, before the rest is
        tokenized (the thread is shared by every request)."""
        out = []
        for i, p in enumerate(prompts):
            out.append(self.engine.encode(p) if isinstance(p, str) else list(p))
            if truncate is None:
                try:
                    self._check_length(out[-1], "prompt")
                except APIError as e:
                    raise (_in_batch(e, i) if len(prompts) > 1 else e) from None
        return out

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: Optional[int],
                         logprobs: Optional[int], renames: Optional[dict[str, str]] = None) -> SamplingParams:
        """The request's :class:`SamplingParams`, its structured-output grammar compiled (into the
        engine's cache, off the engine thread), in the tokenizer thread.

        Under ``tool_choice`` "auto" each tool's ``parameters`` is compiled too (checked as a
        schema, though nothing constrains the reply).

        Raises:
            APIError: 400 naming the field (an invalid schema, regex or grammar: the field that
                set it, ``response_format``, ``structured_outputs`` or ``tools``, with
                llguidance's message).
        """
        params = to_sampling_params(req, max_tokens, logprobs, self.tokenizer, renames, self.generation_defaults)
        tool = tool_call_spec(req) if isinstance(req, ChatCompletionRequest) else None
        if tool is not None:  # each function's parameters checked alone (auto: not compiled to a grammar)
            names = [t["function"]["name"] for t in tool.tools]
            check_tool_schemas(tool.tools, [names.index(tool.name)] if tool.name is not None else range(len(names)),
                               lambda schema: self.engine.structured_output.compile(
                                   StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
        if params.structured_outputs is not None:
            rf = req.response_format
            field = "response_format" if isinstance(rf, dict) and rf.get("type") != "text" else "structured_outputs"
            if tool is not None and tool.forced:
                field = "tools"
            try:
                self.engine.structured_output.compile(params.structured_outputs)
            except ValueError as e:
                raise structured_output_error(e, field) from None
        return params

    async def _in_tokenizer_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, fn, *args)

    def _engine_error(self, e: Exception, prompt_param: str) -> APIError:
        if isinstance(e, QueueFullError):
            return APIError(503, f"the server is overloaded: {e}; retry later", type="server_error",
                            code="queue_full")
        if isinstance(e, EngineStoppedError):
            return APIError(503, str(e), type="server_error", code="engine_unavailable")
        msg = str(e)
        if msg.startswith("kv_compression"):
            return APIError(400, msg, param="kv_compression", code="invalid_value")
        if "max_tokens" in msg and msg.startswith("prompt ("):
            field = _MAX_TOKENS_FIELD.get()
            return APIError(400, msg.replace("max_tokens", field), param=field, code="context_length_exceeded")
        if "max_model_len" in msg or "KV" in msg:
            return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
        field = re.match(r"[a-z_]+", msg)
        if field and field.group() in SamplingParams.__dataclass_fields__:  # "min_tokens (...) exceeds ..."
            return APIError(400, msg, param=field.group(), code="invalid_value")
        if msg.startswith("prompt"):
            return APIError(400, msg, param=prompt_param, code="invalid_value")
        return APIError(400, msg, code="invalid_value")

    async def _submit(self, base_id: str, prompts: list[list[int]], params: SamplingParams, priority: int,
                      cache_salt: Optional[str], arrival: float, prompt_param: str,
                      prompt_only: bool = False, streaming: bool = True, user: Optional[str] = None) -> _Submitted:
        """Hand every prompt to the engine, all or nothing: if one is rejected, none runs."""
        q: asyncio.Queue = asyncio.Queue()
        rids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        sub = _Submitted(rids, prompts, q, self.async_engine)
        deadline = _DEADLINE.get()
        if deadline is not None:
            sub.deadline, sub.timeout = deadline
        try:
            await self.async_engine.add_requests([(rid, ids, i) for i, (rid, ids) in enumerate(zip(rids, prompts))],
                                                 params, q, priority=priority, cache_salt=cache_salt, arrival=arrival,
                                                 prompt_only=prompt_only, streaming=streaming, user=user)
        except (ValueError, TypeError, QueueFullError, EngineStoppedError) as e:
            err = self._engine_error(e, prompt_param)
            index = getattr(e, "request_index", None)
            if len(prompts) > 1 and index is not None and err.status == 400:
                raise _in_batch(err, index) from None
            raise err from None
        return sub

    async def _collect(self, sub: _Submitted, request: Request) -> list[RequestOutput]:
        """Wait for every prompt's final output; abort all if the client goes away."""
        watcher = asyncio.create_task(_watch_disconnect(request, sub.queue))
        finals: list[Optional[RequestOutput]] = [None] * len(sub.request_ids)
        try:
            while not sub.done:
                tag, out = await self._next(sub)
                if out is _DISCONNECTED:
                    sub.abort_unfinished()
                    raise APIError(499, "client disconnected")
                if isinstance(out, Exception):
                    raise self._engine_error(out, "prompt")
                if out.error is not None:
                    raise _request_failed(out)
                if out.finished:
                    finals[tag] = out
                    sub.finished.add(tag)
        finally:
            watcher.cancel()
            self._close(sub)
        return finals  # type: ignore[return-value]

    async def _start(self, user: Optional[str], prompts: list[list[int]], params: SamplingParams,
                     submit: Callable[[], Any]) -> _Submitted:
        """Charge ``user``'s quotas (429 over one), then ``await submit()``: the live request."""
        charge = (self.quotas.charge(user, request_tokens(prompts, params, self.max_model_len))
                  if self.quotas.enabled else None)
        try:
            sub = await submit()
        except BaseException:
            self.quotas.release(charge)
            raise
        sub.charge = charge
        self._live.add(sub)
        return sub

    def _close(self, sub: _Submitted) -> None:
        """The end of an HTTP request's engine requests: the unfinished aborted, no longer live,
        its quotas released."""
        sub.abort_unfinished()
        self._live.discard(sub)
        self.quotas.release(sub.charge)

    @property
    def num_live_requests(self) -> int:
        """HTTP requests in the engine now (each of any number of prompts and samples)."""
        return len(self._live)

    async def drain(self, timeout: float) -> None:
        """The graceful shutdown's first part (SIGTERM): from now on new requests get 503 and
        ``/ready`` 503; the live ones may finish for up to ``timeout`` seconds; then each one
        left is aborted in the engine and ends with a 503 error (streamed: an error event, then
        ``data: [DONE]``). Returns once every live request has ended (or 5 s more passed)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._live:
            logger.warning("shutting down: waiting up to %g s for %d live request(s)", timeout, len(self._live))
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._live:
            logger.warning("shutdown time-out: ending %d live request(s) with an error", len(self._live))
            for sub in list(self._live):
                sub.queue.put_nowait((None, _DRAINED))
            deadline = loop.time() + 5.0
            while self._live and loop.time() < deadline:
                await asyncio.sleep(0.02)

    def _usage(self, sub: _Submitted, finals: Sequence[Optional[RequestOutput]]) -> dict:
        prompt = sum(len(p) for p in sub.prompt_ids)
        completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals if f is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _running_usage(sub: _Submitted, counts: dict, continuous: bool) -> dict:
        """``{"usage": ...}`` so far for ``stream_options.continuous_usage_stats``, else ``{}``."""
        if not continuous:
            return {}
        prompt = sum(len(p) for p in sub.prompt_ids)
        completion = sum(counts.values())
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    def _prompt_logprobs_field(self, out: RequestOutput) -> Optional[list]:
        """vLLM's ``prompt_logprobs``: per prompt position, {token_id: {logprob, rank, decoded_token}}."""
        if out.prompt_token_logprobs is None:
            return None
        res: list = []
        for tid, e in zip(out.prompt_token_ids, out.prompt_token_logprobs):
            if e is None:
                res.append(None)
                continue
            d = {str(tid): {"logprob": safe_logprob(e.logprob), "rank": e.rank, "decoded_token": self.texts.token_str(tid)}}
            for rank, (t, lp) in enumerate(e.top, start=1):
                d.setdefault(str(t), {"logprob": safe_logprob(lp), "rank": rank, "decoded_token": self.texts.token_str(t)})
            res.append(d)
        return res

    async def _stream(self, sub: _Submitted, req: CompletionRequest | ChatCompletionRequest, base: str, obj: str,
                      created: int, opening: list[dict], choice: Callable[[int, CompletionOutput], dict],
                      prompt_param: str) -> AsyncIterator[str]:
        """The server-sent events of a streamed completion or chat completion.

        One chunk per choice in ``opening``; then, as the engine's updates arrive, one chunk
        per sequence with new text or a finish reason (``choice(tag, output, request_output)``
        builds its choice; a choice's finish reason is sent once, in its last chunk), or an error event if
        the engine or this request fails inside it; the usage chunk when
        ``stream_options.include_usage``; ``data: [DONE]``. Unfinished requests are aborted
        however the stream ends.
        """
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": base, "object": obj, "created": created, "model": self.model_name}
        if include_usage:
            head["usage"] = None
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        counts: dict[tuple[int, int], int] = {}
        ended: set[tuple[int, int]] = set()  # choices whose finish_reason was sent
        finals: list[Optional[RequestOutput]] = [None] * len(sub.request_ids)
        try:
            for c in opening:
                yield _sse({**head, "choices": [c]})
            while not sub.done:
                try:
                    tag, out = await self._next(sub)
                except APIError as e:  # timed out: an error event, then [DONE]
                    yield _sse(e.to_dict())
                    break
                if isinstance(out, Exception):
                    yield _sse(self._engine_error(out, prompt_param).to_dict())
                    break
                if out.error is not None:
                    yield _sse(_request_failed(out).to_dict())
                    break
                if out.finished:
                    finals[tag] = out
                    sub.finished.add(tag)
                for o in out.outputs:
                    counts[(tag, o.index)] = len(o.token_ids)
                    if (tag, o.index) in ended or (not o.delta_text and o.finish_reason is None):
                        continue
                    cs = choice(tag, o, out)
                    cs = cs if isinstance(cs, list) else [cs]
                    if o.finish_reason is not None:
                        cs[-1]["stop_reason"] = o.stop_reason
                        ended.add((tag, o.index))
                    for c in cs:
                        yield _sse({**head, "choices": [c], **self._running_usage(sub, counts, continuous)})
            if include_usage and sub.done:
                yield _sse({**head, "choices": [], "usage": self._usage(sub, finals)})
            yield "data: [DONE]\n\n"
        finally:
            sub.abort_unfinished()

    # ------------------------------------------------------------ endpoints
    async def models(self, request: Request):
        self._auth(request)
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "kvserve",
                 "root": name, "max_model_len": self.max_model_len}
                for name in self.model_names]
        return {"object": "list", "data": data}

    async def health(self):
        states = getattr(self.async_engine, "replica_states", None)
        if states is not None:  # replicas: each one's state (200 while requests can be served)
            ok = engine_unhealthy(self.async_engine, self.health_timeout) is None
            return JSONResponse({"replicas": states(self.health_timeout)}, status_code=200 if ok else 503)
        err = engine_unhealthy(self.async_engine, self.health_timeout)
        if err is not None:
            return JSONResponse(err.to_dict(), status_code=503)
        return Response(status_code=200)

    async def ready(self):
        """Kubernetes' readiness probe: 200 while new requests can be served (the engine loaded,
        running, making progress, the server not draining), else 503."""
        err = engine_unhealthy(self.async_engine, self.health_timeout)
        if err is None and getattr(self, "draining", False):
            err = APIError(503, "the server is shutting down", type="server_error", code="draining")
        if err is not None:
            return JSONResponse(err.to_dict(), status_code=503)
        return Response(status_code=200)

    async def metrics_endpoint(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def version(self):
        return {"version": _version()}

    async def tokenize(self, request: Request):
        req: TokenizeRequest = await self._parse(TokenizeRequest, request)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            self._check_chars(len(req.prompt), "prompt")
            add = req.add_special_tokens
            ids = await self._in_tokenizer_thread(lambda: list(self.tokenizer.encode(req.prompt, add_special_tokens=add)))
        else:
            msgs = chat_messages(req.messages)
            self._check_chars(sum(len(m["content"]) for m in msgs), "messages")
            ids = await self._in_tokenizer_thread(self._render_chat, msgs, req.add_generation_prompt, False)
        res = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            res["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return res

    async def detokenize(self, request: Request):
        req: DetokenizeRequest = await self._parse(DetokenizeRequest, request)
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        text = await self._in_tokenizer_thread(self.tokenizer.decode, req.tokens)
        return {"prompt": text}

    # -------------------------------------------------------- completions
    async def completions(self, request: Request):
        arrival = time.perf_counter()
        req: CompletionRequest = await self._parse(CompletionRequest, request)
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _prompt_list(req.prompt)
        for p in prompts:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
        # echo with max_tokens = 0 returns only the prompt (and its logprobs: how lm-eval scores
        # loglikelihoods); the engine samples one token, which is dropped
        echo_only = bool(req.echo and req.max_tokens == 0)
        if echo_only and req.stream:
            raise APIError(400, "max_tokens=0 (echo the prompt only) is not supported with stream", param="max_tokens")
        # (off the event loop: bad_words are tokenized)
        params = await self._in_tokenizer_thread(self._sampling_params, req, 1 if echo_only else req.max_tokens,
                                                 req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        texts = [p if isinstance(p, str) else None for p in prompts]
        if any(t is not None for t in texts):
            ids_list = await self._in_tokenizer_thread(self._encode_prompts, prompts, params.truncate_prompt_tokens)
        else:
            ids_list = [list(p) for p in prompts]
        if params.truncate_prompt_tokens is not None:  # (left truncation, before the length check)
            cut = [self._truncate(ids, t, params) for ids, t in zip(ids_list, texts)]
            ids_list, texts = [c[0] for c in cut], [c[1] for c in cut]
        for i, ids in enumerate(ids_list):
            try:
                self._check_length(ids, "prompt")
            except APIError as e:
                raise (_in_batch(e, i) if len(ids_list) > 1 else e) from None
        base = f"cmpl-{uuid.uuid4().hex}"
        user = self._user(req)
        sub = await self._start(user, ids_list, params, lambda: self._submit(
            base, ids_list, params, req.priority, req.cache_salt, arrival, "prompt", echo_only,
            streaming=bool(req.stream), user=user))
        created = int(time.time())
        if req.echo:
            texts = [t if t is not None else self.tokenizer.decode(ids) for t, ids in zip(texts, ids_list)]
        if req.stream:
            gen = self._stream_completion(sub, req, params, base, created, texts)
            return _AbortOnClose(gen, lambda: self._close(sub))
        finals = await self._collect(sub, request)
        if echo_only:
            finals = [dataclasses.replace(out, outputs=[
                dataclasses.replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None,
                                    token_logprobs=[] if o.token_logprobs is not None else None,
                                    cumulative_logprob=0.0, finish_reason="length", stop_reason=None)
                for o in out.outputs]) for out in finals]
        choices = []
        for p, out in enumerate(finals):
            for o in out.outputs:
                text = o.text
                logprobs = None
                if req.logprobs is not None:
                    entries, token_ids = list(o.token_logprobs or []), list(o.token_ids)
                    if req.echo:
                        entries = list(out.prompt_token_logprobs or [None] * len(out.prompt_token_ids)) + entries
                        token_ids = list(out.prompt_token_ids) + token_ids
                    logprobs = self.texts.completion_logprobs(entries, token_ids, req.logprobs)
                if req.echo:
                    text = texts[p] + text
                choice = {"index": p * params.n + o.index, "text": text, "logprobs": logprobs,
                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_field(out)
                choices.append(choice)
        return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage(sub, finals)})

    def _stream_completion(self, sub: _Submitted, req: CompletionRequest, params: SamplingParams,
                           base: str, created: int, texts: list) -> AsyncIterator[str]:
        n = params.n
        sent_lp: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        opening = []
        # echo: the prompt's text opens each choice; with logprobs it comes with the first
        # generated text instead, since the prompt's logprobs are known only after prefill
        echo_later = set()
        if req.echo:
            for p, text in enumerate(texts):
                for i in range(n):
                    if req.logprobs is None:
                        opening.append({"index": p * n + i, "text": text, "logprobs": None, "finish_reason": None})
                    else:
                        echo_later.add((p, i))

        def choice(tag: int, o: CompletionOutput, out: RequestOutput) -> dict:
            key = (tag, o.index)
            logprobs, text = None, o.delta_text
            if req.logprobs is not None:
                start = sent_lp.get(key, 0)
                entries = (o.token_logprobs or [])[start:]
                sent_lp[key] = start + len(entries)
                token_ids = [e.token_id for e in entries]
                if key in echo_later:
                    echo_later.discard(key)
                    entries = list(out.prompt_token_logprobs or [None] * len(out.prompt_token_ids)) + entries
                    token_ids = list(out.prompt_token_ids) + token_ids
                    text = texts[tag] + text
                start_offset = offsets.get(key, 0)  # from the tokens' strings, as without streaming
                logprobs = self.texts.completion_logprobs(entries, token_ids, req.logprobs, start_offset)
                offsets[key] = start_offset + sum(len(t) for t in logprobs["tokens"])
            return {"index": tag * n + o.index, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason}

        return self._stream(sub, req, base, "text_completion", created, opening, choice, "prompt")

    # --------------------------------------------------------------- chat
    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                     tools: Optional[list[dict]] = None, history_as_text: bool = True) -> list[int]:
        """The prompt's token ids. A template that refuses tool turns (Gemma 3's: roles must
        alternate user/assistant) gets them as text: the calls as the tool parser's blocks
        (:meth:`ToolParser.history_as_text`, unless ``history_as_text`` is False: the caller has
        written them so already), the results as user turns (:meth:`ToolParser.alternating`).

        Raises:
            APIError: 400 (``messages``) when the template refuses the messages.
        """
        try:
            return self._apply_template(messages, add_generation_prompt, continue_final, tools)
        except APIError:
            raise
        except Exception as e:  # template errors (jinja raise_exception, unknown roles...) are the client's
            error = e
        if any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            as_text = self.tool_parser_cls.history_as_text(messages) if history_as_text else messages
            as_text = self.tool_parser_cls.alternating(as_text)
            try:
                return self._apply_template(as_text, add_generation_prompt, continue_final, tools)
            except APIError:
                raise
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        raise APIError(400, f"cannot apply the chat template to these messages: {error}", param="messages")

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                        tools: Optional[list[dict]]) -> list[int]:
        if continue_final:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                      continue_final_message=True, tools=tools,
                                                      chat_template=self.chat_template)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools, chat_template=self.chat_template)

    async def chat_completions(self, request: Request):
        arrival = time.perf_counter()
        req: ChatCompletionRequest = await self._parse(ChatCompletionRequest, request)
        self._check_model(req.model)
        msgs = chat_messages(req.messages, req.continue_final_message)
        self._check_chars(sum(len(m["content"]) for m in msgs), "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"logprobs": "top_logprobs" if req.top_logprobs is not None else "logprobs"}
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
            _MAX_TOKENS_FIELD.set("max_completion_tokens")
        tool = tool_call_spec(req)  # (400 for bad tools / tool_choice)
        parser, history_written = None, False
        if tool is not None and not tool.forced:
            parser = self.tool_parser_cls(tool.tools, tool.max_calls)
            if not chat_template_renders_tools(self.tokenizer, self.chat_template):  # the model would never see them
                msgs = _with_system_prompt(parser.history_as_text(msgs), parser.system_prompt(tool.tools))
                history_written = True
        params = await self._in_tokenizer_thread(self._sampling_params, req, max_tokens, k, renames)
        if parser is not None:
            params = keep_tool_tags(params, parser, self.tokenizer)
        reasoning = self.reasoning_parser_cls if tool is None or not tool.forced else None
        if reasoning is not None:
            params = keep_reasoning_tags(params, reasoning, self.tokenizer)
        self._check_thinking_budget(req, params, tool)
        add_gen = req.add_generation_prompt and not req.continue_final_message
        ids = await self._in_tokenizer_thread(self._render_chat, msgs, add_gen, req.continue_final_message,
                                              tool.tools if tool is not None else None, not history_written)
        ids, _ = self._truncate(ids, None, params)
        self._check_length(ids, "messages")
        base = f"chatcmpl-{uuid.uuid4().hex}"
        user = self._user(req)
        if req.max_thinking_tokens is not None:
            sub = await self._start(user, [ids], params, lambda: self._submit_thinking(base, ids, params, req, arrival,
                                                                                       user))
        else:
            sub = await self._start(user, [ids], params, lambda: self._submit(
                base, [ids], params, req.priority, req.cache_salt, arrival, "messages",
                streaming=bool(req.stream), user=user))
        created = int(time.time())
        echo = ""
        if req.echo and msgs[-1]["role"] == ("assistant" if add_gen else msgs[-1]["role"]):
            echo = msgs[-1]["content"]
        if req.stream:
            gen = self._stream_chat(sub, req, params, base, created, echo, tool, parser, reasoning)
            return _AbortOnClose(gen, lambda: self._close(sub))
        finals = await self._collect(sub, request)
        out = finals[0]
        choices = []
        for o in out.outputs:
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self.texts.chat_logprobs(o.token_logprobs or [], k or 0)}
            message = {"role": "assistant", "content": echo + o.text}
            text, thought = o.text, {}
            if reasoning is not None:  # the thinking apart (vLLM's reasoning_content), the rest as content
                split = reasoning.extract(o.text)
                text, thought = split.content or "", {"reasoning_content": split.reasoning_content}
                message = {"role": "assistant", "content": (echo + text) or None, **thought}
            finish = o.finish_reason
            if parser is not None:  # auto: the model's own tool-call format
                found = parser.extract(text)
                if found.calls:
                    content = None if found.content is None and not echo else echo + (found.content or "")
                    message = {"role": "assistant", "content": content, **thought, "tool_calls": [
                        {"id": new_tool_call_id(), "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}} for c in found.calls]}
                    if finish == "stop":
                        finish = "tool_calls"
            elif tool is not None and finish == "stop" and o.stop_reason is None:  # the grammar completed the call
                try:
                    calls = tool.tool_calls(o.text, new_tool_call_id)
                except (ValueError, KeyError, TypeError):  # (cannot happen under the grammar: kept as text)
                    calls = None
                if calls:
                    message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            choices.append({"index": o.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                            "stop_reason": o.stop_reason})
        body = {"id": base, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(sub, finals)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_field(out)
        return JSONResponse(body)

    def _stream_chat(self, sub: _Submitted, req: ChatCompletionRequest, params: SamplingParams,
                     base: str, created: int, echo: str, tool: Optional[ToolCallSpec] = None,
                     parser: Optional[ToolParser] = None,
                     reasoning: Optional[type[ReasoningParser]] = None) -> AsyncIterator[str]:
        """Chat chunks; with tools, each choice's text goes through a :class:`ToolCallStream`
        (auto: ``parser``'s; required/named: the grammar-forced JSON's), whose events become
        ``delta.content`` and ``delta.tool_calls`` chunks (OpenAI's shapes: a call's first
        chunk has its ``id``, ``type``, ``function.name`` and ``arguments: ""``, the next
        ones pieces of ``function.arguments``). With a ``reasoning`` parser, the thinking is
        sent first as ``delta.reasoning_content`` chunks and only the rest goes on as content."""
        k = req.top_logprobs or 0
        sent_lp: dict[int, int] = {}
        streams: dict[int, ToolCallStream] = {}
        thinking = {}
        opening = []
        for i in range(params.n):
            opening.append({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
            if echo:
                opening.append({"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None})

        def choice(tag: int, o: CompletionOutput, out: RequestOutput) -> dict:
            logprobs = None
            if req.logprobs:
                start = sent_lp.get(o.index, 0)
                entries = (o.token_logprobs or [])[start:]
                sent_lp[o.index] = start + len(entries)
                logprobs = {"content": self.texts.chat_logprobs(entries, k)}
            if tool is None and reasoning is None:
                delta = {"content": o.delta_text} if o.delta_text else {}
                return {"index": o.index, "delta": delta, "logprobs": logprobs, "finish_reason": o.finish_reason}
            text, thought = o.delta_text, ""
            if reasoning is not None:
                rs = thinking.get(o.index) or thinking.setdefault(o.index, reasoning.stream())
                thought, text = rs.feed(text) if text else ("", "")
                if o.finish_reason is not None:
                    more = rs.finish()
                    thought, text = thought + more[0], text + more[1]
            deltas = [{"reasoning_content": thought}] if thought else []
            finish = o.finish_reason
            if tool is None:
                deltas += [{"content": text}] if text else []
            else:
                stream = streams.get(o.index)
                if stream is None:
                    stream = streams[o.index] = (parser.stream() if parser is not None else
                                                 NamedToolCallStream(tool.name) if tool.name is not None else
                                                 RequiredToolCallStream())
                events = stream.feed(text) if text else []
                if finish is not None:
                    events += stream.finish()
                    if stream.calls and finish == "stop" and (parser is not None or o.stop_reason is None):
                        finish = "tool_calls"
                deltas += [_tool_delta(e) for e in events]
            if not deltas and (finish is not None or (logprobs and logprobs["content"])):
                deltas = [{}]
            chunks = [{"index": o.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if chunks:
                chunks[0]["logprobs"] = logprobs
                chunks[-1]["finish_reason"] = finish
            return chunks

        return self._stream(sub, req, base, "chat.completion.chunk", created, opening, choice, "messages")

    # ------------------------------------------------------ thinking budget
    def _check_thinking_budget(self, req: ChatCompletionRequest, params: SamplingParams,
                               tool: Optional[ToolCallSpec]) -> None:
        """400 naming ``max_thinking_tokens`` when the budget cannot apply: no reasoning parser
        (the end of the thinking is unknown), a value below 1 or of max_model_len or more,
        several samples or beams, or a reply forced into a tool call from its first token."""
        budget = req.max_thinking_tokens
        if budget is None:
            return
        if self.reasoning_parser_cls is None:
            raise APIError(400, "max_thinking_tokens needs a server started with --reasoning-parser (which says "
                                "where the thinking ends)", param="max_thinking_tokens", code="invalid_value")
        if not 1 <= budget < self.max_model_len:
            raise APIError(400, f"max_thinking_tokens must be an integer in [1, {self.max_model_len - 1}] "
                                f"(max_model_len - 1), got {budget}", param="max_thinking_tokens", code="invalid_value")
        if params.n != 1 or params.use_beam_search or (params.best_of or 1) > 1:
            raise APIError(400, f"max_thinking_tokens generates one reply per request (n=1, no best_of or beam "
                                f"search); got n={params.n}", param="max_thinking_tokens", code="invalid_value")
        if tool is not None and tool.forced:
            raise APIError(400, "max_thinking_tokens cannot be combined with a forced tool call (tool_choice "
                                "'required' or a named function)", param="max_thinking_tokens", code="invalid_value")

    async def _submit_thinking(self, base: str, ids: list[int], params: SamplingParams,
                               req: ChatCompletionRequest, arrival: float, user: Optional[str]) -> _ThinkingRelay:
        """Start a reply under ``req.max_thinking_tokens``: the thinking phase is submitted now
        (its errors are this request's), the rest runs in :meth:`_think_then_answer`."""
        end = self.reasoning_parser_cls.end
        end_ids = list(self.tokenizer.encode(end, add_special_tokens=False))
        room = self.max_model_len - len(ids) - len(end_ids) - 1  # the answer's prompt must fit, with one token
        budget = max(1, min(req.max_thinking_tokens, room, params.max_tokens or room))
        think = dataclasses.replace(params, max_tokens=budget, min_tokens=0, stop=[end], stop_token_ids=None,
                                    include_stop_str_in_output=True, structured_outputs=None)
        phase = await self._submit(base, [ids], think, req.priority, req.cache_salt, arrival, "messages", user=user)
        relay = _ThinkingRelay([base], [ids], asyncio.Queue(), self.async_engine, current=base)
        relay.task = asyncio.create_task(self._think_then_answer(relay, phase, ids, params, end, end_ids, req, user))
        return relay

    async def _think_then_answer(self, relay: _ThinkingRelay, phase: _Submitted, ids: list[int],
                                 params: SamplingParams, end: str, end_ids: list[int],
                                 req: ChatCompletionRequest, user: Optional[str]) -> None:
        """Relay the thinking's outputs as the reply's (not finished); then, with ``end``
        appended if the model did not write it (its EOS dropped), submit the answer from the
        prompt and the thinking (the prefix cache holds their K/V) with what is left of
        ``max_tokens`` and relay its outputs, text and token ids after the thinking's, as the
        reply's. A failure anywhere goes to the reply's queue as the engine's would."""
        put = relay.queue.put_nowait
        try:
            while True:
                _, out = await phase.queue.get()
                failed = isinstance(out, Exception) or out.error is not None
                if failed or out.outputs[0].finish_reason in ("abort", "error"):
                    put((0, out))
                    return
                o = out.outputs[0]
                if out.finished:
                    break
                put((0, out))
            phase.finished.add(0)
            thought = dataclasses.replace(o, finish_reason=None, stop_reason=None)
            put((0, dataclasses.replace(out, finished=False, outputs=[thought])))
            tokens = list(o.token_ids)
            forced = not (o.finish_reason == "stop" and o.stop_reason == end)
            if forced:  # the budget ran out, or the model ended (EOS) without the delimiter
                eos = set(self.engine.eos_token_ids)
                while tokens and tokens[-1] in eos:
                    tokens.pop()
                tokens += end_ids
            text = o.text + (end if forced else "")
            reply = dataclasses.replace(o, text=text, token_ids=tokens, delta_text=end if forced else "",
                                        finish_reason=None, stop_reason=None)
            left = None if params.max_tokens is None else params.max_tokens - len(tokens)
            if left is not None and left < 1:  # max_tokens spent on the thinking: no answer
                put((0, dataclasses.replace(out, outputs=[dataclasses.replace(reply, finish_reason="length")])))
                return
            if forced:
                put((0, dataclasses.replace(out, finished=False, outputs=[reply])))
            answer = params if left is None else dataclasses.replace(params, max_tokens=left,
                                                                     min_tokens=min(params.min_tokens, left))
            relay.current = f"{relay.request_ids[0]}-answer"
            second = await self._submit(relay.current, [ids + tokens], answer, req.priority, req.cache_salt,
                                        time.perf_counter(), "messages", user=user)
            while True:
                _, a = await second.queue.get()
                if isinstance(a, Exception) or a.error is not None:
                    put((0, a))
                    return
                second.finished.update([0] if a.finished else [])
                ao = a.outputs[0]
                logprobs = None if params.logprobs is None else (o.logprobs or []) + (ao.logprobs or [])
                combined = dataclasses.replace(ao, text=text + ao.text, token_ids=tokens + list(ao.token_ids),
                                               cumulative_logprob=o.cumulative_logprob + ao.cumulative_logprob,
                                               logprobs=logprobs)
                put((0, dataclasses.replace(a, request_id=relay.request_ids[0], prompt_token_ids=ids,
                                            outputs=[combined], num_cached_tokens=out.num_cached_tokens,
                                            prompt_logprobs=out.prompt_logprobs)))
                if a.finished:
                    return
        except APIError as e:
            put((0, ValueError(e.message)))
        except Exception as e:  # noqa: BLE001 - the client gets it as an error, not a hang
            logger.exception("the thinking-budget relay failed")
            put((0, e))


def keep_tool_tags(params: SamplingParams, parser: ToolParser, tokenizer: Any) -> SamplingParams:
    """``params`` with ``skip_special_tokens`` off when the parser's tags are special tokens of
    ``tokenizer`` (else the text would lose them and no call could be read; as vLLM's hermes
    parser does). The EOS or stop token that ends a reply still adds no text.

    Returns:
        ``params`` itself when nothing changes, else a copy.
    """
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    if params.skip_special_tokens and special.intersection(parser.tags):
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def _tool_delta(event) -> dict:
    """A chat chunk's ``delta`` for one :class:`ToolCallStream` event."""
    if isinstance(event, str):
        return {"content": event}
    assert isinstance(event, ToolCallDelta)
    if event.name is not None:
        return {"tool_calls": [{"index": event.index, "id": new_tool_call_id(), "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}


def _with_system_prompt(msgs: list[dict], text: str) -> list[dict]:
    """``msgs`` with ``text`` opening the system message (one is added if there is none)."""
    if msgs and msgs[0]["role"] == "system":
        first = msgs[0]["content"]
        return [{**msgs[0], "content": f"{text}\n\n{first}" if first else text}] + msgs[1:]
    return [{"role": "system", "content": text}] + msgs


def _in_batch(err: APIError, index: int) -> APIError:
    """``err`` about prompt ``index`` of a batch, saying which prompt it is."""
    return APIError(err.status, f"{err.message} (prompt {index} of the batch)", type=err.type, param=err.param,
                    code=err.code)


def _request_failed(out: RequestOutput) -> APIError:
    """The error of a request that failed inside the engine (the other requests went on): 400
    naming the field when its own input was at fault (``out.error_param``: a grammar that hit a
    limit of the structured-output backend while it ran), else 500."""
    if out.error_param is not None:
        return APIError(400, f"request {out.request_id}: {out.error_param} could not be followed: {out.error}",
                        param=out.error_param, code="invalid_value")
    return APIError(500, f"request {out.request_id} failed inside the engine: {out.error}", type="server_error",
                    code="internal_error")


def _prompt_list(prompt) -> list:
    """Normalize OpenAI's prompt forms (str, [str], [int], [[int]]) into a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    return list(prompt)


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Put ``_DISCONNECTED`` on ``q`` when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            q.put_nowait((None, _DISCONNECTED))
            return


def _version() -> str:
    from kvserve import __version__

    return __version__


def build_app(engine: LLMEngine | CoreClient | EngineArgs, served_model_names: Sequence[str] | str | None = None,
              api_key: ApiKeys = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              tool_call_parser: str = DEFAULT_TOOL_PARSER, reasoning_parser: Optional[str] = None,
              chat_template: Optional[str] = None, generation_defaults: Optional[dict] = None,
              health_timeout: float = DEFAULT_HEALTH_TIMEOUT, request_timeout: Optional[float] = None,
              max_requests_per_user: Optional[int] = None, max_tokens_in_flight_per_user: Optional[int] = None,
              **guard_options) -> FastAPI:
    """The FastAPI app serving ``engine``.

    ``engine`` is an :class:`LLMEngine` (its step loop runs in a thread of this process, started
    with the app's lifespan), a :class:`~kvserve.engine.core_client.CoreClient`, or
    :class:`EngineArgs`, from which a ``CoreClient`` is started now (the engine core in its own
    process; this returns once it has loaded the model). The lifespan's end stops the thread or
    the core process.

    The :class:`OpenAIServer` is at ``app.state.server``; the other arguments are its own, but
    ``guard_options``, which go to :func:`kvserve.entrypoints.openai.guards.install_guards` (Host
    check, content types, CORS, the key on /metrics and the docs, time-outs).

    Raises:
        ValueError: an unknown ``tool_call_parser`` or ``reasoning_parser``; from :class:`EngineArgs`, what the core
            raised while it built its engine (see :class:`CoreClient`).
    """
    client = None
    if isinstance(engine, EngineArgs):
        engine = client = CoreClient(engine)
    try:
        if served_model_names is None:
            served_model_names = [engine.model_config.name]
        elif isinstance(served_model_names, str):
            served_model_names = [served_model_names]
        server = OpenAIServer(engine, served_model_names, api_key, max_body_bytes, tool_call_parser,
                              reasoning_parser, chat_template, generation_defaults)
    except BaseException:
        if client is not None:
            client.shutdown(timeout=5.0)
        raise
    server.app.state.server = server
    server.health_timeout, server.request_timeout = health_timeout, request_timeout
    server.quotas = UserQuotas(max_requests_per_user, max_tokens_in_flight_per_user)
    install_guards(server, api_key=api_key, **guard_options)
    return server.app
