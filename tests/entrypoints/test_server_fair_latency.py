"""Isolation between users on the real model and a real ``kvserve serve`` process (issue #21,
point 1): while one user streams ``n=128, max_tokens=4000``, another user's normal request
stays within 3x its idle latency under ``--max-num-seqs-per-user 4``. Without the cap the burst
holds 64-128 sequences, every step is several times longer, and the same request took 8x its
idle latency (0.32 s idle, 2.5 s loaded).

The cap is 4, not 8: a decode step's cost grows with its batch on 2 cores (2026-12-03, SmolLM2's
Q4_1 weights, the one-call C decode step: 7.5 ms for 1 sequence, 10.5 ms for 4, 17.7 ms for 9),
so with 8 burst sequences beside it the request took 2.4-2.8x its idle latency on the quiet
machine (3.09x and 3.55x in two fresh-clone runs, before the weight-only kernel stopped
dequantizing once per 4 sequences), with 4 it took 1.6x (medians of 5)."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest
from server_helpers import CLIServer

pytestmark = pytest.mark.slow

NORMAL = {"model": "m", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16,
          "temperature": 0, "user": "normal"}


def _latency(base: str) -> float:
    t = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", json=NORMAL, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 or r.json()["choices"][0]["finish_reason"] == "stop"
    return time.perf_counter() - t


def _burst(base: str, started: threading.Event, stop: threading.Event, seen: dict) -> None:
    body = {"model": "m", "prompt": "Once upon a time", "n": 128, "max_tokens": 4000, "temperature": 1.0,
            "ignore_eos": True, "user": "burst", "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        seen["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen["events"] = seen.get("events", 0) + 1
                if seen["events"] >= 256:
                    started.set()
            if stop.is_set():
                return  # closes the stream: the server aborts the burst


def _running(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvserve:num_requests_running"))


def test_a_normal_request_stays_within_3x_its_idle_latency_during_a_burst(smollm2_path):
    server = CLIServer(smollm2_path, "--dtype", "bfloat16", "--kv-cache-memory", "0.5", "--served-model-name", "m",
                       "--max-num-seqs-per-user", "4")
    try:
        _latency(server.base)  # warm-up
        idle = statistics.median(_latency(server.base) for _ in range(5))
        started, stop, seen = threading.Event(), threading.Event(), {}
        burst = threading.Thread(target=_burst, args=(server.base, started, stop, seen), daemon=True)
        burst.start()
        assert started.wait(120), seen  # the burst streams (256 tokens over its samples)
        loaded = [_latency(server.base) for _ in range(5)]
        running = _running(server.base)
        stop.set()
        burst.join(60)
        assert seen["status"] == 200
        assert statistics.median(loaded) <= 3 * idle, (idle, loaded)
        assert running >= 1  # (the burst was still running: it cannot have finished 128 x 4000 tokens)
    finally:
        server.kill()
