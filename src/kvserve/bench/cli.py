"""``kvserve bench serve``: measure any OpenAI-compatible server (kvserve, vLLM, llama-server);
a progress bar of the requests on a terminal, ``--plot`` draws the latency distributions."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Callable


def add_parsers(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None],
                engine_kwargs: Callable[[argparse.Namespace], dict]) -> None:
    """Register ``bench`` (with its ``serve`` subcommand) on the ``kvserve`` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)",
                        description="Send streaming requests to an OpenAI-compatible server with Poisson "
                                    "arrivals or a fixed concurrency; report throughput and TTFT/TPOT/ITL/E2E "
                                    "latency as a table and as JSON.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="'model' field (default: the first model of GET /v1/models)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (after any shared prefix)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input lengths uniform in len·[1-r, 1+r] (default 0: fixed)")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix workload: prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix workload: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (default inf)")
    p.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int, default=None,
                   help="most requests in flight (default: unbounded)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the prompts (GGUF file / HF folder; default: kvserve's default model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests sent first (default 1)")
    p.add_argument("--label", default="", help="name of the run in the table and JSON")
    p.add_argument("--save-json", default=None, help="write the result JSON here (with every latency sample)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw the TTFT, TPOT, ITL and end-to-end latency distributions (histograms and CDFs) "
                        "into this .png/.svg/.pdf (needs matplotlib: pip install 'kvserve[plot]')")
    p.set_defaults(func=cmd_bench_serve)


def _model_name(base_url: str, api_key) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _check_args(a: argparse.Namespace) -> None:
    """ValueError naming the first option out of range (before anything is sent)."""
    def need(ok: bool, option: str, allowed: str, value) -> None:
        if not ok:
            raise ValueError(f"{option} must be {allowed}, got {value!r}")

    need(a.base_url.startswith(("http://", "https://")), "--base-url", "an http:// or https:// URL", a.base_url)
    need(a.num_prompts >= 1, "--num-prompts", "≥ 1", a.num_prompts)
    need(a.random_input_len >= 1, "--random-input-len", "≥ 1 (tokens)", a.random_input_len)
    need(a.random_output_len >= 1, "--random-output-len", "≥ 1 (tokens)", a.random_output_len)
    need(0.0 <= a.random_range_ratio < 1.0, "--random-range-ratio", "in [0, 1)", a.random_range_ratio)
    need(a.shared_prefix_len >= 1, "--shared-prefix-len", "≥ 1 (tokens)", a.shared_prefix_len)
    need(a.num_prefixes >= 1, "--num-prefixes", "≥ 1", a.num_prefixes)
    need(a.request_rate > 0, "--request-rate", "> 0 requests/s (inf: all at once)", a.request_rate)
    need(a.max_concurrency is None or a.max_concurrency >= 1, "--max-concurrency", "≥ 1 (omit: unbounded)",
         a.max_concurrency)
    need(0.0 <= a.temperature < math.inf, "--temperature", "≥ 0 and finite", a.temperature)
    need(a.warmup >= 0, "--warmup", "≥ 0 (requests)", a.warmup)
    need(a.tokenizer is None or Path(a.tokenizer).exists(), "--tokenizer", "an existing GGUF file or folder",
         a.tokenizer)
    if a.save_json:  # before the run, not after it
        out = Path(a.save_json)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--save-json: cannot create {str(out.parent)!r}: {e.strerror or e}") from None
        need(not out.is_dir(), "--save-json", "a file path", a.save_json)
    if a.plot:
        from kvserve.bench.plot import check_plot_path

        check_plot_path(a.plot)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import httpx

    from kvserve.bench.serve import BenchConfig, format_table, make_prompts, run_benchmark
    from kvserve.worker.default_model import default_model_path
    from kvserve.engine.tokenizer import load_tokenizer

    _check_args(a)
    try:
        model = a.model or _model_name(a.base_url, a.api_key)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"error: cannot list the models of {a.base_url} (GET /v1/models; pass --model to skip it): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    cfg = BenchConfig(
        base_url=a.base_url, model=model, endpoint=a.endpoint, dataset=a.dataset, num_prompts=a.num_prompts,
        input_len=a.random_input_len, output_len=a.random_output_len, range_ratio=a.random_range_ratio,
        prefix_len=a.shared_prefix_len if a.dataset == "shared-prefix" else 0, num_prefixes=a.num_prefixes,
        request_rate=a.request_rate, max_concurrency=a.max_concurrency, temperature=a.temperature,
        ignore_eos=not a.no_ignore_eos, api_key=a.api_key, seed=a.seed, warmup=a.warmup, label=a.label,
    )
    tok = load_tokenizer(a.tokenizer or default_model_path())
    prompts = make_prompts(cfg, len(tok), tok.all_special_ids)
    texts = [tok.decode(p) for p in prompts] if cfg.endpoint == "chat" else None
    try:
        summary = asyncio.run(run_benchmark(cfg, prompts, texts, progress=None))  # (a bar on a terminal)
    except RuntimeError as e:  # the warm-up failed: the server is unreachable or rejects these requests
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    if a.save_json:
        Path(a.save_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.save_json).write_text(json.dumps(summary, indent=2))
        print(f"saved {a.save_json}", file=sys.stderr)
    if a.plot:
        from kvserve.bench.plot import plot_latencies

        print(f"saved {plot_latencies(summary, a.plot)}", file=sys.stderr)
    return 0 if summary["completed"] > 0 else 1
