"""Where a single-stream decode step's time goes (issue #22, point 2), against the bandwidth roofline.

SmolLM2-135M-Instruct, one request (a random ``--prompt-len`` prompt, ``--max-tokens`` greedy
tokens, EOS ignored) through the offline ``LLM`` API, for each ``--modes`` engine loaded at once:
``bf16`` (``quantization="none"``: the GGUF dequantized to bfloat16), ``q4_1``
(``quantization="gguf"``: the Q4_1 weights kept quantized, weight-only kernel) and ``q4_1_int8``
(``quantization="gguf_int8"``: the same weights, activations quantized to int8 per block, VNNI). Runs are interleaved (bf16, q4_1,
bf16, ...) so that a shared machine's changing load hits both alike; figures are medians over
the decode steps of all runs (the prefill step is left out).

A step is split into

* the model's forward inside the one-call C decode step, by phase (``DecodeStep.profile``: the
  RMSNorms, the QKV / O / gate-up / down GEMVs summed over the layers, RoPE, the KV write,
  attention, SiLU-and-mul, the LM head);
* the forward's Python around it (embedding lookup, the path choice);
* building the step's tensors (``ModelRunner.prepare_inputs``);
* sampling (the sampling rows and metadata, the sampler; ``ModelRunner.execute`` minus the two above);
* the scheduler (``Scheduler.schedule``), the engine core's bookkeeping (appending the token, stop
  checks, outputs: ``EngineCore.step`` minus the executor and the scheduler), output processing
  (detokenization, ``RequestOutput``: ``LLMEngine.step`` minus ``EngineCore.step``) and the
  ``LLM.generate`` loop (the rest of the interval between two steps' starts).

Each piece is timed by wrapping the method with ``time.perf_counter_ns`` (~1 us per step in all).
The roofline: the bytes of weights one decode step reads (every linear and the LM head,
:attr:`Linear.weight_nbytes`: bf16, or the packed Q4_1 blocks) at the memory bandwidth
:func:`kvserve.roofline.measure_memory_bandwidth` measures before and after the runs (the best of
several ``sgemv`` and ``sum`` passes over 512 MiB; the larger of the two measurements is used). KV reads (~0.2 MB per step at these lengths) are left out.

Usage:
    python benchmarks/decode_breakdown.py [--modes bf16,q4_1] [--max-tokens 256] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import kvserve  # noqa: F401  (before torch: sets GOMP_SPINCOUNT)
import torch

from kvserve import LLM, SamplingParams
from kvserve.core import scheduler as _scheduler
from kvserve.engine import core as _core
from kvserve.engine import llm_engine as _llm_engine
from kvserve.kernels import cpu_ops
from kvserve.roofline import measure_memory_bandwidth
from kvserve.worker import model_runner as _model_runner
from kvserve.worker.layers.linear import Linear
from kvserve.worker.models import llama as _llama

MODES = {"bf16": dict(quantization="none"), "q4_1": dict(quantization="gguf"), "q4_1_int8": dict(quantization="gguf_int8")}


class Timers:
    """Per-step timings: the wrapped methods' durations (ns) and the C step's phases."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.phases: list[list[int]] = []
        self.step_starts: list[int] = []

    def wrap(self, cls, name: str, key: str) -> None:
        f = getattr(cls, name)
        timers = self

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.perf_counter_ns()
            if key == "engine.step":
                timers.step_starts.append(t)
            try:
                return f(*a, **k)
            finally:
                timers.calls.setdefault(key, []).append(time.perf_counter_ns() - t)

        setattr(cls, name, timed)

    def wrap_decode_step(self) -> None:
        f = cpu_ops.DecodeStep.__call__
        timers = self

        @functools.wraps(f)
        def timed(step, *a, **k):
            if step.profile is None:
                step.profile = torch.zeros(len(step.PHASES), dtype=torch.int64)
            step.profile.zero_()
            t = time.perf_counter_ns()
            try:
                return f(step, *a, **k)
            finally:
                timers.calls.setdefault("c_step", []).append(time.perf_counter_ns() - t)
                timers.phases.append(step.profile.tolist())

        cpu_ops.DecodeStep.__call__ = timed


def install(timers: Timers) -> None:
    timers.wrap(_llm_engine.LLMEngine, "step", "engine.step")
    timers.wrap(_core.EngineCore, "step", "core.step")
    timers.wrap(_scheduler.Scheduler, "schedule", "schedule")
    timers.wrap(_model_runner.ModelRunner, "execute", "execute")
    timers.wrap(_model_runner.ModelRunner, "prepare_inputs", "prepare_inputs")
    timers.wrap(_llama.LlamaForCausalLM, "forward", "forward")
    timers.wrap_decode_step()


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of the weights one decode step reads: every Linear (LM head included)."""
    return sum(m.weight_nbytes for m in llm.engine.core.model.modules() if isinstance(m, Linear))


def one_run(llm: LLM, prompt: list[int], max_tokens: int, timers: Timers) -> dict:
    """Generate once; per-step rows (decode steps only) of the breakdown, in ms."""
    timers.calls.clear()
    timers.phases.clear()
    timers.step_starts.clear()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))[0]
    c = timers.calls
    n = len(c["engine.step"])
    if len(c.get("c_step", ())) != n - 1:
        raise RuntimeError(f"expected {n - 1} decode steps in the C decode step, got {len(c.get('c_step', ()))}: "
                           "is the one-call decode step in use (CPU kernels built, Llama model)?")
    phases = cpu_ops.DecodeStep.PHASES
    rows = []
    for i in range(1, n - 1):  # decode steps with a next step's start (the interval); step 0 is the prefill
        j = i - 1  # its index among the C step calls
        r = {f"C: {p}": timers.phases[j][k] / 1e6 for k, p in enumerate(phases)}
        c_total = c["c_step"][j] / 1e6
        r["C: other (calls, thread joins)"] = c_total - sum(timers.phases[j]) / 1e6
        r["forward: Python around the C step"] = c["forward"][i] / 1e6 - c_total
        r["prepare_inputs"] = c["prepare_inputs"][i] / 1e6
        r["sampling (rows, metadata, sampler)"] = (c["execute"][i] - c["forward"][i] - c["prepare_inputs"][i]) / 1e6
        r["scheduler"] = c["schedule"][i] / 1e6
        r["engine core bookkeeping"] = (c["core.step"][i] - c["execute"][i] - c["schedule"][i]) / 1e6
        r["output processing (detokenize)"] = (c["engine.step"][i] - c["core.step"][i]) / 1e6
        r["LLM loop"] = (timers.step_starts[i + 1] - timers.step_starts[i] - c["engine.step"][i]) / 1e6
        r["step"] = (timers.step_starts[i + 1] - timers.step_starts[i]) / 1e6
        r["(C decode step, all)"] = c_total
        r["(outside the C decode step)"] = r["step"] - c_total
        rows.append(r)
    return {"rows": rows, "decode_tok_s": out.metrics.decode_tokens_per_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--modes", default="bf16,q4_1", help="comma list of " + ", ".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--compare-team", action="store_true",
                    help="also run each mode with the C decode step's team path off (DecodeStep.team = False: "
                         "one OpenMP region per operation, as before it), interleaved with the default")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    if a.max_tokens < 3 or a.runs < 1 or a.prompt_len < 1:
        ap.error("--max-tokens must be >= 3, --runs and --prompt-len >= 1")
    bw0 = measure_memory_bandwidth()
    load0 = os.getloadavg()
    llms = {m: LLM(model=a.model, dtype="bfloat16", max_model_len=a.prompt_len + a.max_tokens + 8,
                   kv_cache_memory=0.25, enable_prefix_caching=False, **MODES[m]) for m in modes}
    vocab = llms[modes[0]].engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (a.prompt_len,), generator=g).tolist()
    for llm in llms.values():  # warm-up (and the C decode step built)
        llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    timers = Timers()
    install(timers)
    # (label, mode, team path) of each configuration, run in this order in every round
    configs = [(m, m, True) for m in modes]
    if a.compare_team:
        configs = [c for m in modes for c in ((m, m, True), (f"{m} (team off)", m, False))]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    for _ in range(a.runs):
        for label, m, team in configs:
            llms[m].engine.core.model._decode_step.team = team
            runs[label].append(one_run(llms[m], prompt, a.max_tokens, timers))
        for m in modes:
            llms[m].engine.core.model._decode_step.team = True
    bw1 = measure_memory_bandwidth()
    load1 = os.getloadavg()
    bw = max(bw0, bw1)
    print(f"SmolLM2-135M-Instruct single stream, prompt {a.prompt_len} tokens, {a.max_tokens} greedy tokens, "
          f"{a.runs} runs per mode interleaved, torch threads {torch.get_num_threads()}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    print(f"memory bandwidth {bw0 / 1e9:.1f} GB/s before, {bw1 / 1e9:.1f} after (roofline uses the larger); "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    result = {"bandwidth_GBps": [bw0 / 1e9, bw1 / 1e9], "load_avg": [load0[0], load1[0]], "modes": {}}
    for label, m, _ in configs:
        rows = [r for run in runs[label] for r in run["rows"]]
        keys = list(rows[0])
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        step = med["step"]
        wb = decode_weight_bytes(llms[m])
        roof = bw / wb
        tok_s = 1e3 / step
        tok_s_metrics = statistics.median(run["decode_tok_s"] for run in runs[label])
        result["modes"][label] = {"median_ms": med, "weight_bytes": wb, "roofline_tok_s": roof,
                              "tok_s_from_median_step": tok_s, "decode_tok_s_metrics": tok_s_metrics,
                              "decode_tok_s_runs": [run["decode_tok_s"] for run in runs[label]]}
        print(f"\n{label}: weights read per token {wb / 1e6:.1f} MB, roofline {roof:.1f} tok/s; median step "
              f"{step:.2f} ms = {tok_s:.1f} tok/s = {tok_s / roof:.1%} of the roofline (engine metrics: "
              f"{tok_s_metrics:.1f} tok/s median of runs {[round(r['decode_tok_s'], 1) for r in runs[label]]})")
        print(f"| {label} part of a decode step | ms (median) | % of step |")
        print("|---|---:|---:|")
        for k in keys:
            if k != "step":
                print(f"| {k} | {med[k]:.3f} | {med[k] / step:.1%} |")
        print(f"| (the weights at the measured bandwidth: the roofline's step) | {1e3 / roof:.3f} | "
              f"{1e3 / roof / step:.1%} |")
        print("(each part's median over the steps: the parts need not add up to the median step)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
