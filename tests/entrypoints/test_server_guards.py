"""Issue #21 on the real server on loopback: browser-origin safety, list caps, the tool-schema
check at submission, liveness (/health's step heartbeat, /ready) and request time-outs."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from server_helpers import ServerThread, tiny_chat_engine

from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.entrypoints.openai.guards import CAPS


def _engine(folder, **kw) -> LLMEngine:
    return tiny_chat_engine(folder, **{"num_blocks": 256, "max_model_len": 256, **kw})


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny"], api_key="sekrit", health_timeout=0.5) as s:
        yield s


def _raw(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk


KEY = {"Authorization": "Bearer sekrit"}


# ------------------------------------------------------------ browser-origin safety
def test_foreign_host_is_refused(server):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    reply = _raw(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: evil.example:%d\r\n"
                 b"Authorization: Bearer sekrit\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (server.port, len(body), body))
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"evil.example" in reply and b"--allowed-hosts" in reply
    r = httpx.get(server.base_url + "/v1/models", headers={**KEY, "Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Host"
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", "[::1]:8000"):
        assert httpx.get(server.base_url + "/v1/models", headers={**KEY, "Host": host}).status_code == 200, host


def test_allowed_hosts_and_cors(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny"], allowed_hosts=["api.example,.corp.example"],
                      allowed_origins=["https://app.example"]) as s:
        ok = [httpx.get(s.base_url + "/v1/models", headers={"Host": h}).status_code
              for h in ("api.example", "x.corp.example:8000", "corp.example")]
        assert ok == [200, 200, 200]
        assert httpx.get(s.base_url + "/v1/models", headers={"Host": "evil.example"}).status_code == 400
        pre = httpx.options(s.base_url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        bad = httpx.options(s.base_url + "/v1/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in bad.headers
    with ServerThread(_engine(tiny_folder), names=["tiny"], allowed_hosts=["*"]) as s:
        assert httpx.get(s.base_url + "/v1/models", headers={"Host": "evil.example"}).status_code == 200


def test_cors_is_off_by_default(server):
    r = httpx.get(server.base_url + "/v1/models", headers={**KEY, "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(server.base_url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_non_json_content_type_is_refused(server, ctype):
    headers = {**KEY} if ctype is None else {**KEY, "Content-Type": ctype}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = httpx.post(server.base_url + path, headers=headers, content=b'{"prompt": "hi", "max_tokens": 1}')
        assert r.status_code == 415, (path, r.text)
        assert r.json()["error"]["param"] == "content-type" and "application/json" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                   headers={**KEY, "Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


def test_metrics_and_docs_need_the_key(server, tiny_folder):
    for path in ("/metrics", "/docs", "/openapi.json"):  # (no /redoc: web.py serves the docs offline)
        r = httpx.get(server.base_url + path)
        assert r.status_code == 401, path
        assert httpx.get(server.base_url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server.base_url + path, headers=KEY).status_code == 200, path
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes need no key
    with ServerThread(_engine(tiny_folder), names=["tiny"], api_key="k", metrics_public=True) as s:
        assert httpx.get(s.base_url + "/metrics").status_code == 200
        assert httpx.get(s.base_url + "/openapi.json").status_code == 200
        assert httpx.get(s.base_url + "/v1/models").status_code == 401


def test_models_show_no_path(server):
    data = httpx.get(server.base_url + "/v1/models", headers=KEY).json()["data"]
    assert data[0]["root"] == "tiny"
    assert "/" not in str(data)


# ------------------------------------------------------------------ list caps
def _post(server, path, body, timeout=60):
    return httpx.post(server.base_url + path, json=body, headers=KEY, timeout=timeout)


MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * (CAPS["stop"] + 1)}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * (CAPS["stop_chars"] + 1)}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["x"] * 100_000}, "stop"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["w"] * (CAPS["bad_words"] + 1)}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["w" * (CAPS["bad_words_chars"] + 1)]}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(CAPS["logit_bias"] + 1)}},
     "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * (CAPS["stop_token_ids"] + 1)}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL] * (CAPS["tools"] + 1)}, "tools"),
    ("/v1/chat/completions", {"messages": MSG * (CAPS["messages"] + 1)}, "messages"),
    ("/tokenize", {"messages": MSG * (CAPS["messages"] + 1)}, "messages"),
    ("/detokenize", {"tokens": [1] * 257}, "tokens"),
    ("/detokenize", {"tokens": [1] * 2_000_000}, "tokens"),
])
def test_every_cap_answers_400_naming_its_field(server, path, body, field):
    t0 = time.perf_counter()
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert time.perf_counter() - t0 < 10


def test_lists_at_their_caps_are_accepted(server):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["zz"] * CAPS["stop"],
                                          "logit_bias": {str(i): 1 for i in range(CAPS["logit_bias"])}})
    assert r.status_code == 200, r.text
    assert _post(server, "/detokenize", {"tokens": [1] * 256}).status_code == 200


# ------------------------------------------------------------- tool schemas (point 6)
LOOPS = [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
     "$defs": {"n": {"allOf": [{"$ref": "#/$defs/n"}]}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
     "$defs": {"n": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}]}}},
    {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
]
TREE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
        "$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "c": {"$ref": "#/$defs/n"}},
                        "required": ["v"], "additionalProperties": False}}}


def _fn(name, parameters):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "loop"}}, "auto"])
@pytest.mark.parametrize("schema", LOOPS)
def test_a_looping_ref_is_refused_at_submission_naming_the_tool(server, choice, schema):
    tools = [_fn("ok", {"type": "object", "properties": {"q": {"type": "string"}}}), _fn("loop", schema)]
    free = server.engine_call(lambda e: e.kv.num_free_blocks)
    r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 20, "tools": tools,
                                               "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and "tools[1] (loop)" in err["message"], err
    assert server.engine_call(lambda e: e.kv.num_free_blocks) == free  # never reached the engine


def test_refs_in_a_tools_parameters_work_under_required(server):
    """A function's own $defs are found once its parameters sit inside the required-call schema."""
    for choice in ("required", {"type": "function", "function": {"name": "tree"}}):
        r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 60, "temperature": 0,
                                                   "tools": [_fn("tree", TREE)], "tool_choice": choice})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------ liveness (point 3)
def test_health_answers_503_while_the_engine_stalls_with_work_pending(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/ready").status_code == 200
    server.api.async_engine.pause()
    box = {}
    try:
        time.sleep(1.0)  # paused but idle: nothing pending, still healthy
        assert httpx.get(server.base_url + "/health").status_code == 200
        import threading

        t = threading.Thread(target=lambda: box.setdefault("r", _post(server, "/v1/completions",
                                                                      {"prompt": "hi", "max_tokens": 3})))
        t.start()
        deadline = time.monotonic() + 10
        while (r := httpx.get(server.base_url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "never unhealthy"
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        assert "--health-timeout" in r.json()["error"]["message"]
        assert httpx.get(server.base_url + "/ready").status_code == 503
    finally:
        server.api.async_engine.resume()
    t.join(30)
    assert box["r"].status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/ready").status_code == 200


def test_a_long_generation_keeps_health_200(tiny_folder):
    """Steps are the heartbeat: a busy engine that steps is healthy however long its requests run."""
    with ServerThread(_engine(tiny_folder), names=["tiny"], health_timeout=0.3) as s:
        import threading

        t = threading.Thread(target=lambda: httpx.post(s.base_url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 200, "ignore_eos": True}))
        t.start()
        codes = []
        while t.is_alive():
            codes.append(httpx.get(s.base_url + "/health").status_code)
            time.sleep(0.05)
        assert codes and set(codes) == {200}


# ------------------------------------------------------------------ request time-outs (point 2)
def _unfinished(server) -> int:
    return server.engine_call(lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_cancels_a_request(tiny_folder, stream):
    with ServerThread(_engine(tiny_folder), names=["tiny"], request_timeout=1.0) as s:
        free = s.engine_call(lambda e: e.kv.num_free_blocks)
        s.api.async_engine.pause()  # the request waits for ever
        try:
            client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
            for own, limit in ((None, 1.0), (0.3, 0.3), (5.0, 1.0)):  # the smaller time-out wins
                t0 = time.monotonic()
                extra = {} if own is None else {"extra_body": {"timeout": own}}
                if not stream:
                    with pytest.raises(openai.APIStatusError) as e:
                        client.completions.create(model="tiny", prompt="hi", max_tokens=5, **extra)
                    assert e.value.status_code == 408 and e.value.body["code"] == "request_timeout"
                else:
                    r = httpx.post(s.base_url + "/v1/completions", timeout=30, json={
                        "prompt": "hi", "max_tokens": 5, "stream": True, **({} if own is None else {"timeout": own})})
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    assert events[-1] == "[DONE]" and '"request_timeout"' in events[-2], events
                took = time.monotonic() - t0
                assert limit - 0.05 < took < limit + 1.0, (own, took)
            assert _unfinished(s) == 0
            assert s.engine_call(lambda e: e.kv.num_free_blocks) == free
        finally:
            s.api.async_engine.resume()
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200  # a quick request is not affected


def test_request_timeout_mid_generation_frees_the_blocks(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny"]) as s:
        free = s.engine_call(lambda e: e.kv.num_free_blocks)

        def slow_down(e):
            step = e.step

            def slow_step():
                time.sleep(0.02)
                return step()

            e.step = slow_step

        s.engine_call(slow_down)
        try:
            t0 = time.monotonic()
            r = httpx.post(s.base_url + "/v1/completions", timeout=30, json={
                "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "n": 2, "timeout": 0.5})
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
            assert time.monotonic() - t0 < 1.5
            s.wait_idle(10)
        finally:
            s.engine_call(lambda e: delattr(e, "step"))
        assert s.engine_call(lambda e: e.kv.num_free_blocks) == free


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_a_bad_timeout_is_400(server, bad):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "timeout": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text


def test_heartbeat_and_timeout_with_the_engine_core_in_its_own_process(tiny_folder):
    args = EngineArgs(model=str(tiny_folder), dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    with ServerThread(args, names=["tiny"], health_timeout=0.5, request_timeout=1.5) as s:
        assert httpx.get(s.base_url + "/ready").status_code == 200
        s.api.async_engine.pause()
        try:
            t0 = time.monotonic()
            import threading

            box = {}
            t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
                s.base_url + "/v1/completions", timeout=30, json={"prompt": [1, 2, 3], "max_tokens": 5})))
            t.start()
            deadline = time.monotonic() + 10
            while httpx.get(s.base_url + "/health").status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert httpx.get(s.base_url + "/ready").status_code == 503
            t.join(10)
            assert box["r"].status_code == 408 and 1.4 < time.monotonic() - t0 < 3.0
            assert not s.engine_call("has_unfinished_requests")
            assert httpx.get(s.base_url + "/health").status_code == 200  # nothing pending any more
        finally:
            s.api.async_engine.resume()
        r = httpx.post(s.base_url + "/v1/completions", timeout=30, json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200


def test_an_idle_engine_stays_healthy_after_its_requests(server):
    for _ in range(3):
        assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    time.sleep(1.0)  # > health_timeout, nothing pending
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("option,value,words", [
    ("request_timeout", 0.0, "--request-timeout must be"), ("health_timeout", -1.0, "--health-timeout must be"),
    ("allowed_hosts", ["http://x"], "--allowed-hosts: 'http://x'"),
    ("allowed_origins", ["app.example"], "--allowed-origins: 'app.example'"),
    ("header_timeout", 0.0, "--header-timeout must be"), ("body_timeout", float("nan"), "--body-timeout must be"),
    ("max_connections", 0, "--max-connections must be"), ("shutdown_timeout", 0.0, "--shutdown-timeout must be"),
    ("max_requests_per_user", 0, "--max-requests-per-user must be"),
    ("max_tokens_in_flight_per_user", -5, "--max-tokens-in-flight-per-user must be"),
])
def test_bad_option_values_fail_at_start_naming_the_option(option, value, words):
    import argparse

    from kvserve.entrypoints.openai.cli import server_guard_options

    a = argparse.Namespace(host="127.0.0.1", allowed_hosts=None, allowed_origins=None, metrics_public=False,
                           request_timeout=None, health_timeout=60.0, header_timeout=10.0, body_timeout=60.0,
                           keep_alive_timeout=5.0, max_connections=None, shutdown_timeout=30.0,
                           max_requests_per_user=None, max_tokens_in_flight_per_user=None)
    setattr(a, option, value)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        server_guard_options(a)


# ------------------------------------------------------------ slow and idle connections (point 2)
def _closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (reading what it sent), at most ``limit``."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, data


@pytest.fixture(scope="module")
def guarded(tiny_folder):
    from kvserve.entrypoints.openai.http_guard import guarded_protocol

    with ServerThread(_engine(tiny_folder), names=["tiny"], uvicorn_options=dict(
            http=guarded_protocol(header_timeout=0.6, body_timeout=0.8, max_connections=8),
            timeout_keep_alive=0.5)) as s:
        yield s


def test_idle_and_slow_header_connections_are_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as idle, \
            socket.create_connection(("127.0.0.1", guarded.port)) as slow:
        t0 = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(3):  # a header line now and then: never complete
            time.sleep(0.15)
            slow.sendall(b"X-Slow: 1\r\n")
        took, data = _closed_after(slow, 5.0)
        assert time.monotonic() - t0 < 0.6 + 0.5 and data.startswith(b"HTTP/1.1 408"), data
        took, data = _closed_after(idle, 5.0)
        assert time.monotonic() - t0 < 0.6 + 0.5 and b"408" in data


def test_a_slow_body_is_closed_and_never_runs(guarded):
    before = guarded.engine_call(lambda e: e.stats().get("num_waiting", 0) + e.stats().get("num_running", 0))
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.monotonic()
        for b in body[:6]:  # one byte every 0.2 s: 1.2 s for the body, over the 0.8 s time-out
            try:
                sock.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):  # closed by the server
                break
            time.sleep(0.2)
        took, data = _closed_after(sock, 5.0)
        assert time.monotonic() - t0 < 0.8 + 0.6, time.monotonic() - t0
        assert data.startswith(b"HTTP/1.1 408") and b"--body-timeout" in data, data
    assert guarded.engine_call(lambda e: e.stats().get("num_waiting", 0) + e.stats().get("num_running", 0)) == before


def test_keep_alive_and_normal_requests_still_work(guarded):
    with httpx.Client(base_url=guarded.base_url) as c:
        for _ in range(3):  # one connection, kept alive
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
        time.sleep(1.0)  # past keep-alive: the server closes it, the client reconnects
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:  # idle after a response: closed
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        took, data = _closed_after(sock, 5.0)
        assert data.startswith(b"HTTP/1.1 200") and took < 0.5 + 0.5


def test_connections_beyond_the_limit_are_refused(guarded):
    socks = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(8)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", guarded.port)) as extra:
            took, data = _closed_after(extra, 2.0)
            assert data.startswith(b"HTTP/1.1 503") and b"too many connections" in data
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert httpx.get(guarded.base_url + "/health").status_code == 200
