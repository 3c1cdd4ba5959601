"""``kvserve serve`` with tensor parallelism (``-tp 2``): the engine core's process holds rank 0
and starts rank 1 as its child. Greedy outputs over HTTP equal the offline one-rank engine's;
a rank killed mid-stream ends every live request with an error event, ``/health`` turns 503
within 5 s, and no process is left behind.

Three processes on 2 cores (API, core + rank 0, rank 1): slow, but they prove correctness.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs
from server_helpers import ServerThread, free_port, pid_gone

TINY = dict(dtype="float32", block_size=4, max_model_len=256, num_blocks=256)
PROMPTS = ["The quick brown fox", "Once upon a time"]


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s live child processes (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def test_tp2_server_equals_offline_and_a_dead_rank_fails_live_requests(folder):
    ref = LLM(model=str(folder), **TINY).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0,
                                                                          ignore_eos=True))
    args = EngineArgs(model=str(folder), tensor_parallel_size=2, **TINY)
    with ServerThread(args, names=["tiny"]) as s:
        base = s.base_url
        core = s.api.async_engine.core_pid
        ranks = _children(core)
        assert len(ranks) == 1  # rank 1 (rank 0 is the core process itself)
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        got = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == [o.text for o in ref]
        events, first = [], threading.Event()

        def streaming():
            with httpx.stream("POST", base + "/v1/completions", timeout=60,
                              json={"prompt": [4, 5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if len(events) == 3:
                            first.set()

        t = threading.Thread(target=streaming)
        t.start()
        assert first.wait(30)
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() - killed < 5.0, "/health did not turn 503 within 5 s"
            time.sleep(0.02)
        t.join(20)
        assert not t.is_alive(), "the client hung after the rank died"
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert "rank 1" in events[-2]["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert pid_gone(core, 10.0) and pid_gone(ranks[0], 1.0)


def test_cli_serve_tp_flag_and_clear_errors(folder):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli"]
    p = subprocess.run(cmd + ["serve", "--model", str(folder), "-tp", "0", "--port", "0"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--tensor-parallel-size must be ≥ 1" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["generate", "--model", str(folder), "--dtype", "float32", "-tp", "64", "hello"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "tensor_parallel_size" in p.stderr and "Traceback" not in p.stderr
    port = free_port()
    p = subprocess.Popen(cmd + ["serve", "--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "0.05",
                                "--block-size", "4", "-tp", "2", "--port", str(port), "--no-access-log"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        kids = _children(p.pid)
        # SIGTERM to the whole group (kill -- -PGID, systemd) during a stream: the core and rank 1
        # ignore it, the server drains the stream and then stops them itself
        events: list = []

        def stream():
            body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while not events:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(90) == 0
        t.join(30)
        err = p.stderr.read()
        assert "died" not in err and "Traceback" not in err, err
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(60)
    for k in kids:  # the core and, under it, rank 1: all gone with the server
        assert pid_gone(k, 10.0)


def _descendants(pid: int) -> set[int]:
    """The live descendants of ``pid`` (from /proc)."""
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for p in frontier for c in _children(p)} - out
        out |= frontier
    return out


def _rank_pid(core: int, backend: str) -> int:
    """Rank 1's process: the core's child (mp), or the Ray actor's worker under the core's local
    Ray instance (ray)."""
    if backend == "mp":
        (pid,) = _children(core)
        return pid

    def cmdline(p: int) -> str:
        try:
            with open(f"/proc/{p}/cmdline") as f:
                return f.read()
        except OSError:
            return ""

    (pid,) = [p for p in _descendants(core) if "RayWorkerActor" in cmdline(p)]
    return pid


@pytest.fixture
def backend(request, monkeypatch):
    if request.param == "ray":
        pytest.importorskip("ray")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)  # (a local Ray instance, the core's own)
    return request.param


@pytest.mark.parametrize("backend", ["mp", "ray"], indirect=True)
def test_a_rank_killed_mid_stream_turns_health_503_before_the_stream_ends(folder, backend):
    """``/health`` answers 503 as soon as the engine core knows a rank died: already when the
    stream's error event arrives (the core says so before it fails the requests, not once it
    has stopped its workers and exited, which takes seconds with Ray), and within 1 s of the
    kill."""
    args = EngineArgs(model=str(folder), tensor_parallel_size=2, distributed_executor_backend=backend, **TINY)
    with ServerThread(args, names=["tiny"]) as s:
        base = s.base_url
        core = s.api.async_engine.core_pid
        rank = _rank_pid(core, backend)
        below = _descendants(core)
        events, health_at_error, first = [], [], threading.Event()

        def streaming():
            with httpx.stream("POST", base + "/v1/completions", timeout=60,
                              json={"prompt": [4, 5, 6], "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if "error" in events[-1]:
                            health_at_error.append(httpx.get(base + "/health").status_code)
                        if len(events) == 3:
                            first.set()

        t = threading.Thread(target=streaming)
        t.start()
        assert first.wait(60)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(base + "/health").status_code == 200:
            assert time.monotonic() - killed < 1.0, "/health still 200 1 s after the rank died"
            time.sleep(0.05)
        t.join(30)
        assert not t.is_alive(), "the client hung after the rank died"
        assert events[-1] == "[DONE]" and "rank 1" in events[-2]["error"]["message"]
        assert health_at_error == [503]
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert pid_gone(core, 30.0)
    assert all(pid_gone(p, 30.0) for p in below)  # (Ray's own processes too)


def _kill_an_idle_rank(s: ServerThread, rank_pid: int) -> None:
    """After a request, SIGKILL the rank ``rank_pid`` while the server is idle: ``/health`` turns
    503 within 30 s, and a request then gets a 503 naming rank 1."""
    base = s.base_url
    r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and httpx.get(base + "/health").status_code == 200
    os.kill(rank_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(base + "/health").status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 30 s after a rank died between steps"
        time.sleep(0.1)
    assert "rank 1" in str(s.api.async_engine.fatal_error)
    r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]


@pytest.mark.parametrize("backend", ["mp", "ray"], indirect=True)
def test_a_rank_killed_between_steps_turns_health_503(folder, backend):
    """An idle engine core checks its ranks every second: a rank that died while no request
    ran turns ``/health`` 503 (it stayed 200 until the next request's step failed)."""
    args = EngineArgs(model=str(folder), tensor_parallel_size=2, distributed_executor_backend=backend, **TINY)
    with ServerThread(args, names=["tiny"]) as s:
        core = s.api.async_engine.core_pid
        below = _descendants(core)
        _kill_an_idle_rank(s, _rank_pid(core, backend))
        assert pid_gone(core, 30.0)
    assert all(pid_gone(p, 30.0) for p in below)


def test_in_process_engine_a_rank_killed_between_steps_turns_health_503(folder):
    """``--engine-core in-process``: the engine thread looks at its ranks every second while
    idle, as the core process does (a rank that died while no request ran left ``/health`` 200
    until the next request's step failed)."""
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=str(folder), tensor_parallel_size=2, **TINY))
    rank1 = engine.executor.procs[0]
    with ServerThread(engine, names=["tiny"]) as s:
        _kill_an_idle_rank(s, rank1.pid)
    engine.core.shutdown()
    assert pid_gone(rank1.pid, 30.0)
