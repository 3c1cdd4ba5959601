"""Start-up time and resident memory: ``kvserve generate`` / ``kvserve serve`` and llama.cpp's
``llama-server`` on the same GGUF file, in one run.

Measures, each as the median of ``--runs`` cold process starts (warm file cache: one unmeasured
start first):

* ``kvserve generate PROMPT --max-tokens 8``: seconds from the command to its first streamed token;
* ``kvserve serve`` and ``llama-server``, default flags: seconds to ready (first 200 on
  ``/health``), seconds from the command to the first streamed token of a completion sent as
  soon as it is ready, resident set (``VmRSS``) once ready and after ``--requests`` completions
  of 32 tokens, and the peak (``VmHWM``), each summed over the server's processes (kvserve's API
  process and its engine-core process).

Usage::

    python benchmarks/startup.py [--llama-server PATH] [--model GGUF] [--runs 3] [--requests 4]

``llama-server`` is built outside the repository (``benchmarks/serve_vs_peers.sh build``, or
``cmake -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF`` on the llama-cpp-python sdist's vendored
llama.cpp); without ``--llama-server`` its rows say "skipped". Run it on a quiet machine: one
process at a time is started, and every one is stopped before the next.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

PROMPT = "The capital of France is"


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``kvserve serve`` runs its engine core in a child process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB (10^6 bytes), summed over the process and its descendants (the peak
    is the sum of each process's own peak: an upper bound on the tree's)."""
    rss = hwm = 0.0
    for q in process_tree(pid):
        try:
            with open(f"/proc/{q}/status") as f:
                st = {line.split(":")[0]: line.split(":")[1] for line in f}
        except OSError:
            continue
        rss += int(st["VmRSS"].split()[0]) * 1024 / 1e6
        hwm += int(st["VmHWM"].split()[0]) * 1024 / 1e6
    return rss, hwm


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process and its descendants have used so
    far: on a busy machine the wall-clock figures grow with the load, this much less."""
    total = 0.0
    for q in process_tree(pid):
        try:
            with open(f"/proc/{q}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def load_average() -> float:
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_ttft(python: str, model: Optional[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) from starting ``kvserve generate`` to its first non-blank byte on stdout."""
    cmd = [python, "-m", "kvserve.entrypoints.cli", "generate", PROMPT, "--max-tokens", "8"]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = None
    while True:
        b = os.read(p.stdout.fileno(), 1)
        if not b:
            break
        if first is None and b.strip():
            first = time.perf_counter() - t0
            cpu = cpu_s(p.pid)
    err = p.stderr.read().decode(errors="replace")
    if p.wait() != 0 or first is None:
        raise RuntimeError(f"kvserve generate failed ({p.returncode}): {err[-2000:]}")
    return first, cpu


def _health(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


def _completion(port: int, model: str, max_tokens: int, stream: bool) -> None:
    """One /v1/completions request (greedy); with stream, returns at the first text chunk."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": stream})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"completion: HTTP {r.status}: {r.read()[:500]!r}")
    if not stream:
        r.read()
    else:
        while True:
            line = r.readline()
            if not line:
                raise RuntimeError("stream ended without text")
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                break
    c.close()


def serve_run(cmd: list[str], port: int, model: str, requests: int, env: dict) -> dict:
    """Start a server, wait for /health, stream one completion, measure RSS, send ``requests``
    completions, measure again, stop it."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        while not _health(port):
            if p.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited ({p.returncode}): {p.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"{cmd[0]} not ready after 300 s")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        cpu_ready = cpu_s(p.pid)
        rss_ready, _ = rss_mb(p.pid)
        _completion(port, model, 8, stream=True)
        first = time.perf_counter() - t0
        for _ in range(requests):
            _completion(port, model, 32, stream=False)
        rss_after, hwm = rss_mb(p.pid)
        return {"ready": ready, "cpu_ready": cpu_ready, "first": first, "rss_ready": rss_ready,
                "rss_after": rss_after, "hwm": hwm, "load": load_average()}
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary (default: skipped)")
    ap.add_argument("--model", default=None, help="GGUF file (default: kvserve's default SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs kvserve (default: this one)")
    ap.add_argument("--runs", type=int, default=3, help="measured starts of each command (median; default 3)")
    ap.add_argument("--requests", type=int, default=4, help="completions sent before the second RSS reading")
    ap.add_argument("--label", default="kvserve", help="name of the kvserve rows (e.g. a branch; default kvserve)")
    a = ap.parse_args()
    if a.runs < 1 or a.requests < 0:
        ap.error("--runs must be >= 1 and --requests >= 0")
    env = dict(os.environ)
    model = a.model
    if model is None:
        model = subprocess.check_output(
            [a.python, "-c", "from kvserve.worker.default_model import default_model_path; print(default_model_path())"],
            env=env, text=True).strip()
    name = os.path.basename(model).removesuffix(".gguf")

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"{name}", file=sys.stderr)
    generate_ttft(a.python, model, env)  # warm the file cache
    gen = [generate_ttft(a.python, model, env) for _ in range(a.runs)]
    gen_wall, gen_cpu = statistics.median(g[0] for g in gen), statistics.median(g[1] for g in gen)
    print(f"kvserve generate: first token {gen_wall:.2f} s, {gen_cpu:.2f} CPU s (runs "
          f"{', '.join(f'{w:.2f}' for w, _ in gen)}; load average {load_average():.1f})", file=sys.stderr)

    rows = {}
    port = free_port()
    kv_cmd = [a.python, "-m", "kvserve.entrypoints.cli", "serve", "--model", model, "--port", str(port),
              "--served-model-name", name, "--no-access-log", "--log-level", "warning"]
    kv = f"{a.label} serve"
    rows[kv] = median_of([serve_run(kv_cmd, port, name, a.requests, env) for _ in range(a.runs)])
    print(f"{kv}: {rows[kv]}", file=sys.stderr)
    if a.llama_server:
        port = free_port()
        ll_cmd = [a.llama_server, "-m", model, "--port", str(port), "--host", "127.0.0.1"]
        serve_run(ll_cmd, port, name, 0, env)  # (its file cache)
        rows["llama-server"] = median_of([serve_run(ll_cmd, port, name, a.requests, env) for _ in range(a.runs)])
        print(f"llama-server: {rows['llama-server']}", file=sys.stderr)

    print(f"\n{a.label}: `kvserve generate \"{PROMPT}\" --max-tokens 8`: first token **{gen_wall:.2f} s** after the "
          f"command ({gen_cpu:.2f} CPU s; median of {a.runs}; warm file cache).\n")
    print("| server (default flags) | ready (s) | CPU to ready (s) | first token (s) | RSS ready (MB) "
          f"| RSS after {a.requests} requests (MB) | peak RSS (MB) | load average |")
    print("|---|---|---|---|---|---|---|---|")
    for label in (kv, "llama-server"):
        r = rows.get(label)
        if r is None:
            print(f"| {label} | skipped | | | | | | |")
        else:
            print(f"| {label} | {r['ready']:.2f} | {r['cpu_ready']:.2f} | {r['first']:.2f} | {r['rss_ready']:.0f} "
                  f"| {r['rss_after']:.0f} | {r['hwm']:.0f} | {r['load']:.1f} |")
    if "llama-server" in rows:
        k, l = rows[kv], rows["llama-server"]
        print(f"\n{a.label} / llama-server: ready {k['ready'] / l['ready']:.1f}x the time, first token "
              f"{k['first'] / l['first']:.1f}x, RSS after requests {k['rss_after'] / l['rss_after']:.1f}x.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
