"""Engine replicas and prefill/decode disaggregation on Ray Serve (issue #20), against one engine.

Two parts (``--part disagg``, ``--part replicas``; default both), each against real
``kvserve serve`` processes that this script starts on a free port, waits for (``/health``),
and stops with SIGINT (checking that the server and every process it started are gone):

1. **Disaggregation**: long-prompt arrivals mixed with running decodes. ``--streams`` decode
   streams (``--stream-prompt-len`` random prompt tokens, up to ``--stream-max-tokens`` output
   tokens, ``ignore_eos``; a stream that ends is started again) run for the whole run; once
   each has produced tokens, ``--long-prompts`` requests of ``--long-len`` random prompt
   tokens (uniform in the given range) and ``--long-max-tokens`` output tokens arrive at a
   Poisson rate ``--rate`` (seeded). The window is from the first long prompt sent to the last
   one finished; the streams are then closed (the server aborts them). Against (a)
   ``colocated``: one ``kvserve serve`` engine (chunked prefill, the default), and (b)
   ``1P + 1D``: ``--prefill-replicas 1 --decode-replicas 1``. Reported per system: the long
   prompts' TTFT (P50 / P99, client side), the decode streams' inter-token latency within the
   window (P50 / P99 / max, and the gaps of at least 0.5 s: the stalls that long prefills
   cause, which P99 hides when they are under 1% of the gaps), output tokens/s in the
   window (the servers' ``generation_tokens`` counters), KV bytes moved per transferred
   request (``kvserve:kv_transfer_bytes`` sum / count over the window; while that histogram is
   empty, computed from the model's shape: ``2 * layers * kv_heads * head_dim * dtype bytes *
   (prompt tokens - 1)``, and the table says so), and the TTFT split (means over the window of
   ``kvserve:ttft_queue_seconds`` / ``ttft_prefill_seconds`` / ``ttft_transfer_seconds``; for the
   colocated engine its ``request_queue_time_seconds``).
2. **Replicas vs one engine**: ``kvserve bench serve``'s load generator
   (:mod:`kvserve.bench.serve`: random prompts, streaming, ``ignore_eos``) at concurrency 1, 8
   and 32 against ``kvserve serve`` and ``kvserve serve --data-parallel-size 2`` (prefix
   routing): output tokens/s, TTFT, TPOT and ITL (P50 / P99) per level, and the ratio 2
   replicas / one engine.

Same model, dtype, KV pool size and seeds for every system. Prints markdown tables (and the
machine: cores, load average); ``--save-json`` writes every figure. A machine with few cores
runs every replica on the same cores: there, 2 replicas or a prefill + decode split share what
one engine had (Ray gives each replica ``cores / replicas`` torch threads), so the figures show
the mechanics and their overheads, not the speedup of more hardware. Across machines, start a
Ray cluster and set ``RAY_ADDRESS`` (passed on to the servers), with ``--replica-cpus``.

Usage::

    python benchmarks/disaggregation.py                       # both parts (~10 min on 2 busy cores)
    python benchmarks/disaggregation.py --part disagg --save-json out.json
    python benchmarks/disaggregation.py --part replicas --concurrency 1 8 32
    RAY_ADDRESS=HEAD:6379 python benchmarks/disaggregation.py --replica-cpus 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from kvserve.bench.serve import BenchConfig, _pct, make_prompts, run_benchmark, send_request, sse_events
from server_process import Server, hist_mean, mdiff, msum, scrape

#: a decode stream's gap between two tokens at least this long counts as a stall (ms)
STALL_MS = 500.0

MACHINE_NOTE = ("this machine has {cores} CPU cores, shared with other jobs: 2 replicas, or a prefill and a decode "
                "replica, split the same {cores} cores that one engine uses alone (each replica gets "
                "cores / replicas torch threads), so these figures show the mechanics and their overheads "
                "(routing, the KV hop, Ray), not the speedup that more hardware would bring")


# -------------------------------------------------------------- workloads
def model_shape(model: Optional[str], dtype: str) -> dict:
    from kvserve.worker.loader import load_model_config, resolve_model_path

    path = resolve_model_path(model)
    cfg = load_model_config(path)
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return {"path": str(path), "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype_bytes": nbytes, "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * nbytes}


def _vocab(tok) -> list[int]:
    special = set(tok.all_special_ids)
    return [t for t in range(len(tok)) if t not in special]


@dataclass
class Stream:
    """One decode stream request: when it was sent and the arrival time of each text chunk."""

    start: float
    stamps: list[float] = field(default_factory=list)
    done: bool = False
    error: str = ""


async def decode_lane(client: httpx.AsyncClient, url: str, model: str, prompts, max_tokens: int,
                      record: list[Stream]) -> None:
    """Keep one decode stream running until cancelled (a stream that ends is started again
    with the lane's next prompt)."""
    for prompt in prompts:
        s = Stream(time.perf_counter())
        record.append(s)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for obj in sse_events(r):
                if "error" in obj:
                    s.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return
                if any(ch.get("text") for ch in obj.get("choices") or []):
                    s.stamps.append(time.perf_counter())
        s.done = True


async def disagg_workload(base_url: str, a, tok, shape: dict) -> dict:
    """Run part 1's workload against a ready server; return its figures."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    url = base_url + "/v1/completions"
    vocab = _vocab(tok)
    rng = random.Random(a.seed)

    def rand(n: int) -> list[int]:
        return [vocab[rng.randrange(len(vocab))] for _ in range(n)]

    lo, hi = a.long_len
    long_prompts = [rand(rng.randint(lo, hi)) for _ in range(a.long_prompts + 1)]  # [0]: warm-up
    lane_prompts = [[rand(a.stream_prompt_len) for _ in range(50)] for _ in range(a.streams + 1)]  # [-1]: warm-up
    arrivals = random.Random(a.seed + 1)
    gaps = [arrivals.expovariate(a.rate) for _ in range(a.long_prompts - 1)]  # between successive long prompts
    long_cfg = BenchConfig(base_url=base_url, model=model, output_len=a.long_max_tokens, ignore_eos=True,
                           temperature=0.0, timeout_s=600.0)
    limits = httpx.Limits(max_connections=a.streams + a.long_prompts + 8)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        # warm-up (untimed): one long prompt and one short stream, one after the other
        w = await send_request(client, long_cfg, long_prompts[0], None)
        if not w.ok:
            raise RuntimeError(f"warm-up request failed: {w.error}")
        warm: list[Stream] = []
        await decode_lane(client, url, model, lane_prompts[-1][:1], 16, warm)
        if warm[0].error:
            raise RuntimeError(f"warm-up stream failed: {warm[0].error}")
        # the decode streams, until each has produced a few tokens
        streams: list[list[Stream]] = [[] for _ in range(a.streams)]
        lanes = [asyncio.create_task(decode_lane(client, url, model, lane_prompts[i], a.stream_max_tokens, streams[i]))
                 for i in range(a.streams)]
        deadline = time.perf_counter() + 300
        while not all(st and len(st[-1].stamps) >= 4 for st in streams):
            if any(t.done() for t in lanes):
                errs = [s.error for st in streams for s in st if s.error]
                raise RuntimeError(f"a decode stream ended early: {errs or [t.exception() for t in lanes if t.done()]}")
            if time.perf_counter() > deadline:
                raise RuntimeError("the decode streams did not start within 300 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        m_t0, m0 = scrape(base_url)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        tasks = []
        for i in range(a.long_prompts):
            if i:
                await asyncio.sleep(gaps[i - 1])
            tasks.append(asyncio.create_task(send_request(client, long_cfg, long_prompts[i + 1], None)))
        results = await asyncio.gather(*tasks)
        t1 = time.perf_counter()
        m_t1, m1 = scrape(base_url)
        load1 = os.getloadavg()[0]
        lane_errors = [s.error for st in streams for s in st if s.error]
        lanes_alive = sum(not t.done() for t in lanes)
        for t in lanes:
            t.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
    # the server must abort the closed streams: nothing left running
    idle_after = None
    t_cancel = time.perf_counter()
    while time.perf_counter() - t_cancel < 30:
        _, m = scrape(base_url)
        if msum(m, "kvserve:num_requests_running") + msum(m, "kvserve:num_requests_waiting") == 0:
            idle_after = time.perf_counter() - t_cancel
            break
        await asyncio.sleep(0.25)
    # figures
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    gaps_ms = []
    tokens_in_window = 0
    restarts = 0
    for st in streams:
        for s in st:
            restarts += t0 <= s.start <= t1
            for prev, cur in zip(s.stamps, s.stamps[1:]):
                if prev >= t0 and cur <= t1:
                    gaps_ms.append((cur - prev) * 1e3)
            tokens_in_window += sum(t0 <= x <= t1 for x in s.stamps)
    gen = mdiff(m0, m1, "kvserve:generation_tokens_total")
    kv_blocks, n_blocks = hist_mean(m0, m1, "kvserve:kv_transfer_blocks")
    kv_bytes, n_kv = hist_mean(m0, m1, "kvserve:kv_transfer_bytes")
    kv_secs, _ = hist_mean(m0, m1, "kvserve:kv_transfer_seconds")
    computed = statistics.fmean([(r.prompt_len - 1) * shape["kv_bytes_per_token"] for r in ok]) if ok else math.nan
    split = {k: hist_mean(m0, m1, f"kvserve:ttft_{k}_seconds") for k in ("queue", "prefill", "transfer")}
    queue_time = hist_mean(m0, m1, "kvserve:request_queue_time_seconds")
    per_replica = {}  # the counters of each replica over the window (a server of one engine: "")
    for (name, labels), _ in m1.items():
        if name in ("kvserve:generation_tokens_total", "kvserve:prompt_tokens_total", "kvserve:num_preemptions_total",
                    "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"):
            rep = dict(labels).get("replica", "")
            per_replica.setdefault(rep, {})[name.split(":")[1]] = mdiff(m0, m1, name, **dict(labels))
    return {
        "arrival_gaps_s": gaps, "window_s": t1 - t0, "metrics_window_s": m_t1 - m_t0, "loadavg": [load0, load1],
        "long": {"sent": len(results), "ok": len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
                 "mean_prompt_len": statistics.fmean([r.prompt_len for r in ok]) if ok else 0,
                 "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
                 "e2e_p50_ms": _pct([r.latency * 1e3 for r in ok], 50),
                 "output_tokens": sum(r.output_tokens for r in ok)},
        "decode": {"streams": a.streams, "itl_samples": len(gaps_ms), "itl_p50_ms": _pct(gaps_ms, 50),
                   "itl_p99_ms": _pct(gaps_ms, 99), "itl_max_ms": max(gaps_ms, default=math.nan),
                   "itl_mean_ms": statistics.fmean(gaps_ms) if gaps_ms else math.nan,
                   "stalls": sum(g >= STALL_MS for g in gaps_ms),
                   "stalled_s": sum(g for g in gaps_ms if g >= STALL_MS) / 1e3 / a.streams,
                   "chunks_in_window": tokens_in_window, "restarts_in_window": restarts, "errors": lane_errors[:5],
                   "lanes_alive_at_end": lanes_alive},
        "output_tok_s": gen / (m_t1 - m_t0) if gen else (tokens_in_window + sum(r.output_tokens for r in ok)) / (t1 - t0),
        "output_tok_s_source": "server generation_tokens_total" if gen else "client chunks",
        "generation_tokens": gen,
        "kv_transfer": {"requests": n_kv, "bytes_mean": kv_bytes, "blocks_mean": kv_blocks, "seconds_mean": kv_secs,
                        "blocks_requests": n_blocks},
        "kv_bytes_computed_per_long_request": computed,
        "ttft_split_ms": {k: (v[0] * 1e3, v[1]) for k, v in split.items()},
        "queue_time_ms": (queue_time[0] * 1e3, queue_time[1]),
        "idle_after_close_s": idle_after,
        "per_replica_window": per_replica,
    }


async def replicas_workload(base_url: str, a, tok, label: str) -> list[dict]:
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = []
    for c in a.concurrency:
        n = a.num_prompts or min(64, max(16, 4 * c))
        cfg = BenchConfig(base_url=base_url, model=model, num_prompts=n, input_len=a.input_len,
                          output_len=a.output_len, max_concurrency=c, seed=a.seed + 1000 * c, warmup=1,
                          label=f"{label} c={c}")  # (a seed per level: no prompt is cached from a level before)
        prompts = make_prompts(cfg, len(tok), tok.all_special_ids)
        s = await run_benchmark(cfg, prompts)
        print(f"[{label}] c={c}: {s['output_throughput']:.1f} tok/s, TTFT P50 {s['median_ttft_ms']:.0f} ms, "
              f"{s['completed']} ok / {s['failed']} failed", file=sys.stderr, flush=True)
        out.append(s)
    return out


# ------------------------------------------------------------------ tables
def _f(x: float, fmt: str = "{:.0f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def disagg_table(rows: list[dict]) -> str:
    head = ("| system | long-prompt TTFT P50 / P99 (ms) | decode ITL P50 / P99 / max (ms) "
            f"| decode stalls ≥ {STALL_MS / 1e3:g} s: gaps, s per stream | output tok/s "
            "| KV moved per long prompt | TTFT split: queue / prefill / transfer, mean (ms) | long prompts ok "
            "| load avg |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        d, lg = r["decode"], r["long"]
        kv = r["kv_transfer"]
        if r["disaggregated"]:
            if kv["requests"]:
                moved = f"{kv['bytes_mean'] / 2**20:.1f} MiB ({kv['blocks_mean']:.0f} blocks, {kv['seconds_mean'] * 1e3:.0f} ms; metric)"
            else:
                moved = f"{r['kv_bytes_computed_per_long_request'] / 2**20:.1f} MiB (computed from the model shape)"
            sp = r["ttft_split_ms"]
            split = " / ".join(_f(sp[k][0]) for k in ("queue", "prefill", "transfer")) + f" (n = {sp['queue'][1]})"
        else:
            moved = "0 (one engine)"
            q = r["queue_time_ms"]
            split = f"{_f(q[0])} / {_f(lg['ttft_mean_ms'] - q[0])} / - (queue from request_queue_time; n = {q[1]})"
        lines.append(f"| {r['label']} | {_f(lg['ttft_p50_ms'])} / {_f(lg['ttft_p99_ms'])} "
                     f"| {_f(d['itl_p50_ms'], '{:.1f}')} / {_f(d['itl_p99_ms'], '{:.1f}')} / {_f(d['itl_max_ms'])} "
                     f"| {d['stalls']}, {d['stalled_s']:.1f} s "
                     f"| {r['output_tok_s']:.1f} | {moved} | {split} | {lg['ok']} / {lg['sent']} "
                     f"| {r['loadavg'][0]:.1f} → {r['loadavg'][1]:.1f} |")
    return "\n".join(lines)


def replicas_table(runs: dict[str, list[dict]]) -> str:
    lines = ["| server | concurrency | prompts ok / failed | output tok/s | TTFT P50 / P99 (ms) | TPOT P50 / P99 (ms) "
             "| ITL P50 / P99 (ms) | load avg |", "|" + "---|" * 8]
    for label, ss in runs.items():
        for s in ss:
            lines.append(f"| {label} | {s['config']['max_concurrency']} | {s['completed']} / {s['failed']} "
                         f"| {s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} "
                         f"| {s['median_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} "
                         f"| {s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} "
                         f"| {s['loadavg_start']:.1f} → {s['loadavg_end']:.1f} |")
    names = list(runs)
    if len(names) == 2:
        one, two = (runs[n] for n in names)
        lines += ["", f"| concurrency | {names[1]} / {names[0]}: output tok/s | TTFT P50 | TPOT P50 |", "|---|---:|---:|---:|"]
        for s1, s2 in zip(one, two):
            r = lambda k: s2[k] / s1[k] if s1[k] else math.nan  # noqa: E731
            lines.append(f"| {s1['config']['max_concurrency']} | {r('output_throughput'):.2f}x "
                         f"| {r('median_ttft_ms'):.2f}x | {r('median_tpot_ms'):.2f}x |")
    return "\n".join(lines)


# -------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["both", "disagg", "replicas"], default="both")
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV pool GiB per engine/replica (default 1)")
    ap.add_argument("--replica-cpus", type=float, default=None, help="passed to the replicated servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="",
                    help="more kvserve serve options for every server, e.g. '--max-num-batched-tokens 512'")
    g = ap.add_argument_group("part 1: disaggregation")
    g.add_argument("--streams", type=int, default=4, help="decode streams kept running (default 4)")
    g.add_argument("--stream-prompt-len", type=int, default=32)
    g.add_argument("--stream-max-tokens", type=int, default=2048,
                   help="max_tokens of a decode stream (ended streams start again; default 2048)")
    g.add_argument("--long-prompts", type=int, default=8, help="long-prompt requests (default 8)")
    g.add_argument("--long-len", type=int, nargs=2, default=[1500, 2000], metavar=("MIN", "MAX"),
                   help="long prompts' tokens, uniform (default 1500 2000)")
    g.add_argument("--long-max-tokens", type=int, default=16)
    g.add_argument("--rate", type=float, default=0.125,
                   help="long-prompt arrivals per second, Poisson (default 0.125: one per 8 s on average)")
    g = ap.add_argument_group("part 2: replicas vs one engine")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: min(64, max(16, 4 x concurrency)))")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least_loaded", "round_robin"])
    ap.add_argument("--save-json", default=None)
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.long_len[0] < 2 or a.long_len[1] < a.long_len[0]:
        ap.error("--long-len MIN MAX: 2 <= MIN <= MAX")
    if a.rate <= 0 or a.streams < 1 or a.long_prompts < 1:
        ap.error("--rate, --streams and --long-prompts must be > 0")

    from kvserve.engine.tokenizer import load_tokenizer
    from kvserve.worker.worker import available_cores

    shape = model_shape(a.model, a.dtype)
    tok = load_tokenizer(shape["path"])
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="kvserve-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = available_cores()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    rc = ["--replica-cpus", str(a.replica_cpus)] if a.replica_cpus else []
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    report: dict = {"started_utc": started.isoformat(timespec="seconds"), "cpu": cpu, "cores": cores,
                    "ray_address": os.environ.get("RAY_ADDRESS"), "model": shape, "dtype": a.dtype,
                    "args": vars(a), "problems": {}}
    common = dict(model=a.model, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, log_dir=log_dir,
                  more=shlex.split(a.serve_args))

    if a.part in ("both", "disagg"):
        rows = []
        for label, extra, disagg in (("colocated (1 engine, chunked prefill)", [], False),
                                     ("1 prefill + 1 decode replica", ["--prefill-replicas", "1", "--decode-replicas", "1", *rc], True)):
            with Server(label, extra=extra, **common) as srv:
                r = asyncio.run(disagg_workload(srv.base_url, a, tok, shape))
            r.update(label=label, disaggregated=disagg, server_start_s=srv.start_seconds,
                     server_stop_s=srv.stop_seconds, health=srv.health)
            if r["long"]["errors"]:
                srv.problems.append(f"long-prompt requests failed: {r['long']['errors']}")
            if r["decode"]["errors"] or r["decode"]["lanes_alive_at_end"] < a.streams:
                srv.problems.append(f"decode streams failed: {r['decode']['errors']} "
                                    f"({r['decode']['lanes_alive_at_end']} of {a.streams} alive at the end)")
            if r["idle_after_close_s"] is None:
                srv.problems.append("requests still running/waiting 30 s after the decode streams were closed")
            if disagg and not r["kv_transfer"]["requests"]:
                srv.problems.append("kvserve:kv_transfer_bytes has no observation (KV bytes computed from the model "
                                    "shape instead)")
            report["problems"][label] = srv.problems
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "health"}, default=str), file=sys.stderr, flush=True)
        report["disagg"] = rows
    if a.part in ("both", "replicas"):
        runs = {}
        for label, extra in (("1 engine", []),
                             (f"2 replicas ({a.routing})", ["--data-parallel-size", "2", "--routing", a.routing, *rc])):
            with Server(label, extra=extra, **common) as srv:
                runs[label] = asyncio.run(replicas_workload(srv.base_url, a, tok, label))
            report["problems"][label] = srv.problems
        report["replicas"] = runs

    # ----- the report
    print(f"\n{started:%Y-%m-%d %H:%M} UTC; {cpu}, {cores} cores; model {Path(shape['path']).name} in {a.dtype}; "
          f"KV pool {a.kv_cache_memory:g} GiB per engine/replica" + (f"; serve {a.serve_args}" if a.serve_args else "")
          + f"; servers' logs in {log_dir}")
    print("Note: " + MACHINE_NOTE.format(cores=cores) + ".")
    load_end = os.getloadavg()
    report["loadavg_start_end"] = [load_start, load_end]
    if max(load_start[0], load_end[0]) > cores:
        print(f"Load average (1 min) {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end, on {cores} cores: "
              "other jobs were running, so every figure here is noisy (see each row's load average).")
    if os.environ.get("RAY_ADDRESS"):
        print(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}: the replicas ran on that Ray cluster.")
    if "disagg" in report:
        rows = report["disagg"]
        print(f"\n## Disaggregation: {a.streams} decode streams ({a.stream_prompt_len}-token prompts, greedy, "
              f"ignore_eos) running throughout; {a.long_prompts} long prompts of {a.long_len[0]}-{a.long_len[1]} "
              f"random tokens, {a.long_max_tokens} output tokens each, Poisson arrivals at {a.rate:g}/s (seed {a.seed})\n")
        print(disagg_table(rows))
        for r in rows:
            kv = r["kv_transfer"]
            print(f"\n{r['label']}: long prompts sent over {sum(r['arrival_gaps_s']):.1f} s, window (first sent to last "
                  f"finished) {r['window_s']:.1f} s; decode ITL over {r['decode']['itl_samples']} gaps "
                  f"(mean {r['decode']['itl_mean_ms']:.1f} ms), {r['decode']['restarts_in_window']} stream restarts "
                  f"in the window; long prompts' mean {r['long']['mean_prompt_len']:.0f} tokens, E2E P50 "
                  f"{r['long']['e2e_p50_ms']:.0f} ms; output tok/s from {r['output_tok_s_source']}; "
                  f"server ready in {r['server_start_s']:.1f} s, stopped in {r['server_stop_s']:.1f} s"
                  + (f"; KV transfers in the window: {kv['requests']} (kv_transfer_bytes), computed from the model "
                     f"shape: {r['kv_bytes_computed_per_long_request'] / 2**20:.1f} MiB per long prompt "
                     f"({shape['kv_bytes_per_token']} bytes per token)" if r["disaggregated"] else ""))
    if "replicas" in report:
        n = a.num_prompts or "min(64, max(16, 4 x concurrency))"
        print(f"\n## Replicas vs one engine: kvserve bench serve, random {a.input_len}-token prompts, "
              f"{a.output_len} output tokens, {n} requests per level, streaming, ignore_eos\n")
        print(replicas_table(report["replicas"]))
    problems = {k: v for k, v in report["problems"].items() if v}
    if problems:
        print("\nProblems seen in the servers:")
        for k, v in problems.items():
            for p in v:
                print(f"- {k}: {p}")
    if a.save_json:
        Path(a.save_json).write_text(json.dumps(report, indent=1, default=str))
        print(f"saved {a.save_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
