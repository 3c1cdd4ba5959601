"""Soak test of ``kvserve serve`` (issue #21): bounded in time, mixed traffic with bad requests
and killed clients; reports what was served, the errors by kind, the server's resident memory
over time and its KV blocks at the start and the end.

The script starts a ``kvserve serve`` process (default model, a 0.5 GiB KV pool, a 2,048-token
context; ``--server-arg`` adds options) on a free port (:class:`server_process.Server`: stopped
with SIGINT at the end, checked for processes left behind and for tracebacks in its log), then
runs ``--concurrency`` clients for ``--duration`` seconds. Each client loops over requests drawn
(seeded) from this mix:

* ``--bad-fraction`` (default 10%) **bad requests**, each of which must get its 4xx: a negative
  temperature or max_tokens, ``n=0``, ``top_p=2``, an unknown model (404), a body that is not
  JSON, a ``text/plain`` body (415), a prompt longer than the context, 10,000 stop strings (over
  the cap), a logit_bias key that is no token id, a chat without messages, an invalid
  ``response_format`` schema, a tool whose schema's ``$ref`` loops;
* ``--disconnect-fraction`` (default 5%) **killed clients**: a stream closed after its first
  one to three events, or a non-streamed request whose client gives up after 0.2-1 s (both
  with ``max_tokens=300``, so that the server must abort them);
* the rest **normal requests**: completions or chat, streamed or not, four users, prompts that
  share four prefixes (prefix-cache hits) with random words after them, max_tokens 1-64,
  greedy or sampled, some with ``n=2``/``3``, logprobs, stop strings or ``json_object``
  output. A normal request must get 200 with its choices (streamed: events up to ``[DONE]``,
  with no error event).

Anything else is an **unexpected** result, counted by kind (status, transport error, a bad
request accepted, a stream without ``[DONE]``...).

Resident memory: the RSS of the server and every process it started (the engine core), summed,
sampled every 10 s; growth is measured from the end of the warm-up (``--warmup``, default a
sixth of the run, at most 5 minutes: allocator pools, the prefix cache and the per-shape kernel
caches fill first) to the end, and must be at most 5%. KV blocks: the ``kvserve:kv_cache_*_blocks``
gauges before the first request and once the server is idle at the end: no block may stay in
use, and the blocks available (free + cached, evictable) must equal those at the start.

Usage::

    python benchmarks/soak.py                        # 30 minutes (the issue's figure)
    python benchmarks/soak.py --duration 120 --concurrency 4 --save-json soak.json
    python benchmarks/soak.py --server-arg=--max-num-seqs-per-user --server-arg=8

Exit status 0 when every check passed (no unexpected results, memory growth <= 5%, KV blocks
back), 1 otherwise. The throughput it prints is that of a loaded soak, not a benchmark figure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server_process import Server, descendants, msum, scrape  # noqa: E402

PREFIXES = [
    "You are a helpful assistant. Answer the question in one short paragraph.",
    "Summarize the following text for a busy reader:",
    "Translate the following sentence into French:",
    "Write a short story about",
]
WORDS = ("river mountain cloud engine garden lamp ocean violin paper castle winter market forest "
         "letter window bridge silver harbor candle orbit meadow pepper signal").split()
USERS = ["alice", "bob", "carol", "dave"]


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its live descendants, summed (bytes; VmRSS)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def kv_blocks(base_url: str) -> dict:
    _, m = scrape(base_url)
    return {k: int(msum(m, f"kvserve:kv_cache_{k}_blocks")) for k in ("free", "cached", "used")}


# ------------------------------------------------------------------ requests
def bad_request(rng: random.Random, model: str, max_model_len: int) -> tuple[str, dict]:
    """(kind, request spec) of one bad request and the status class it must get."""
    base = {"model": model, "prompt": "Hello", "max_tokens": 8}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    loop_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}
    cases = {
        "temperature<0": ("/v1/completions", {**base, "temperature": -1}, None),
        "max_tokens<0": ("/v1/completions", {**base, "max_tokens": -5}, None),
        "n=0": ("/v1/completions", {**base, "n": 0}, None),
        "top_p>1": ("/v1/chat/completions", {**chat, "top_p": 2}, None),
        "unknown model": ("/v1/completions", {**base, "model": "no-such-model"}, None),
        "not JSON": ("/v1/completions", None, ("application/json", b'{"model": ')),
        "text/plain": ("/v1/completions", None, ("text/plain", json.dumps(base).encode())),
        "prompt too long": ("/v1/completions", {**base, "prompt": " ".join(rng.choices(WORDS, k=max_model_len + 50))},
                            None),
        "10k stop strings": ("/v1/completions", {**base, "stop": [f"s{i}" for i in range(10_000)]}, None),
        "logit_bias key": ("/v1/completions", {**base, "logit_bias": {"not-a-token": 1}}, None),
        "no messages": ("/v1/chat/completions", {"model": model, "max_tokens": 8}, None),
        "bad schema": ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
        "looping $ref": ("/v1/chat/completions", {**chat, "tools": [loop_tool], "tool_choice": "required"}, None),
    }
    kind = rng.choice(sorted(cases))
    return kind, cases[kind]


def normal_request(rng: random.Random, model: str) -> tuple[str, dict]:
    prompt = rng.choice(PREFIXES) + " " + " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 64), "user": rng.choice(USERS),
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 1 << 30),
                  "stream": rng.random() < 0.5}
    r = rng.random()
    if r < 0.15:
        body["n"] = rng.choice([2, 3])
    elif r < 0.25:
        body["stop"] = [rng.choice(WORDS), "\n\n"]
    if rng.random() < 0.5:
        if rng.random() < 0.1:
            body["response_format"] = {"type": "json_object"}
            prompt += " Answer in JSON."
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    if rng.random() < 0.2:
        body["logprobs"] = 2
    return "/v1/completions", {**body, "prompt": prompt}


async def run_stream(client: httpx.AsyncClient, url: str, body: dict, stop_after: Optional[int] = None) -> str:
    """Outcome of a streamed request: "ok", "disconnected" (closed after ``stop_after`` events),
    or an unexpected kind."""
    events = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"unexpected status {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "ok"
            if '"error"' in data and json.loads(data).get("error"):
                return "error event"
            events += 1
            if stop_after is not None and events >= stop_after:
                return "disconnected"  # leaving the block closes the connection
    return "stream without [DONE]"


async def one_request(client: httpx.AsyncClient, base: str, rng: random.Random, a, model: str) -> tuple[str, str]:
    """(class, outcome) of one request of the mix; class in bad / disconnect / normal."""
    x = rng.random()
    if x < a.bad_fraction:
        kind, (path, body, raw) = bad_request(rng, model, a.max_model_len)
        if raw is not None:
            r = await client.post(base + path, content=raw[1], headers={"Content-Type": raw[0]})
        else:
            r = await client.post(base + path, json=body)
        if 400 <= r.status_code < 500:
            return "bad", "rejected"
        return "bad", f"{kind}: got {r.status_code}"
    if x < a.bad_fraction + a.disconnect_fraction:
        path, body = normal_request(rng, model)
        body.update(max_tokens=300, n=1, ignore_eos=True)
        body.pop("stop", None)
        if rng.random() < 0.5:
            body["stream"] = True
            return "disconnect", await run_stream(client, base + path, body, stop_after=rng.randint(1, 3))
        body["stream"] = False
        try:
            await client.post(base + path, json=body, timeout=rng.uniform(0.2, 1.0))
        except httpx.TimeoutException:
            return "disconnect", "disconnected"
        return "disconnect", "finished before the client left"
    path, body = normal_request(rng, model)
    if body["stream"]:
        return "normal", await run_stream(client, base + path, body)
    r = await client.post(base + path, json=body)
    if r.status_code != 200:
        return "normal", f"unexpected status {r.status_code}"
    n = body.get("n", 1)
    return "normal", "ok" if len(r.json().get("choices", [])) == n else "wrong number of choices"


async def soak(base: str, pid: int, a) -> dict:
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    outcomes: Counter = Counter()
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()
    end = t0 + a.duration

    async def client_loop(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < end:
                try:
                    cls, what = await one_request(client, base, rng, a, model)
                except httpx.HTTPError as e:
                    cls, what = "transport", type(e).__name__
                outcomes[(cls, what)] += 1

    async def sampler() -> None:
        while time.monotonic() < end:
            rss.append((time.monotonic() - t0, rss_bytes(pid)))
            done = sum(outcomes.values())
            print(f"  t={time.monotonic() - t0:6.0f} s  requests {done:6d}  RSS {rss[-1][1] / 2**20:7.0f} MiB",
                  file=sys.stderr, flush=True)
            await asyncio.sleep(min(10.0, max(0.0, end - time.monotonic())))
        rss.append((time.monotonic() - t0, rss_bytes(pid)))

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(a.concurrency)))
    return {"outcomes": outcomes, "rss": rss, "seconds": time.monotonic() - t0}


def wait_idle(base: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, m = scrape(base)
        if msum(m, "kvserve:num_requests_running") + msum(m, "kvserve:num_requests_waiting") == 0 \
                and msum(m, "kvserve:kv_cache_used_blocks") == 0:
            return True
        time.sleep(1.0)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the memory baseline (default: duration / 6, at most 300)")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default 8)")
    ap.add_argument("--bad-fraction", type=float, default=0.10)
    ap.add_argument("--disconnect-fraction", type=float, default=0.05)
    ap.add_argument("--model", default=None, help="model (default: kvserve's default SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB (default 0.5)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--server-arg", action="append", default=[], help="one more kvserve serve option (repeat)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-json", default=None)
    ap.add_argument("--log-dir", default="/tmp", help="where the server's log goes (default /tmp)")
    a = ap.parse_args(argv)
    for name in ("duration", "concurrency"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name} must be > 0")
    if not (0 <= a.bad_fraction and 0 <= a.disconnect_fraction and a.bad_fraction + a.disconnect_fraction <= 1):
        ap.error("--bad-fraction and --disconnect-fraction must be >= 0 and sum to at most 1")
    warmup = a.warmup if a.warmup is not None else min(300.0, a.duration / 6)

    server = Server("soak", a.model, a.dtype, a.kv_cache_memory, a.server_arg, Path(a.log_dir),
                    more=["--max-model-len", str(a.max_model_len)])
    with server:
        blocks_start = kv_blocks(server.base_url)
        result = asyncio.run(soak(server.base_url, server.proc.pid, a))
        idle = wait_idle(server.base_url)
        blocks_end = kv_blocks(server.base_url)
        _, m = scrape(server.base_url)
        generated = msum(m, "kvserve:generation_tokens_total")
        aborted = msum(m, "kvserve:request_success_total", finished_reason="abort")
    outcomes: Counter = result["outcomes"]
    rss = result["rss"]
    base_rss = next((v for t, v in rss if t >= warmup), rss[-1][1])
    end_rss = rss[-1][1]
    growth = (end_rss - base_rss) / base_rss
    unexpected = {f"{c}: {w}": n for (c, w), n in outcomes.items()
                  if not (w == "ok" or (c == "bad" and w == "rejected") or (c == "disconnect" and w in (
                      "disconnected", "finished before the client left")))}
    by_class = Counter()
    for (c, _), n in outcomes.items():
        by_class[c] += n
    avail = lambda b: b["free"] + b["cached"]  # noqa: E731
    checks = {
        "no unexpected results": not unexpected,
        "RSS growth after warm-up <= 5%": growth <= 0.05,
        "idle at the end": idle,
        "no KV block in use at the end": blocks_end["used"] == 0,
        "KV blocks available at the end == at the start": avail(blocks_end) == avail(blocks_start),
        "server stopped cleanly": not server.problems,
    }
    total = sum(outcomes.values())
    lines = [
        f"soak of kvserve serve, {datetime.date.today()}: {result['seconds'] / 60:.1f} min, {a.concurrency} clients, "
        f"{platform.node()} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})",
        "",
        "| figure | value |", "|---|---|",
        f"| requests | {total} ({total / result['seconds']:.1f}/s) |",
        f"| normal: ok / all | {outcomes[('normal', 'ok')]} / {by_class['normal']} |",
        f"| bad: rejected with 4xx / all | {outcomes[('bad', 'rejected')]} / {by_class['bad']} |",
        f"| killed clients: left before the end / all | {outcomes[('disconnect', 'disconnected')]} / "
        f"{by_class['disconnect']} (server-side aborts: {aborted:.0f}) |",
        f"| unexpected | {sum(unexpected.values())} {dict(sorted(unexpected.items())) if unexpected else ''} |",
        f"| generated tokens | {generated:.0f} ({generated / result['seconds']:.1f}/s) |",
        f"| RSS (server + engine core): start / after warm-up ({warmup:.0f} s) / end / max | "
        f"{rss[0][1] / 2**20:.0f} / {base_rss / 2**20:.0f} / {end_rss / 2**20:.0f} / "
        f"{max(v for _, v in rss) / 2**20:.0f} MiB |",
        f"| RSS growth after warm-up | {100 * growth:+.2f}% |",
        f"| KV blocks free + cached / in use: start | {avail(blocks_start)} / {blocks_start['used']} |",
        f"| KV blocks free + cached / in use: end | {avail(blocks_end)} / {blocks_end['used']} |",
        "",
        *[f"- [{'x' if ok else ' '}] {name}" for name, ok in checks.items()],
        *[f"- problem: {p}" for p in server.problems],
    ]
    print("\n".join(lines))
    if a.save_json:
        Path(a.save_json).write_text(json.dumps({
            "args": vars(a), "outcomes": {f"{c}: {w}": n for (c, w), n in outcomes.items()},
            "rss": rss, "warmup_s": warmup, "rss_growth": growth, "kv_blocks_start": blocks_start,
            "kv_blocks_end": blocks_end, "generated_tokens": generated, "checks": checks,
            "problems": server.problems, "seconds": result["seconds"]}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
