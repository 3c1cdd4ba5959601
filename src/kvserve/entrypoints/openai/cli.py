"""``kvserve serve [MODEL]``: the OpenAI-compatible server (and its web page) on uvicorn."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Callable, Optional

#: ``kvserve serve``'s default ``--max-waiting``: this many times ``--max-num-seqs`` (a full
#: batch runs while a few more batches' worth of requests wait; more get 503 at once instead of
#: waiting minutes)
MAX_WAITING_PER_SEQ = 4


def add_parsers(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None],
                engine_kwargs: Callable[[argparse.Namespace], dict]) -> None:
    """Register ``serve`` on the ``kvserve`` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve the OpenAI API (completions, chat, metrics) and a web page "
                                            "(chat, dashboard) over HTTP")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vllm serve takes it (or --model): a .gguf file, a Hugging Face folder, or a "
                        "Hugging Face repository id (org/name) already in the local cache ($HF_HOME/hub)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model file's name); the first is reported")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: none); repeat it for several keys, "
                        "each then a user of its own for the per-user limits and the scheduler's fair share")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read API keys from FILE, one per line, 'NAME:KEY' to name the key's user (lines starting "
                        "with # skipped); with several keys or named ones a request's user is its key's, and its "
                        "'user' field is ignored")
    g = p.add_argument_group("per-user limits (a user: the key's, else the request's 'user' field; "
                             "requests without one are one anonymous user)")
    g.add_argument("--max-requests-per-user", type=int, default=None, metavar="N",
                   help="most requests of one user in flight; more get 429 with Retry-After (default: no limit)")
    g.add_argument("--max-tokens-in-flight-per-user", type=int, default=None, metavar="N",
                   help="most tokens of one user's requests in flight, each counting its prompt tokens + "
                        "max_tokens × n (without max_tokens: the rest of the context); more get 429 with "
                        "Retry-After, a request over it alone 400 (default: no limit)")
    g.add_argument("--max-num-seqs-per-user", type=int, default=None, metavar="N",
                   help="the most sequences (samples of n count) one user runs at once; the rest of its samples "
                        "and requests wait, so that one user's n=128 burst cannot make every step slow; a wider "
                        "beam search gets 400 (default: no cap, only the fair share of --max-num-seqs)")
    g = p.add_argument_group("browser-origin safety")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="NAMES",
                   help="host names clients may send in the Host header besides IP addresses, localhost, --host and "
                        "this machine's name (repeatable or a comma list; '.example.com' allows its subdomains; "
                        "'*' allows any). Other Hosts get 400: a DNS-rebinding web page cannot reach the server")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="web origins (scheme://host[:port], repeatable or a comma list, '*' for any) whose pages "
                        "may call the API from a browser (CORS); default: none, CORS off")
    g.add_argument("--metrics-public", action="store_true",
                   help="leave /metrics and the API docs (/docs, /openapi.json) open when --api-key is set "
                        "(default: they need the key too)")
    g = p.add_argument_group("time-outs and liveness")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="cancel a request (freeing its KV blocks) that has not finished after this many seconds: "
                        "408, or an error event and [DONE] when streamed; a request's own 'timeout' field "
                        "(seconds) can shorten it (default: none)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request headers are not complete this many seconds after its "
                        "first byte (or after it opened, or after the previous response): 408 (default 10)")
    g.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="close a connection whose request body is not complete this many seconds after its "
                        "headers: 408, nothing is run (default 60)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close an idle kept-alive connection after this many seconds (default 5, uvicorn's)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="most open HTTP connections; a new one beyond them gets 503 and is closed "
                        "(default: no limit)")
    g.add_argument("--health-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="/health and /ready answer 503 when the engine has made no step for this many seconds "
                        "while requests are pending (default 60)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, stop accepting requests (503, /ready 503) and let the live ones "
                        "finish for up to this many seconds; then end the rest with an error (streamed: an error "
                        "event and [DONE]) and exit 0. A second signal exits at once (default 30)")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="most requests waiting to start (none of their sequences scheduled yet: preempted "
                        "requests and forked samples do not count) before new ones get 503 (default: "
                        f"{MAX_WAITING_PER_SEQ} × --max-num-seqs, a few batches' worth; 0: unbounded)")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (default 32 MiB)")
    from kvserve.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=sorted(TOOL_PARSERS),
                   help="how to read the model's tool calls under tool_choice 'auto' (default hermes: "
                        "<tool_call>{...}</tool_call> blocks, as Hermes, Qwen2.5/Qwen3 and SmolLM3 write them)")
    from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="move the thinking of chat replies (<think>...</think>) to message.reasoning_content / "
                        "delta.reasoning_content: deepseek_r1 (the reply starts thinking: the chat template "
                        "opened <think>) or qwen3 (thinking starts at the model's <think>); also enables the "
                        "request field max_thinking_tokens (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, used instead of the model's")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for the fields a request leaves unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens): 'auto' (default) the model's generation_config.json "
                        "or GGUF sampling metadata, 'vllm' none, or a folder with a generation_config.json")
    p.add_argument("--engine-core", default="process", choices=["process", "in-process"],
                   help="where the engine core (scheduler, model, sampling) runs: 'process' (default) in a child "
                        "process, this one keeping HTTP, tokenization and metrics; 'in-process' in a thread of "
                        "the server's process")
    g = p.add_argument_group("replicas on Ray Serve (a local Ray instance starts by itself; RAY_ADDRESS joins a cluster)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this front end, each a Ray Serve deployment (default 1: one engine, "
                        "no Ray)")
    g.add_argument("--routing", default=None, choices=["prefix", "least_loaded", "round_robin"],
                   help="how requests are spread over the replicas: prefix (default: to the replica most likely to "
                        "hold the prompt's prefix, an approximate radix tree per replica as SGLang's router, "
                        "unless the load is uneven), least_loaded (fewest requests in flight) or round_robin; "
                        "with replicas only")
    g.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill/decode disaggregation: replicas that compute the prompts; their KV blocks move to "
                        "a decode replica through Ray's object store (with --decode-replicas)")
    g.add_argument("--decode-replicas", type=int, default=0,
                   help="prefill/decode disaggregation: replicas that decode (with --prefill-replicas)")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="Ray CPUs (and torch threads) per replica (default: the machine's cores shared out on a "
                        "local Ray instance, 1 in a cluster; with replicas only)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level (uvicorn and kvserve.entrypoints.openai)")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=lambda a: run_server(a, engine_kwargs))


def check_listen_address(host: str, port: int) -> None:
    """Fail fast, before the model loads, if the server could not listen on ``host:port``.

    Binds (and closes at once) a socket on every address ``host`` resolves to, as uvicorn's
    server will (``SO_REUSEADDR`` on, IPv6 sockets IPv6-only).

    Raises:
        ValueError: the port is out of range or already in use, or the host cannot be
            resolved or is not an address of this machine.
    """
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a valid TCP port (0 to 65535)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"cannot listen on {where}: --host {host!r} is not a valid address or known host name "
                         f"({e}); use e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"cannot listen on {where}: port {port} is already in use (is another server "
                                     f"running?); stop it or choose another --port") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise ValueError(f"cannot listen on {where}: {addr[0]} is not an address of this machine; "
                                     "use e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)") from None
                if e.errno == errno.EACCES:
                    raise ValueError(f"cannot listen on {where}: no permission to use port {port} "
                                     "(ports below 1024 need privileges); choose another --port") from None
                raise ValueError(f"cannot listen on {where} (port {port}): {e.strerror or e}") from None


def server_guard_options(a: argparse.Namespace) -> dict:
    """``build_app``'s guard options from ``kvserve serve``'s, checked before the model loads.

    Raises:
        ValueError: a bad value, naming the option.
    """
    from kvserve.entrypoints.openai.guards import parse_allowed_hosts, parse_origins

    parse_allowed_hosts(a.allowed_hosts)
    parse_origins(a.allowed_origins)
    for name in ("request_timeout", "health_timeout", "header_timeout", "body_timeout", "keep_alive_timeout",
                 "shutdown_timeout"):
        value = getattr(a, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}")
    for name in ("max_connections", "max_requests_per_user", "max_tokens_in_flight_per_user"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    return dict(bind_host=a.host, allowed_hosts=a.allowed_hosts, allowed_origins=a.allowed_origins,
                metrics_public=a.metrics_public, request_timeout=a.request_timeout, health_timeout=a.health_timeout,
                max_requests_per_user=a.max_requests_per_user,
                max_tokens_in_flight_per_user=a.max_tokens_in_flight_per_user)


def serve_max_waiting(a: argparse.Namespace) -> int:
    """``--max-waiting``, by default :data:`MAX_WAITING_PER_SEQ` × ``--max-num-seqs``."""
    return a.max_waiting if a.max_waiting is not None else MAX_WAITING_PER_SEQ * a.max_num_seqs


def server_api_keys(a: argparse.Namespace) -> Optional[dict]:
    """The API keys of ``--api-key`` and ``--api-key-file``: key → user name (None: unnamed).

    Raises:
        ValueError: an unreadable or malformed file, an empty key, a name used twice.
    """
    from kvserve.entrypoints.openai.quotas import api_key_users, read_api_key_file

    keys: dict = {k: None for k in a.api_key or ()}
    if a.api_key_file is not None:
        keys.update(read_api_key_file(a.api_key_file))
    if not keys:
        return None
    try:
        api_key_users(keys)
    except ValueError as e:
        raise ValueError(f"--api-key/--api-key-file: {e}") from None
    return keys


def default_served_name(model: str | None, engine) -> str:
    """The name clients use without ``--served-model-name``: a repository id as given (as vLLM
    serves it), else the file or folder's name."""
    from kvserve.worker.loader import is_repo_id

    if model is None:
        return "SmolLM2-135M-Instruct"
    if is_repo_id(model) and not Path(model).expanduser().exists():
        return model
    return Path(model).name.removesuffix(".gguf") or engine.model_config.name


def serve_model(a: argparse.Namespace) -> str | None:
    """The model of ``kvserve serve``: the positional MODEL or ``--model`` (None: the default).

    Raises:
        ValueError: both are given and differ.
    """
    tag, opt = getattr(a, "model_tag", None), a.model
    if tag is not None and opt is not None and tag != opt:
        raise ValueError(f"the model is given twice, as MODEL {tag!r} and as --model {opt!r}: give one of them")
    return tag if tag is not None else opt


def replica_options(a: argparse.Namespace) -> bool:
    """Whether ``kvserve serve`` runs replicas on Ray Serve: ``--data-parallel-size`` other
    than 1, or ``--prefill-replicas`` / ``--decode-replicas`` (their ranges are checked by
    :func:`~kvserve.engine.ray_serve.replica_specs`); ``a.routing`` gets its default.

    Raises:
        ValueError: ``--replica-cpus`` or ``--routing`` without replicas (naming the flag).
    """
    replicated = a.data_parallel_size != 1 or bool(a.prefill_replicas) or bool(a.decode_replicas)
    if not replicated:
        for flag, value in (("--replica-cpus", a.replica_cpus), ("--routing", a.routing)):
            if value is not None:
                raise ValueError(f"{flag} applies to replicas only: it needs --data-parallel-size ≥ 2, or "
                                 f"--prefill-replicas and --decode-replicas (without them, one engine serves, "
                                 f"without Ray)")
    a.routing = a.routing or "prefix"
    return replicated


def _browser_host(host: str) -> str:
    """The host to type into a browser for a server listening on ``host``."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def run_server(a: argparse.Namespace, engine_kwargs: Callable[[argparse.Namespace], dict]) -> int:
    from kvserve.engine.generation_config import describe, generation_defaults
    from kvserve.engine.llm_engine import EngineArgs, LLMEngine
    from kvserve.engine.tokenizer import load_chat_template
    from kvserve.worker.loader import is_tty

    # before loading the model, which can take a while
    a.model = serve_model(a)
    args = EngineArgs(model=a.model, dtype=a.dtype, max_waiting=serve_max_waiting(a),
                      max_num_seqs_per_user=a.max_num_seqs_per_user, **engine_kwargs(a))
    args.check(option_names=True)
    if a.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be ≥ 1, got {a.max_body_bytes}")
    chat_template = load_chat_template(a.chat_template) if a.chat_template is not None else None
    if a.generation_config not in ("auto", "vllm") and not Path(a.generation_config).expanduser().is_dir():
        raise ValueError(f"--generation-config: {a.generation_config!r} is not 'auto', 'vllm' or a folder")
    replicated = replica_options(a)
    check_listen_address(a.host, a.port)
    guard_options = server_guard_options(a)
    api_keys = server_api_keys(a)
    from kvserve.worker.loader import resolve_model_path

    # a model that is not there (or not in the HF cache), or a quantization its format cannot take, fails now
    args.resolved_quantization(resolve_model_path(a.model), option_names=True)
    import uvicorn

    from kvserve.entrypoints.openai.api import build_app

    level = getattr(logging, a.log_level.upper())
    logging.getLogger("kvserve").setLevel(logging.INFO if a.verbose else level)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve.entrypoints.openai").setLevel(level)
    in_process = getattr(a, "engine_core", "process") == "in-process"
    if not a.verbose and not is_tty(sys.stderr):
        # serve's kvserve loggers run at INFO by default (--log-level info), which the weight
        # loader takes for --verbose: its progress bar belongs on a terminal, not in a log file
        # (tqdm's own switch, inherited by the engine core process and a local Ray's replicas)
        os.environ.setdefault("TQDM_DISABLE", "1")
    if replicated:
        from kvserve.engine.ray_serve import ReplicaDeployment, ReplicaStartError, default_app_prefix, replica_specs
        from kvserve.engine.replica_client import ReplicaPool

        if in_process:
            raise ValueError("--engine-core in-process cannot be combined with replicas "
                             "(--data-parallel-size, --prefill-replicas/--decode-replicas)")
        specs = replica_specs(a.data_parallel_size, a.prefill_replicas, a.decode_replicas, default_app_prefix())
        print(f"kvserve: starting {len(specs)} engine replica(s) on Ray Serve: "
              f"{', '.join(s.name for s in specs)}", file=sys.stderr, flush=True)
        try:
            deployment = ReplicaDeployment(args, specs, a.replica_cpus,
                                           log_level=logging.INFO if a.verbose else max(level, logging.WARNING))
        except ReplicaStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        try:
            engine = ReplicaPool(deployment, a.routing)
        except BaseException:
            deployment.shutdown()
            raise
        kv_description = f"{engine.kv_spec_description} per replica"
        where = f", {len(specs)} replicas ({a.routing} routing)"
        in_process = False
    elif in_process:
        engine = LLMEngine(args)
        kv_description = engine.kv_spec.describe()
        where = ""
    else:
        from kvserve.engine.core_client import CoreClient, CoreStartError

        try:
            engine = CoreClient(args, log_level=logging.INFO if a.verbose else level)
        except CoreStartError as e:  # (killed, out of memory...: its own log is above)
            print(f"error: {e}", file=sys.stderr)
            return 1
        kv_description = engine.kv_spec_description
        where = f", engine core in process {engine.pid}"
    try:
        names = a.served_model_name or [default_served_name(a.model, engine)]
        try:
            defaults = generation_defaults(engine.model_path, a.generation_config)
        except ValueError as e:
            raise ValueError(str(e).replace("generation_config:", "--generation-config:", 1)) from None
        app = build_app(engine, names, api_key=api_keys, max_body_bytes=a.max_body_bytes,
                        tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                        chat_template=chat_template, generation_defaults=defaults, **guard_options)
        print(f"kvserve: serving {names[0]!r} ({engine.model_path}, {a.dtype}, max_model_len={engine.max_model_len}"
              f"{where}) on http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
        print(f"kvserve: {kv_description}", file=sys.stderr, flush=True)
        source = "--generation-config " + a.generation_config if a.generation_config != "auto" else \
            "the model's generation config"
        print(f"kvserve: sampling defaults from {source}: {describe(defaults) or 'none'}"
              + (" (a request's own values win)" if defaults else ""), file=sys.stderr, flush=True)
        extras = [f"reasoning parser {a.reasoning_parser}" if a.reasoning_parser else "",
                  "chat template from --chat-template" if chat_template is not None else ""]
        if any(extras):
            print(f"kvserve: {', '.join(e for e in extras if e)}", file=sys.stderr, flush=True)
        print(f"kvserve: web page (chat, dashboard) at http://{_browser_host(a.host)}:{a.port}/, API docs at /docs",
              file=sys.stderr, flush=True)
        from kvserve.entrypoints.openai.http_guard import guarded_protocol

        from kvserve.entrypoints.openai.shutdown import DrainingServer

        config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=not a.no_access_log,
                                timeout_graceful_shutdown=5, timeout_keep_alive=a.keep_alive_timeout,
                                http=guarded_protocol(a.header_timeout, a.body_timeout, a.max_connections))
        server = DrainingServer(config, app.state.server, a.shutdown_timeout)
        server.run()
        if not server.started:  # (uvicorn.run's exit status when it could not start)
            return 3
    finally:
        if not in_process:  # the core process (already stopped by the app's lifespan; idempotent)
            engine.shutdown(timeout=10.0)
    return 0
