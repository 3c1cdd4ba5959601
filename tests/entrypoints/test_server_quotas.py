"""Per-user quotas (issue #21, point 1) on the real server on loopback: --max-requests-per-user
and --max-tokens-in-flight-per-user answer 429 with Retry-After naming the limit, other users
are unaffected, the counts come back when requests finish or their clients are killed; with
several API keys each key is a user and the 'user' field cannot pass as another key's."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_helpers import ServerThread

from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.entrypoints.openai.quotas import api_key_users, read_api_key_file, request_tokens
from kvserve.sampling_params import SamplingParams


def _engine(folder) -> LLMEngine:
    """The tiny model's engine, each step held back 5 ms so that LONG takes at least 2 s on any
    CPU (a bare step is well under 1 ms on a fast one, and LONG could finish before the test
    looks at it or before a 0.3 s timeout)."""
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", num_blocks=1024, block_size=4,
                                  max_model_len=512))
    step = engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    return engine


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    with ServerThread(_engine(tiny_folder), names=["tiny"], max_requests_per_user=2,
                      max_tokens_in_flight_per_user=1000) as s:
        yield s


def _open_stream(port: int, body: dict, key: str | None = None) -> socket.socket:
    """A streamed completion on a raw socket, returned once its first event has arrived (close
    it to kill the client)."""
    data = json.dumps({**body, "stream": True}).encode()
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
                 + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return sock


def _post(s, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(s.base_url + "/v1/completions", json=body, headers=headers, timeout=60)


def _released(s, user, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while s.api.quotas.in_flight(user) != (0, 0):
        assert time.monotonic() < deadline, s.api.quotas.in_flight(user)
        time.sleep(0.02)


LONG = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}  # 403 tokens in flight, >= 2 s (_engine)


def test_requests_per_user(server):
    held = [_open_stream(server.port, {**LONG, "user": "alice"}) for _ in range(2)]
    try:
        assert server.api.quotas.in_flight("alice") == (2, 806)
        r = _post(server, {"prompt": [1], "max_tokens": 1, "user": "alice"})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "user_request_limit" and err["type"] == "rate_limit_error"
        assert "--max-requests-per-user" in err["message"] and "'alice'" in err["message"], err
        # other users, and the anonymous one, are unaffected
        assert _post(server, {"prompt": [1], "max_tokens": 2, "user": "bob"}).status_code == 200
        assert _post(server, {"prompt": [1], "max_tokens": 2}).status_code == 200
        _released(server, "bob")
        _released(server, None)
    finally:
        for sock in held:
            sock.close()  # killed clients: their requests are aborted, their counts released
    _released(server, "alice")
    assert _post(server, {"prompt": [1], "max_tokens": 2, "user": "alice"}).status_code == 200
    server.wait_idle()


def test_tokens_in_flight_per_user(server):
    sock = _open_stream(server.port, {**LONG, "user": "carol"})
    try:
        assert server.api.quotas.in_flight("carol") == (1, 403)
        r = _post(server, {"prompt": [1, 2], "max_tokens": 300, "n": 2, "user": "carol"})  # 602 more: 1005 > 1000
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "user_token_limit" and "--max-tokens-in-flight-per-user" in err["message"], err
        assert "403 tokens in flight" in err["message"] and "602 more" in err["message"]
        # what still fits passes, and is released when it finishes
        r = _post(server, {"prompt": [1, 2], "max_tokens": 20, "n": 2, "ignore_eos": True, "user": "carol"})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert server.api.quotas.in_flight("carol") == (1, 403)
        assert _post(server, {"prompt": [1, 2], "max_tokens": 300, "user": "dave"}).status_code == 200
    finally:
        sock.close()
    _released(server, "carol")
    # a request over the limit alone can never pass: 400, not 429
    r = _post(server, {"prompt": [1, 2, 3], "max_tokens": 500, "n": 2, "user": "carol"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "--max-tokens-in-flight-per-user" in r.json()["error"]["message"]
    server.wait_idle()


def test_killed_unstreamed_client_and_aborts_release(server):
    body = json.dumps({**LONG, "user": "erin"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while server.api.quotas.in_flight("erin") == (0, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    _released(server, "erin")
    server.wait_idle()
    # a request refused by the engine (prompt too long) holds nothing
    r = _post(server, {"prompt": [1] * 600, "max_tokens": 1, "user": "erin"})
    assert r.status_code == 400
    assert server.api.quotas.in_flight("erin") == (0, 0)
    # a request that times out is released too
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={**LONG, "user": "erin", "timeout": 0.3})
    assert r.status_code == 408
    _released(server, "erin")


def test_each_key_is_a_user(tiny_folder, tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalice:k-alice\n\nk-anon\nbob:k-bob\n")
    keys = read_api_key_file(f)
    assert keys == {"k-alice": "alice", "k-anon": None, "k-bob": "bob"}
    anon = api_key_users(keys)["k-anon"]
    assert anon.startswith("key-") and "k-anon" not in anon
    with ServerThread(_engine(tiny_folder), names=["tiny"], api_key=keys, max_requests_per_user=1) as s:
        sock = _open_stream(s.port, LONG, key="k-alice")
        try:
            assert s.api.quotas.in_flight("alice") == (1, 403)
            # alice cannot escape her quota with a 'user' field, nor bob be counted as alice
            r = _post(s, {"prompt": [1], "max_tokens": 1, "user": "someone-else"}, key="k-alice")
            assert r.status_code == 429 and "'alice'" in r.json()["error"]["message"]
            assert _post(s, {"prompt": [1], "max_tokens": 1, "user": "alice"}, key="k-bob").status_code == 200
            assert _post(s, {"prompt": [1], "max_tokens": 1}, key="k-anon").status_code == 200
            assert _post(s, {"prompt": [1], "max_tokens": 1}, key="wrong").status_code == 401
            assert _post(s, {"prompt": [1], "max_tokens": 1}).status_code == 401
            for k in keys:  # every key opens the side doors
                assert httpx.get(s.base_url + "/metrics", headers={"Authorization": f"Bearer {k}"}).status_code == 200
            assert httpx.get(s.base_url + "/metrics").status_code == 401
        finally:
            sock.close()
        _released(s, "alice")


def test_key_file_errors_and_token_count(tmp_path):
    f = tmp_path / "keys"
    for text, msg in (("alice:\n", "line 1"), (":k\n", "line 1"), ("a b\n", "line 1"), ("k\nk\n", "repeats")):
        f.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_api_key_file(f)
    with pytest.raises(ValueError, match="cannot read"):
        read_api_key_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="'alice'"):
        api_key_users({"k1": "alice", "k2": "alice"})
    assert api_key_users("k") == {"k": None}  # one unnamed key: the 'user' field names the user
    import argparse

    from kvserve.entrypoints.openai.cli import server_api_keys

    f.write_text("carol:k3\n")
    assert server_api_keys(argparse.Namespace(api_key=["k1", "k2"], api_key_file=str(f))) == {
        "k1": None, "k2": None, "k3": "carol"}
    assert server_api_keys(argparse.Namespace(api_key=None, api_key_file=None)) is None
    f.write_text("carol:k3\ncarol:k4\n")
    with pytest.raises(ValueError, match="--api-key/--api-key-file: two API keys have the user name 'carol'"):
        server_api_keys(argparse.Namespace(api_key=None, api_key_file=str(f)))
    assert request_tokens([[1, 2], [3]], SamplingParams(max_tokens=10, n=2), 100) == 3 + 2 * 2 * 10
    assert request_tokens([[1, 2]], SamplingParams(max_tokens=None), 100) == 100
    assert request_tokens([[1]], SamplingParams(max_tokens=5, n=1, best_of=3), 100) == 16
