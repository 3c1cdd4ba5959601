"""``kvserve serve --data-parallel-size 2`` as a user runs it (a local Ray instance started by
the server): a replica killed mid-run; the requests that got nothing yet are sent again and
finish, the streams it was serving end with an error event, the other replica's requests
finish, Ray Serve brings the replica back and ``/health`` shows it; ``/metrics`` counts each
request once (where it finished, or as an error of the dead replica) and each retry once;
Ctrl-C leaves no process. Bad replica options fail before anything starts.

A tiny random model keeps it quick; three processes and Ray's own on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_helpers import free_port, pid_gone, request_counts

pytestmark = pytest.mark.slow

pytest.importorskip("ray")


def _descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _request_counts(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return request_counts(text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text))


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


DP_RANGE = "--data-parallel-size must be an integer ≥ 1 (1: one engine, no replicas), got "
NEEDS_REPLICAS = (" applies to replicas only: it needs --data-parallel-size ≥ 2, or --prefill-replicas and "
                  "--decode-replicas (without them, one engine serves, without Ray)")
BAD_REPLICA_OPTIONS = [
    (["--data-parallel-size", "0"], DP_RANGE + "0"),
    (["-dp", "-1"], DP_RANGE + "-1"),  # (the same range as for 0)
    (["--replica-cpus", "2"], "--replica-cpus" + NEEDS_REPLICAS),
    (["-dp", "1", "--replica-cpus", "2"], "--replica-cpus" + NEEDS_REPLICAS),
    (["--routing", "round_robin"], "--routing" + NEEDS_REPLICAS),
    (["--prefill-replicas", "-1", "--decode-replicas", "1"],
     "--prefill-replicas must be an integer ≥ 0 (0: no prefill/decode disaggregation, which needs --prefill-replicas "
     "and --decode-replicas both ≥ 1), got -1"),
    (["--prefill-replicas", "1"], "--prefill-replicas and --decode-replicas must both be ≥ 1"),
    (["--data-parallel-size", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "either --data-parallel-size"),
    (["--data-parallel-size", "2", "--replica-cpus", "0"], "--replica-cpus must be in (0, 1024]"),
    (["--data-parallel-size", "2", "--engine-core", "in-process"], "--engine-core in-process cannot be combined"),
]


def test_a_bad_replica_option_fails_before_anything_starts(tiny_model_dir):
    """As a user runs it: the command exits at once, with the message and no traceback."""
    folder = tiny_model_dir("llama")[0]
    args, message = BAD_REPLICA_OPTIONS[0]
    t0 = time.monotonic()
    p = _cli("serve", "--model", str(folder), "--port", str(free_port()), *args)
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0 and message in out, out
    assert "Traceback" not in out
    assert time.monotonic() - t0 < 30  # no Ray, no model


@pytest.fixture
def restore_logging():
    """``main`` sets the ``kvserve`` loggers' levels (and may configure the root logger) as the
    command line does: put them back, so that later tests see the defaults."""
    import logging

    names = ("kvserve", "kvserve.entrypoints.openai")
    levels = {n: logging.getLogger(n).level for n in names}
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)
    root.handlers[:] = handlers
    root.setLevel(root_level)


@pytest.mark.parametrize("args, message", BAD_REPLICA_OPTIONS)
def test_bad_replica_options_fail_before_anything_starts(args, message, tiny_model_dir, capsys, restore_logging,
                                                         monkeypatch):
    """Each bad option through the command line's ``main`` in this process (a process each
    costs ~4 s of imports): exit status 2 and the message, before Ray or the model (an engine
    that starts fails the test instead of serving)."""
    import kvserve.executor.ray_executor
    from kvserve.engine.core_client import CoreClient
    from kvserve.entrypoints.cli import main

    def started(*args, **kwargs):
        raise AssertionError("an engine or Ray started")

    monkeypatch.setattr(CoreClient, "__init__", started)
    monkeypatch.setattr(kvserve.executor.ray_executor, "connect_ray", started)
    folder = tiny_model_dir("llama")[0]
    t0 = time.monotonic()
    assert main(["serve", "--model", str(folder), "--port", str(free_port()), *args]) == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 30


def test_replicas_that_do_not_fit_the_local_ray_instance_fail_before_deploying(tiny_model_dir, capsys, monkeypatch,
                                                                                restore_logging):
    """``-dp 2 --replica-cpus 1000`` on the local Ray instance the server starts: exit status 2
    naming --replica-cpus, the 2000 CPUs asked and the instance's CPUs, before any replica is
    deployed (Ray Serve would wait for the CPUs forever), and Ray is stopped again."""
    import re

    import ray

    from kvserve.engine.ray_serve import ReplicaDeployment
    from kvserve.entrypoints.cli import main

    def deploy(*args, **kwargs):
        raise AssertionError("the replicas were deployed")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ReplicaDeployment, "_deploy", deploy)
    folder = tiny_model_dir("llama")[0]
    assert not ray.is_initialized()
    assert main(["serve", "--model", str(folder), "--port", str(free_port()), "-dp", "2",
                 "--replica-cpus", "1000"]) == 2
    err = capsys.readouterr().err
    m = re.search(r"error: 2 replicas of --replica-cpus 1000 need 2000 Ray CPUs, but the Ray cluster has (\d+) CPUs "
                  r"\(ray.cluster_resources\(\)\)", err)
    assert m, err
    from kvserve.worker.worker import available_cores

    assert int(m.group(1)) == max(available_cores(), 3)  # (the local instance: the cores, at least replicas + 1)
    assert not ray.is_initialized()


def test_a_killed_replica_is_replaced_and_its_requests_retried_or_ended(tiny_model_dir):
    folder = tiny_model_dir("llama_long")[0]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = _cli("serve", "--model", str(folder), "--port", str(port), "--dtype", "float32",
                  "--max-model-len", "4096", "--block-size", "4", "--kv-cache-memory", "0.05",
                  "--data-parallel-size", "2", "--routing", "round_robin", "--no-access-log",
                  start_new_session=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "".join(log)
            try:
                r = httpx.get(base + "/health", timeout=5)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "".join(log)
            time.sleep(0.5)
        states = r.json()["replicas"]
        assert set(states) == {"replica-0", "replica-1"}
        victim = states["replica-0"]["pid"]
        before = _request_counts(base)
        assert "replica-0 retries" in before  # (the series exists from the start)
        results: dict = {}
        streams: dict = {}
        routed = threading.Barrier(5)  # the 4 streams have their first event: each has its replica

        def plain(i):
            r = httpx.post(base + "/v1/completions", timeout=120, json={
                "prompt": [5 + i, 6, 7], "max_tokens": 2000, "ignore_eos": True, "temperature": 0})
            results[i] = (r.status_code, r.json())

        def streamed(i):
            events = []
            with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                    "prompt": [9 + i, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}) as resp:
                it = resp.iter_lines()
                for line in it:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            routed.wait(60)
            streams[i] = events

        threads = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=streamed, args=(i,)) for i in range(4)]
        # The streams first, all routed before the other requests: round robin then gives each
        # replica exactly 2 of them (started together with the others, the streams' share of
        # replica-0 was a race: once it got none).
        for t in threads[4:]:
            t.start()
        routed.wait(60)
        t_routed = time.monotonic()
        for t in threads[:4]:
            t.start()
        deadline = time.monotonic() + 10  # until the 8 requests are in flight, 4 on each replica
        seen: list = []  # (the in-flight counts polled, for a failure's message)
        while time.monotonic() < deadline:
            in_flight = [v["in_flight"] for v in httpx.get(base + "/health", timeout=5).json()["replicas"].values()]
            if not seen or seen[-1][1] != in_flight:
                seen.append((round(time.monotonic() - t_routed, 2), in_flight))
            if in_flight == [4, 4]:
                break
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        # (a stream of 4,000 tokens took ~9 s here: killed later, replica-0's could be over)
        why = f"killed {time.monotonic() - t_routed:.1f} s after the streams were routed; in flight: {seen}"
        for t in threads:
            t.join(150)
            assert not t.is_alive()  # no request hangs
        # the non-streamed requests had shown nothing: all finish (those of the dead replica sent again)
        assert all(code == 200 and body["usage"]["completion_tokens"] == 2000 for code, body in results.values()), \
            results
        ended_with_error = finished = 0
        for events in streams.values():
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            if "error" in last:
                ended_with_error += 1
                assert "replica-0" in last["error"]["message"]
            else:
                finished += 1
                assert last["choices"][0]["finish_reason"] == "length"
        # (2 of the streams were replica-0's; one may have finished before the kill)
        assert 1 <= ended_with_error <= 2 and ended_with_error + finished == 4, \
            (why, {i: (len(ev), ev[-2][-160:]) for i, ev in streams.items()})
        # each request counts once: where it finished, or as an error of replica-0 (the streams it
        # lost); one sent again counts a retry of replica-0, not an error (it was: "error" +1 for
        # each, and "length" +1 where it then finished)
        after = _request_counts(base)
        d = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        print(f"request counters' changes: {d}")
        retried = d.get("replica-0 retries", 0)
        assert d.get("replica-0 error", 0) == ended_with_error, d
        assert d.get("replica-0 length", 0) + ended_with_error + retried == 4, d  # replica-0's 4 requests
        assert d.get("replica-1 length", 0) == 4 + retried, d  # its own 4 and those sent again
        assert set(d) <= {"replica-0 error", "replica-0 length", "replica-0 retries", "replica-1 length"}, d
        deadline = time.monotonic() + 120
        while True:
            states = httpx.get(base + "/health", timeout=5).json()["replicas"]
            if states["replica-0"]["state"] == "healthy":
                break
            assert states["replica-0"]["state"] == "restarting"
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
        assert states["replica-0"]["pid"] != victim and states["replica-0"]["restarts"] == 1
        assert pid_gone(victim)
        r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": [5, 6, 7], "max_tokens": 8})
        assert r.status_code == 200
        family = _descendants(server.pid)
        assert {s["pid"] for s in states.values()} <= family
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert all(pid_gone(p, 30) for p in family), [p for p in family if not pid_gone(p, 0)]
