"""A ``kvserve serve`` process for the benchmarks, and its Prometheus metrics.

:class:`Server` starts ``kvserve serve`` on a free loopback port, waits for ``/health``, stops it
with SIGINT and checks that every process it started is gone; :func:`scrape` / :func:`msum` /
:func:`mdiff` / :func:`hist_mean` read ``/metrics``. Used by ``disaggregation.py``, ``soak.py``
and ``kv_offload_restart.py``.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx


# --------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, parent pid, start time) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """``{pid: start time}`` of the live (non-zombie) descendants of ``pid``."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[0] != "Z":
                table[int(entry)] = st
    out: dict[int, int] = {}
    frontier = {pid}
    while frontier:
        frontier = {p for p, st in table.items() if st[1] in frontier and p not in out}
        out.update({p: table[p][2] for p in frontier})
    return out


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


class Server:
    """One ``kvserve serve`` process: started on a free loopback port, ready once ``/health``
    answers 200 (every replica ``healthy``), stopped with SIGINT.

    ``problems`` collects what looked wrong (for the report): a slow or failed stop, processes
    left behind, tracebacks or errors in the server's log.
    """

    def __init__(self, label: str, model: Optional[str], dtype: str, kv_cache_memory: float, extra: list[str],
                 log_dir: Path, more: list[str] = (), start_timeout_s: float = 600.0) -> None:
        self.label = label
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--dtype", dtype,
                    "--kv-cache-memory", str(kv_cache_memory), "--port", str(self.port), "--no-access-log",
                    *(["--model", model] if model else []), *more, *extra]
        safe = "".join(c if c.isalnum() else "_" for c in label)
        self.log_path = log_dir / f"server_{safe}.log"
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self._stopped = False
        self.problems: list[str] = []
        self.health: dict = {}
        self.start_seconds = 0.0
        self.stop_seconds = 0.0

    def __enter__(self) -> "Server":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        print(f"[{self.label}] starting: {' '.join(self.cmd[1:])} (log {self.log_path})", file=sys.stderr, flush=True)
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        print(f"[{self.label}] ready in {self.start_seconds:.1f} s", file=sys.stderr, flush=True)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"[{self.label}] the server exited ({self.proc.returncode}) before it was ready:\n"
                                   + self.log_tail())
            try:
                r = httpx.get(self.base_url + "/health", timeout=5)
                if r.status_code == 200:
                    body = r.json() if r.content else {}
                    reps = body.get("replicas", {})
                    if all(v.get("state") == "healthy" for v in reps.values()):
                        self.health = body
                        return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"[{self.label}] not ready within {self.start_timeout_s:.0f} s:\n" + self.log_tail())
            time.sleep(0.5)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, wait for the exit (90 s), then check that every process it started is gone."""
        p = self.proc
        if p is None or self._stopped:
            return
        self._stopped = True
        kids = descendants(p.pid)
        t0 = time.perf_counter()
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                self.problems.append(f"the server (pid {p.pid}) did not exit within 90 s of SIGINT; sent SIGKILL")
                p.kill()
                p.wait(30)
        self.stop_seconds = time.perf_counter() - t0
        if p.returncode not in (0, -signal.SIGINT):
            self.problems.append(f"the server exited with code {p.returncode} after SIGINT")
        deadline = time.monotonic() + 30
        left = dict(kids)
        while left and time.monotonic() < deadline:
            left = {pid: st for pid, st in left.items() if _alive(pid, st)}
            time.sleep(0.2)
        if left:
            names = []
            for pid in left:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()[:100].replace(b"\0", b" ")
                    names.append(f"{pid} ({cmdline.decode(errors='replace').strip()})")
                except OSError:
                    names.append(str(pid))
            self.problems.append(f"{len(left)} process(es) the server started were still alive 30 s after it "
                                 f"exited: {'; '.join(names)} (killed now)")
            for pid, st in left.items():  # ours: descendants of the server this script started
                if _alive(pid, st):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self._log.close()
        log = self.log_path.read_text(errors="replace")
        for ln in log.splitlines():
            low = ln.lower()
            if "traceback" in low or ln.startswith(("ERROR", "CRITICAL")) or " error " in low and "kvserve" in low:
                self.problems.append(f"server log: {ln.strip()[:300]}")
        print(f"[{self.label}] stopped in {self.stop_seconds:.1f} s (exit code {p.returncode})", file=sys.stderr,
              flush=True)

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------ metrics
def scrape(base_url: str) -> tuple[float, dict]:
    """(time, ``{(sample name, ((label, value), ...)): value}``) of ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    t = time.perf_counter()
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return t, out


def msum(m: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (the others summed over)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def mdiff(m0: dict, m1: dict, name: str, **labels) -> float:
    return msum(m1, name, **labels) - msum(m0, name, **labels)


def hist_mean(m0: dict, m1: dict, name: str) -> tuple[float, int]:
    """(mean, count) of histogram ``name`` between two scrapes (NaN, 0 if nothing was observed)."""
    n = mdiff(m0, m1, name + "_count")
    return (mdiff(m0, m1, name + "_sum") / n if n else math.nan), int(n)
