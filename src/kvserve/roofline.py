"""Roofline numbers of the machine we run on: memory bandwidth and peak matmul rate.

A decoder step is bounded by two ceilings (Williams, Waterman & Patterson 2009, "Roofline"):

* **bandwidth**: every weight is read once per step, so one sequence cannot decode faster
  than ``memory_bandwidth / bytes_of_weights`` tokens/s;
* **compute**: a token costs ``2 · params`` FLOPs in the linears, so a large batch cannot go
  faster than ``matmul_flops / (2 · params)`` tokens/s.

The benchmark scripts print measured throughput against both. Both measurements here are
best-of-N (a ceiling, not a typical value) and take about 1-3 s each on the 2-core
development machine; on CPU they use the current ``torch.get_num_threads()``, on a CUDA
device they synchronize around each timed call.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU): timings of CUDA work need it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], *, min_reps: int, budget_s: float,
               sync: Callable[[], None] = lambda: None) -> float:
    """Smallest wall time of ``fn(); sync()`` over at least ``min_reps`` runs or ``budget_s`` seconds."""
    fn()  # warm-up: page faults, kernel selection, caches of primitives
    sync()
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
        reps += 1
        if reps >= 10 * min_reps and time.perf_counter() - start >= budget_s:
            break
    return best


def measure_memory_bandwidth(size_bytes: int = 512 << 20, budget_s: float = 1.5, device: str = "cpu") -> float:
    """Sustained read bandwidth from main memory (``device``'s memory), in bytes/s.

    Streams a ``size_bytes`` float32 matrix ``[size / 16 KiB, 4096]`` two ways and keeps the
    faster: a matrix-vector product (MKL ``sgemv``, the access pattern of a decode step reading
    its weights) and a sum of all its elements (``torch.sum``, one sequential stream per
    thread, as STREAM's read kernels). Every byte is read once, with almost no compute. Keep
    ``size_bytes`` well above the last-level cache (the 2-core AMD EPYC reports 32 MiB of L3,
    the AMX Xeon 300 MiB; the default is 512 MiB; a GPU's L2 is tens of MiB).

    Until 2026-12-03 this was ``sgemv`` alone, which on the AMD EPYC reads 20-21 GB/s where
    the sum reads 29-33 GB/s (and kvserve's own bf16 decode GEMVs, once they read one
    sequential stream per thread, 26-29): rooflines computed with it were too low by about a
    third there, and shares of them too high.

    Args:
        device: ``"cpu"`` or a CUDA device (cuBLAS ``sgemv`` and a reduction, synchronized).

    Returns:
        Best observed bytes/s (a ceiling for "bytes of weights per second").
    """
    dev = torch.device(device)
    cols = 4096
    rows = max(1, size_bytes // (4 * cols))
    w = torch.empty(rows, cols, dtype=torch.float32, device=dev).uniform_(-1.0, 1.0)
    x = torch.ones(cols, dtype=torch.float32, device=dev)
    y = torch.empty(rows, dtype=torch.float32, device=dev)
    sync = lambda: synchronize(dev)  # noqa: E731
    t_mv = _best_time(lambda: torch.mv(w, x, out=y), min_reps=3, budget_s=budget_s / 2, sync=sync)
    t_sum = _best_time(lambda: torch.sum(w), min_reps=3, budget_s=budget_s / 2, sync=sync)
    return w.numel() * w.element_size() / min(t_mv, t_sum)


def measure_matmul_flops(dtype: torch.dtype = torch.bfloat16, n: int = 2048, budget_s: float = 1.5,
                         device: str = "cpu") -> float:
    """Peak dense matmul rate of ``torch.matmul`` on ``[n, n] @ [n, n]`` in ``dtype``, in FLOP/s.

    On the development CPU bf16 goes through oneDNN (AMX tiles) and float32 through MKL
    ``sgemm``. ``n = 2048`` was the fastest of 1024/2048/4096 there; a datacenter GPU needs
    ``n = 8192`` to reach its peak (cuBLAS; float32 follows ``torch.backends.cuda.matmul``).

    Args:
        dtype: ``torch.bfloat16``, ``torch.float32`` (or ``torch.float16`` where supported).
        n: matrix side.
        budget_s: roughly how long to keep measuring.
        device: ``"cpu"`` or a CUDA device.

    Returns:
        Best observed ``2 · n³ / seconds``.
    """
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    t = _best_time(lambda: torch.matmul(a, b, out=out), min_reps=3, budget_s=budget_s, sync=lambda: synchronize(dev))
    return 2.0 * n**3 / t


def sustained_rate(fn: Callable[[], object], work_per_call: float, seconds: float, window_s: float = 0.25,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[float]]:
    """Mean rate of ``fn`` run back to back for ``seconds`` (after one warm-up call).

    Args:
        fn: one unit of work; work_per_call: its size (e.g. FLOPs).
        seconds: how long to keep calling ``fn``; window_s: length of the windows of ``trace``.
        clock: time source in seconds (tests inject a fake one).

    Returns:
        ``(total work / total seconds, [rate of each window])``.
    """
    fn()
    start = last = clock()
    calls = window_calls = 0
    trace: list[float] = []
    while True:
        fn()
        calls += 1
        window_calls += 1
        now = clock()
        if now - last >= window_s:
            trace.append(window_calls * work_per_call / (now - last))
            last, window_calls = now, 0
        if now - start >= seconds:
            return calls * work_per_call / (now - start), trace


def measure_matmul_flops_sustained(dtype: torch.dtype = torch.bfloat16, n: int = 2048,
                                   seconds: float = 8.0, device: str = "cpu") -> tuple[float, list[float]]:
    """Mean matmul rate (FLOP/s) of ``[n, n] @ [n, n]`` in ``dtype`` run back to back for
    ``seconds``, and the rate of each 0.25 s window.

    :func:`measure_matmul_flops` reports the best moment; on a shared machine the rate a long
    workload gets can be far lower. On the development VM (2 vCPUs) the bf16 rate alternates
    between ~750 and ~2100 GFLOP/s within seconds under sustained load (a 40 s trace: mostly
    ~780, bursts near 2000), so a best-of peak taken in a burst overstates the ceiling of a
    20 s run about 2x. This mean is the ceiling a perfect engine would see on average. On a
    CUDA ``device`` each call synchronizes (so a window counts finished work only).
    """
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    def call():
        torch.matmul(a, b, out=out)
        synchronize(dev)

    return sustained_rate(call, 2.0 * n**3, seconds)


def decode_roofline_tokens_per_s(weight_bytes: float, bandwidth: float) -> float:
    """Upper bound on single-sequence decode speed: ``bandwidth / weight_bytes`` (tokens/s)."""
    return bandwidth / weight_bytes


def compute_roofline_tokens_per_s(params: float, flops: float) -> float:
    """Upper bound on batched throughput: ``flops / (2 · params)`` (tokens/s)."""
    return flops / (2.0 * params)


def attainable_seconds(prompt_lens: list[int], output_lens: list[int], params: float, weight_bytes: float,
                       kv_bytes_per_token: float, flops: float, bandwidth: float) -> dict[str, float]:
    """Lower bound on the wall time of an offline batch where every request starts at once.

    Prefill is compute-bound (``2 · params`` FLOPs per prompt token at ``flops``). After it,
    decode step ``s`` (``s = 1 .. max(output_lens) - 1``; the first output token comes from
    prefill) runs every request with ``output_len > s`` and costs at least the larger of
    reading all weights plus each running request's KV cache (``prompt_len + s`` tokens) at
    ``bandwidth``, and ``2 · params`` FLOPs per running request at ``flops`` (the roofline per
    step). Attention FLOPs and everything else are free, so no engine can beat this.

    Args:
        prompt_lens, output_lens: tokens per request (same length lists).
        params: parameter count; weight_bytes: bytes read per step for the weights.
        kv_bytes_per_token: ``2 · layers · kv_heads · head_dim · dtype_bytes``.
        flops: matmul rate (FLOP/s); bandwidth: memory bandwidth (bytes/s).

    Returns:
        ``{"prefill_s", "decode_s", "total_s", "decode_memory_bound_steps"}``.
    """
    prefill = 2.0 * params * sum(prompt_lens) / flops
    decode, mem_bound = 0.0, 0
    for s in range(1, max(output_lens, default=0)):
        running = [p for p, o in zip(prompt_lens, output_lens) if o > s]
        mem = (weight_bytes + kv_bytes_per_token * sum(p + s for p in running)) / bandwidth
        comp = 2.0 * params * len(running) / flops
        decode += max(mem, comp)
        mem_bound += mem >= comp
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode,
            "decode_memory_bound_steps": mem_bound}
