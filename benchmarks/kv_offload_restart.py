"""TTFT of a long prompt after a server restart, with the prefix cache's disk tier (issue #23,
point 3): ``kvserve serve --kv-offload-dir DIR --kv-offload-gib N``.

Starts a real ``kvserve serve`` (SmolLM2 by default) on a fresh directory, sends a short
request (each server's first forward pays one-time costs), then a
``--prompt-len``-token prompt of random token ids (streamed, ``max_tokens`` 1; TTFT measured at
the client, to the first streamed token) and the same prompt again (an in-memory prefix hit),
stops the server with SIGINT (the blocks still in memory are written at shutdown), starts it
again on the same directory, and sends the prompt again (read back from disk) and a new prompt
of the same length (cold, in the restarted process). Prints the TTFTs, the ratio cold / disk,
the disk tier's counters from ``/metrics`` and the directory's size.

    python benchmarks/kv_offload_restart.py [--prompt-len 2000] [--model PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server_process import Server, scrape  # noqa: E402


def ttft(base_url: str, prompt: list[int]) -> float:
    """Seconds from sending ``prompt`` (token ids) to the first streamed token."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choice = json.loads(line[5:])["choices"][0]
                if choice.get("text") is not None:
                    return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def offload_counters(base_url: str) -> dict:
    _, m = scrape(base_url)
    return {name.split(":", 1)[1]: v for (name, _), v in m.items()
            if name.endswith("_total") and ("kv_offload" in name or "prefix_cache_hits" in name)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--kv-cache-memory", type=float, default=0.5)
    p.add_argument("--kv-offload-gib", type=float, default=2.0)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh temporary one, removed)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
    other = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
    directory = a.dir or tempfile.mkdtemp(prefix="kvserve-offload-")
    logs = Path(tempfile.mkdtemp(prefix="kvserve-offload-logs-"))
    extra = ["--kv-offload-dir", directory, "--kv-offload-gib", str(a.kv_offload_gib), "--max-model-len",
             str(max(4096, a.prompt_len + 16))]
    out: dict = {"load_average_start": os.getloadavg()}
    try:
        warm = [rng.randrange(100, 40000) for _ in range(32)]  # (a short request first: the process's first forward)
        with Server("first", a.model, a.dtype, a.kv_cache_memory, extra, logs) as s:
            ttft(s.base_url, warm)
            out["cold_first_server_s"] = ttft(s.base_url, prompt)
            out["memory_hit_s"] = ttft(s.base_url, prompt)
        out["stop_s"] = s.stop_seconds
        files = [f for f in os.listdir(directory) if f.endswith(".kvb")]
        out["files"] = len(files)
        out["dir_mib"] = sum(os.path.getsize(os.path.join(directory, f)) for f in files) / 2**20
        with Server("restarted", a.model, a.dtype, a.kv_cache_memory, extra, logs) as s:
            ttft(s.base_url, warm[::-1])
            out["disk_hit_s"] = ttft(s.base_url, prompt)
            out["cold_restarted_s"] = ttft(s.base_url, other)
            out["memory_hit_after_restart_s"] = ttft(s.base_url, prompt)
            out["metrics"] = offload_counters(s.base_url)
        out["problems"] = s.problems
        out["load_average_end"] = os.getloadavg()
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    cold = out["cold_restarted_s"]
    print(f"prompt {a.prompt_len} tokens, {a.dtype}, {out['files']} block files ({out['dir_mib']:.1f} MiB) "
          f"written by the first server (stopped in {out['stop_s']:.1f} s)")
    print("| request | TTFT (ms) |\n| --- | ---: |")
    for k, label in (("cold_first_server_s", "cold, first server"), ("memory_hit_s", "same prompt, memory hit"),
                     ("disk_hit_s", "same prompt after restart (disk)"),
                     ("cold_restarted_s", "new prompt after restart (cold)"),
                     ("memory_hit_after_restart_s", "same prompt again (memory)")):
        print(f"| {label} | {out[k] * 1000:.0f} |")
    print(f"cold / disk = {cold / out['disk_hit_s']:.1f}x (cold: the new prompt in the restarted server)")
    print("metrics after restart:", out["metrics"])
    print("load average:", out["load_average_start"], "->", out["load_average_end"], "problems:", out["problems"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
