"""Issue #21 on the real server on loopback: browser-origin safety, list caps, the tool-schema
check at submission, liveness (/health's step heartbeat, /ready) and request time-outs."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from server_helpers import ServerThread

from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.entrypoints.openai.guards import CAPS

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _engine(folder, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", num_blocks=256, block_size=4, max_model_len=256)
    args.update(kw)
    engine = LLMEngine(EngineArgs(**args))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny"], api_key="sekrit") as s:
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
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc"):
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
