"""One table of benchmarks/serve_vs_peers.sh's results: output tok/s and P99 TTFT per system, load
generator and concurrency, then the ratios of kvserve (bf16) and kvserve-q4 (Q4_1 weights kept quantized) / each peer.

Reads ``SYSTEM_TOOL_cN.json`` files in a folder, TOOL being ``kvserve-bench`` (``kvserve bench
serve --save-json``) or ``vllm-bench`` (``vllm bench serve --save-result``); both write
``output_throughput`` (tokens/s), ``p99_ttft_ms``, ``median_ttft_ms`` and ``completed``. Uses only
the standard library (it runs with either venv).

Usage: python benchmarks/peers/serve_table.py RESULTS_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"^(?P<system>[a-z0-9.-]+)_(?P<tool>kvserve-bench|vllm-bench)_c(?P<c>\d+)\.json$")
TOOLS = ("kvserve-bench", "vllm-bench")
ORDER = {"kvserve": 0, "kvserve-q4": 1, "vllm": 2, "llama-server": 3}


def load(folder: Path) -> dict[tuple[str, str, int], dict]:
    """``{(system, tool, concurrency): result}`` of the folder's result files (others are ignored)."""
    out = {}
    for p in sorted(folder.iterdir()):
        m = NAME.match(p.name)
        if m:
            out[(m["system"], m["tool"], int(m["c"]))] = json.loads(p.read_text())
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return "- | -"
    failed = r.get("failed", 0) or 0
    note = f" ({failed} failed)" if failed else ""
    return f"{r['output_throughput']:.1f}{note} | {r['p99_ttft_ms']:.0f}"


def table(results: dict[tuple[str, str, int], dict]) -> str:
    """Markdown: a row per (system, concurrency), the two load generators side by side; then ratios."""
    systems = sorted({s for s, _, _ in results}, key=lambda s: (ORDER.get(s, 9), s))
    levels = sorted({c for _, _, c in results})
    lines = ["| system | concurrency | kvserve bench: output tok/s | P99 TTFT (ms) "
             "| vllm bench: output tok/s | P99 TTFT (ms) |", "|---|---:|---:|---:|---:|---:|"]
    for s in systems:
        for c in levels:
            if any((s, t, c) in results for t in TOOLS):
                lines.append(f"| {s} | {c} | " + " | ".join(_cell(results.get((s, t, c))) for t in TOOLS) + " |")
    ours = [s for s in systems if s.startswith("kvserve")]  # kvserve (bf16) and kvserve-q4 (quantized)
    for mine in ours:
        for peer in [s for s in systems if not s.startswith("kvserve")]:
            lines += ["", f"{mine} / {peer} (output tok/s ratio; P99 TTFT ratio, < 1 is {mine} faster):", "",
                      "| concurrency | kvserve bench: tok/s | P99 TTFT | vllm bench: tok/s | P99 TTFT |",
                      "|---:|---:|---:|---:|---:|"]
            for c in levels:
                cells = []
                for t in TOOLS:
                    k, p = results.get((mine, t, c)), results.get((peer, t, c))
                    if k is None or p is None or not p["output_throughput"] or not p["p99_ttft_ms"]:
                        cells += ["-", "-"]
                    else:
                        cells += [f"{k['output_throughput'] / p['output_throughput']:.2f}x",
                                  f"{k['p99_ttft_ms'] / p['p99_ttft_ms']:.2f}x"]
                lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: serve_table.py RESULTS_DIR (a folder of SYSTEM_TOOL_cN.json files)", file=sys.stderr)
        return 2
    results = load(Path(argv[0]))
    if not results:
        print(f"no SYSTEM_(kvserve|vllm)-bench_cN.json results in {argv[0]}", file=sys.stderr)
        return 1
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
