"""``kvserve bench serve``: a load generator for any OpenAI-compatible server.

It sends streaming /v1/completions (or /v1/chat/completions) requests, with Poisson arrivals
at ``request_rate`` requests/s (``inf``: all at once) and at most ``max_concurrency`` in
flight, and measures per request (client side, ``time.perf_counter``):

* TTFT: request sent → first chunk carrying text;
* ITL: gaps between successive text chunks;
* TPOT: (latency − TTFT) / (output tokens − 1);
* E2E latency: request sent → stream end;

and overall: successful and failed requests, request throughput, output-token throughput
(output tokens from the final ``usage`` chunk when the server sends one, else the number of
text chunks) over the benchmark's wall time, from the first request sent to the last answer.
The summary keeps every sample too (``series_ms``), which :mod:`kvserve.bench.plot` draws.

Workloads (token ids drawn from the tokenizer's vocabulary, special tokens excluded):

* ``random``: each prompt is ``input_len`` random tokens;
* ``shared-prefix``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens; prompt i is
  prefix ``i % num_prefixes`` followed by ``input_len`` random tokens.

Completions prompts are sent as token id lists (exact lengths on every server: kvserve,
vLLM and llama-server accept them); chat prompts as text (the decoded tokens).
``ignore_eos`` is sent so that every request generates exactly ``output_len`` tokens on
servers that honour it (kvserve, vLLM, llama-server).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import httpx
from tqdm import tqdm


@dataclass
class BenchConfig:
    """What to send and how fast.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is added).
        model: the ``model`` field of the requests.
        endpoint: ``completions`` or ``chat``.
        dataset: ``random`` or ``shared-prefix``.
        num_prompts: requests to send (after the warm-up).
        input_len / output_len: prompt tokens (after any shared prefix) and max_tokens.
        range_ratio: input lengths are drawn uniformly from input_len · [1 − r, 1 + r].
        prefix_len / num_prefixes: the shared-prefix workload.
        request_rate: Poisson arrival rate (requests/s); ``inf`` sends all at once.
        max_concurrency: most requests in flight (None: unbounded).
        temperature: sampling temperature (0: greedy).
        ignore_eos: ask the server to generate exactly output_len tokens.
        api_key: sent as ``Authorization: Bearer``.
        seed: seeds the prompts and the arrival times.
        warmup: requests sent one by one before timing starts.
        label: a name for the run in reports.
    """

    base_url: str
    model: str
    endpoint: str = "completions"
    dataset: str = "random"
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: Optional[str] = None
    seed: int = 0
    warmup: int = 1
    label: str = ""
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    """One request, measured at the client."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------- workloads
def make_prompts(cfg: BenchConfig, vocab_size: int, special_ids: Sequence[int]) -> list[list[int]]:
    """Token-id prompts of the configured workload (deterministic in ``cfg.seed``)."""
    rng = random.Random(cfg.seed)
    special = set(special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]

    def rand(n: int) -> list[int]:
        return [allowed[rng.randrange(len(allowed))] for _ in range(n)]

    lo = max(1, int(cfg.input_len * (1 - cfg.range_ratio)))
    hi = max(lo, int(cfg.input_len * (1 + cfg.range_ratio)))
    prefixes = [rand(cfg.prefix_len) for _ in range(max(1, cfg.num_prefixes))] if cfg.dataset == "shared-prefix" else [[]]
    if cfg.dataset not in ("random", "shared-prefix"):
        raise ValueError(f"unknown dataset {cfg.dataset!r}; use 'random' or 'shared-prefix'")
    return [prefixes[i % len(prefixes)] + rand(rng.randint(lo, hi)) for i in range(cfg.num_prompts + cfg.warmup)]


# ------------------------------------------------------------------ client
def _payload(cfg: BenchConfig, prompt: list[int], text: Optional[str]) -> dict:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    return body


async def sse_events(response: httpx.Response):
    """The JSON objects of a response's server-sent events (``data: ...`` lines), until
    ``data: [DONE]`` (an async generator).

    Raises:
        json.JSONDecodeError: an event that is not JSON.
    """
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, prompt: list[int],
                       text: Optional[str]) -> RequestResult:
    """Send one streaming request and time its chunks."""
    url = cfg.base_url.rstrip("/") + ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions")
    res = RequestResult(prompt_len=len(prompt))
    chunks = 0
    usage_tokens: Optional[int] = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=_payload(cfg, prompt, text)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:300]}"
                return res
            async for obj in sse_events(r):
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens", usage_tokens)
                for ch in obj.get("choices") or []:
                    piece = ch.get("text") if cfg.endpoint != "chat" else (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no text in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(cfg: BenchConfig, prompts: list[list[int]], texts: Optional[list[str]] = None,
                        progress: Optional[bool] = False) -> dict:
    """Warm up, then send ``cfg.num_prompts`` requests; return the summary (see :func:`summarize`).

    Args:
        progress: a tqdm bar of the requests answered on stderr (None: when stderr is a
            terminal).
    """
    texts = texts or [None] * len(prompts)
    limit = cfg.max_concurrency or len(prompts)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers) as client:
        for i in range(cfg.warmup):
            w = await send_request(client, cfg, prompts[i], texts[i])
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        work = list(zip(prompts[cfg.warmup:], texts[cfg.warmup:]))
        sem = asyncio.Semaphore(limit)
        rng = random.Random(cfg.seed + 1)

        bar = tqdm(total=len(work), desc=cfg.label or "requests", unit="req", disable=None if progress is None
                   else not progress, dynamic_ncols=True)

        failed = 0

        async def one(p, t):
            nonlocal failed
            async with sem:
                res = await send_request(client, cfg, p, t)
            if not res.ok:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            return res

        tasks = []
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        for p, t in work:
            tasks.append(asyncio.create_task(one(p, t)))
            if math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        try:
            results = await asyncio.gather(*tasks)
        finally:
            bar.close()
        duration = time.perf_counter() - start
    summary = summarize(cfg, results, duration)
    # The machine's 1-minute load average around the run: a busy machine skews every figure.
    summary["loadavg_start"], summary["loadavg_end"] = load_start, os.getloadavg()[0]
    return summary


# ----------------------------------------------------------------- summary
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    """Throughputs and mean/median/P99 latencies (milliseconds) of the successful requests, and
    ``series_ms``: the samples themselves (per request TTFT, TPOT and end-to-end latency, and
    every inter-token gap; ms)."""
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "label": cfg.label,
        "config": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                   for k, v in asdict(cfg).items() if k != "api_key"},
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
    }
    out["request_throughput"] = len(ok) / duration if duration > 0 else 0.0
    out["output_throughput"] = out["total_output_tokens"] / duration if duration > 0 else 0.0
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration if duration > 0 else 0.0
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out["series_ms"] = {}
    for name, xs in series.items():
        ms = [x * 1000 for x in xs]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = _pct(ms, 50)
        out[f"p99_{name}_ms"] = _pct(ms, 99)
        out["series_ms"][name] = ms
    return out


def format_table(s: dict) -> str:
    """A human-readable table of one run (vLLM's layout)."""
    w = 50
    lines = [f" Serving Benchmark Result {s.get('label') or ''} ".center(w, "=")]

    def row(name, value, fmt="{:.2f}"):
        lines.append(f"{name:<38}{fmt.format(value):>12}")

    row("Successful requests:", s["completed"], "{}")
    row("Failed requests:", s["failed"], "{}")
    row("Max concurrency:", s["config"].get("max_concurrency") or "-", "{}")
    row("Request rate (req/s):", s["config"].get("request_rate"), "{}")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{}")
    row("Total generated tokens:", s["total_output_tokens"], "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f" {title} ".center(w, "-"))
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"])
        row(f"P99 {name.upper()} (ms):", s[f"p99_{name}_ms"])
    if "loadavg_start" in s:
        row("Load average (start / end):", f"{s['loadavg_start']:.2f} / {s['loadavg_end']:.2f}", "{}")
    lines.append("=" * w)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)
