"""Request-level guards of the OpenAI server: browser-origin safety and list-size caps.

:class:`RequestGuard` is a plain ASGI middleware that runs before any route, so a refused
request costs no body read and no handler:

* **Host** (DNS rebinding): the ``Host`` header must name this server: an IP address (a page
  whose origin is an IP address is this server's own), ``localhost``, the ``--host`` value,
  this machine's host name, or a name in ``--allowed-hosts`` (``*`` allows any). Else 400
  naming the Host. A page on ``evil.example`` that rebinds its name to 127.0.0.1 sends
  ``Host: evil.example`` and is refused.
* **Content type** (CSRF by "simple" requests): the JSON POST endpoints take only
  ``application/json`` (parameters such as ``charset`` allowed); a browser cannot send that
  cross-origin without a CORS preflight, which is refused unless ``--allowed-origins`` is
  given. Else 415 naming the content type.
* **Key on the side doors**: with an API key, ``/metrics`` and the API docs (``/docs``,
  ``/openapi.json``) need it too, unless ``metrics_public``.

:func:`check_caps` bounds the lists a request may carry (:data:`CAPS`), so that no single
request costs seconds of CPU or hundreds of MB before it is even queued.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any, Iterable, Optional

from kvserve.entrypoints.openai.protocol import APIError
from kvserve.entrypoints.openai.quotas import api_key_users, find_key

#: The largest list (or string) each request field may carry. ``tools``: OpenAI's documented
#: limit (128 functions); ``logit_bias``: OpenAI's (300 entries); ``stop``: far beyond
#: OpenAI's 4 stop sequences, but each is matched against the text after every token;
#: ``bad_words``: each word is tokenized twice and checked at every step. ``tokens`` of
#: /detokenize is capped by the model's context window (``max_model_len``), see :func:`check_caps`.
CAPS: dict[str, int] = {
    "stop": 64,  # stop strings per request
    "stop_chars": 1024,  # characters per stop string
    "bad_words": 1000,  # words per request
    "bad_words_chars": 1024,  # characters per bad word
    "stop_token_ids": 1024,
    "allowed_token_ids": 1 << 20,  # (a vocabulary's worth: up to its size is meaningful)
    "logit_bias": 300,
    "tools": 128,
    "messages": 4096,
}

#: paths whose POST body is JSON (the content type is checked)
JSON_POST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
#: paths that need the API key when one is set, unless ``metrics_public``
SIDE_DOORS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def parse_allowed_hosts(values: Optional[Iterable[str]]) -> Optional[frozenset[str]]:
    """``--allowed-hosts`` values (each may be a comma list) as a set of lower-case names;
    None when ``*`` allows every host.

    Raises:
        ValueError: an empty name, or one with a port, a scheme or a path.
    """
    names: set[str] = set()
    for value in values or ():
        for name in value.split(","):
            name = name.strip().lower()
            if name == "*":
                return None
            if not name or "/" in name or (":" in name and not _is_ip(name.strip("[]"))):
                raise ValueError(f"--allowed-hosts: {name!r} is not a host name (give names such as "
                                 "'api.example.com' or '.example.com' for its subdomains, without scheme or port)")
            names.add(name.strip("[]"))
    return frozenset(names)


def parse_origins(values: Optional[Iterable[str]]) -> list[str]:
    """``--allowed-origins`` values (each may be a comma list): ``*`` or ``scheme://host[:port]``.

    Raises:
        ValueError: an origin without a scheme, or with a path.
    """
    out = []
    for value in values or ():
        for o in value.split(","):
            o = o.strip().rstrip("/")
            if o != "*" and (not o.startswith(("http://", "https://")) or "/" in o.split("://", 1)[1]):
                raise ValueError(f"--allowed-origins: {o!r} is not an origin (scheme://host[:port], e.g. "
                                 "'https://app.example.com', or '*')")
            out.append(o)
    return out


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header (no port, no brackets, lower case)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


class RequestGuard:
    """The ASGI middleware of the module's docstring.

    Args:
        app: the ASGI app it guards.
        bind_host: the ``--host`` value (always allowed as a Host).
        allowed_hosts: further allowed names (a leading dot allows the subdomains); None
            allows every Host.
        api_keys: the server's keys (empty: no key).
        metrics_public: leave ``/metrics`` and the docs open even with a key.
    """

    def __init__(self, app, bind_host: str = "127.0.0.1", allowed_hosts: Optional[frozenset[str]] = frozenset(),
                 api_keys: Iterable[str] = (), metrics_public: bool = False) -> None:
        self.app = app
        self.api_keys = {k: None for k in api_keys}
        self.metrics_public = metrics_public
        if allowed_hosts is None:
            self.names = None
        else:
            names = set(allowed_hosts) | LOOPBACK_NAMES | {host_name(bind_host)}
            try:  # (not getfqdn(): a DNS look-up, which can block for seconds)
                names.add(socket.gethostname().lower())
            except OSError:  # pragma: no cover
                pass
            self.names = frozenset(n for n in names if n)

    def host_allowed(self, host: str) -> bool:
        if self.names is None:
            return True
        name = host_name(host)
        if not name:
            return False
        if _is_ip(name) or name in self.names:
            return True
        return any(n.startswith(".") and (name.endswith(n) or name == n[1:]) for n in self.names)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        path = scope.get("path", "")
        host = headers.get("host", "")
        if not self.host_allowed(host):
            await _reply(send, APIError(
                400, f"the Host header {host!r} does not name this server; if it should, start the server with "
                     f"--allowed-hosts {host_name(host) or '<name>'}", code="host_not_allowed", param="Host"))
            return
        if scope.get("method") == "POST" and path in JSON_POST_PATHS:
            ctype = headers.get("content-type")
            media = (ctype or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                await _reply(send, APIError(
                    415, f"content-type {ctype!r} is not accepted: send the body as JSON with "
                         "'Content-Type: application/json'" if ctype is not None else
                         "content-type is missing: send the body as JSON with 'Content-Type: application/json'",
                    param="content-type", code="unsupported_media_type"))
                return
        if self.api_keys and not self.metrics_public and path in SIDE_DOORS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or find_key(self.api_keys, token.strip()) is None:
                await _reply(send, APIError(401, f"{path} needs the API key: send 'Authorization: Bearer <key>' "
                                                 "(or start the server with --metrics-public)",
                                            type="authentication_error", code="invalid_api_key"))
                return
        await self.app(scope, receive, send)


async def _reply(send, err: APIError) -> None:
    body = json.dumps(err.to_dict()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _too_many(field: str, n: int, cap: int, what: str) -> APIError:
    return APIError(400, f"{field} has {n} {what}; at most {cap} are allowed", param=field, code="too_many_items")


def check_caps(req: Any, max_model_len: int) -> None:
    """Refuse a parsed request whose lists exceed :data:`CAPS` (``tokens`` of /detokenize:
    ``max_model_len``).

    Raises:
        APIError: 400 naming the field.
    """
    stop = getattr(req, "stop", None)
    if isinstance(stop, list):
        if len(stop) > CAPS["stop"]:
            raise _too_many("stop", len(stop), CAPS["stop"], "strings")
    for s in [stop] if isinstance(stop, str) else stop or ():
        if len(s) > CAPS["stop_chars"]:
            raise APIError(400, f"stop: a stop string has {len(s)} characters; at most {CAPS['stop_chars']} "
                                "are allowed", param="stop", code="string_too_long")
    words = getattr(req, "bad_words", None) or ()
    if len(words) > CAPS["bad_words"]:
        raise _too_many("bad_words", len(words), CAPS["bad_words"], "words")
    for w in words:
        if len(w) > CAPS["bad_words_chars"]:
            raise APIError(400, f"bad_words: a word has {len(w)} characters; at most {CAPS['bad_words_chars']} "
                                "are allowed", param="bad_words", code="string_too_long")
    for field, what in (("stop_token_ids", "ids"), ("allowed_token_ids", "ids"), ("logit_bias", "entries"),
                        ("tools", "tools"), ("messages", "messages")):
        value = getattr(req, field, None)
        if isinstance(value, (list, dict)) and len(value) > CAPS[field]:
            raise _too_many(field, len(value), CAPS[field], what)
    tokens = getattr(req, "tokens", None)
    if isinstance(tokens, list) and len(tokens) > max_model_len:
        raise APIError(400, f"tokens has {len(tokens)} ids; at most max_model_len = {max_model_len} are allowed",
                       param="tokens", code="too_many_items")


def install_guards(server: Any, bind_host: str = "127.0.0.1", allowed_hosts: Optional[Iterable[str]] = None,
                   allowed_origins: Optional[Iterable[str]] = None, api_key: Any = None,
                   metrics_public: bool = False) -> None:
    """Wrap ``server.app`` (an :class:`~kvserve.entrypoints.openai.api.OpenAIServer`'s) in the
    guards: CORS (Starlette's ``CORSMiddleware``) only when ``allowed_origins`` are given,
    :class:`RequestGuard` outermost.

    ``allowed_hosts``/``allowed_origins`` are the option values (comma lists allowed; ``*``
    allows any).

    Raises:
        ValueError: a malformed host name or origin, naming the option.
    """
    hosts = parse_allowed_hosts(allowed_hosts)
    origins = parse_origins(allowed_origins)
    app = server.app
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type"], allow_credentials=False)
    app.add_middleware(RequestGuard, bind_host=bind_host, allowed_hosts=hosts,
                       api_keys=tuple(api_key_users(api_key)),
                       metrics_public=metrics_public)


# ------------------------------------------------------------------ tool schemas
def _pointer(schema: Any, ref: str) -> tuple[Optional[str], Any]:
    """The canonical path and the sub-schema of a local ``$ref`` (``#`` or ``#/a/b``);
    (None, None) when it is not local or does not resolve."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None, None
    node, parts = schema, [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p != ""]
    for p in parts:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return None, None
    return "/" + "/".join(parts), node


def looping_ref(schema: Any) -> Optional[str]:
    """The ``$ref`` of ``schema`` that leads back to itself without consuming any JSON (through
    ``$ref``, ``allOf``, ``anyOf``, ``oneOf`` only: ``{"$ref": "#"}``, or a definition that is
    one of its own alternatives), which no grammar can follow; None when there is none.
    Recursion through ``properties`` or ``items`` (a tree) is fine."""
    if not isinstance(schema, dict):
        return None
    state: dict[str, int] = {}  # path -> 1 on the stack, 2 done

    def visit(path: str, node: Any, depth: int) -> Optional[str]:
        if not isinstance(node, dict) or depth > 200:
            return None
        if state.get(path) == 1:
            return path or "#"
        if state.get(path) == 2:
            return None
        state[path] = 1
        edges = []
        if "$ref" in node:
            target_path, target = _pointer(schema, node["$ref"])
            if target_path is not None:
                edges.append((target_path.rstrip("/") if target_path != "/" else "", target))
        for key in ("allOf", "anyOf", "oneOf"):
            for j, sub in enumerate(node.get(key) or [] if isinstance(node.get(key), list) else []):
                edges.append((f"{path}/{key}/{j}", sub))
        for sub_path, sub in edges:
            found = visit(sub_path, sub, depth + 1)
            if found is not None:
                return found
        state[path] = 2
        return None

    # start from the root and from every sub-schema holding a $ref
    starts = [("", schema)]

    def walk(path: str, node: Any, depth: int) -> None:
        if depth > 64 or len(starts) > 10_000:
            return
        if isinstance(node, dict):
            if "$ref" in node and path:
                starts.append((path, node))
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            return
        for k, v in items:
            if k not in ("const", "enum", "default", "examples"):
                walk(f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}", v, depth + 1)

    walk("", schema, 0)
    for path, node in starts:
        found = visit(path, node, 0)
        if found is not None:
            return "#" + found if found != "#" else "#"
    return None


def check_tool_schemas(tools: list[dict], indices: Iterable[int], compile_schema) -> None:
    """Check the ``parameters`` of ``tools[i]`` for each ``i`` of ``indices``: no looping
    ``$ref`` (:func:`looping_ref`) and a schema the structured-output backend compiles
    (``compile_schema(schema)`` raises ``ValueError`` otherwise).

    Raises:
        APIError: 400 naming ``tools[i].function.parameters``.
    """
    from kvserve.entrypoints.openai.protocol import structured_output_error

    for i in indices:
        fn = tools[i]["function"]
        field = f"tools[{i}].function.parameters"
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        loop = looping_ref(schema)
        if loop is not None:
            raise APIError(400, f"tools[{i}] ({fn['name']}): the $ref at {loop} of the function's parameters leads "
                                "back to itself without any JSON in between; no reply can follow it",
                           param=field, code="invalid_value")
        try:
            compile_schema(schema)
        except ValueError as e:
            err = structured_output_error(e, "tools")
            raise APIError(400, f"tools[{i}] ({fn['name']}): {err.message}", param=field,
                           code="invalid_value") from None


# ------------------------------------------------------------- liveness and time-outs
DEFAULT_HEALTH_TIMEOUT = 60.0


def engine_unhealthy(async_engine: Any, health_timeout: float) -> Optional[APIError]:
    """Why ``/health`` (and ``/ready``) should answer 503, or None: the engine is not running,
    or it has made no step for ``health_timeout`` seconds while requests are pending (the
    step heartbeat, :attr:`AsyncEngine.stalled_for`)."""
    if not async_engine.is_running:
        return APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
    stalled = getattr(async_engine, "stalled_for", 0.0)
    if stalled > health_timeout:
        return APIError(503, f"the engine has made no step for {stalled:.1f} s while requests are pending "
                             f"(--health-timeout {health_timeout:g})", type="server_error", code="engine_stalled")
    return None


def request_deadline(req: Any, server_timeout: Optional[float]) -> Optional[tuple[float, float]]:
    """``(time.monotonic() deadline, time-out in seconds)`` of a request: the smaller of the
    server's ``--request-timeout`` and the request's own ``timeout`` field (seconds, > 0);
    None when neither is set.

    Raises:
        APIError: 400 naming ``timeout`` for a value that is not a positive number.
    """
    import time

    own = getattr(req, "timeout", None)
    if own is not None and not (0 < own < float("inf")):
        raise APIError(400, f"timeout must be a number of seconds > 0, got {own!r}", param="timeout",
                       code="invalid_value")
    limits = [t for t in (server_timeout, own) if t is not None]
    if not limits:
        return None
    t = float(min(limits))
    return time.monotonic() + t, t


def timeout_error(timeout: Optional[float]) -> APIError:
    """The 408 of a request that ran past its time-out."""
    return APIError(408, f"the request ran past its time-out of {timeout:g} s and was cancelled "
                         "(--request-timeout, or the request's 'timeout')", code="request_timeout")
