"""Markdown table of several ``kvserve bench serve --save-json`` results, with ratios.

Usage: ``python -m kvserve.bench.report RESULT.json ...``. Runs are grouped by their label's
name (the text before `` c=``); for each concurrency measured by both ``kvserve`` and a peer,
a ratio line compares output throughput and P99 TTFT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _name(s: dict) -> str:
    return (s.get("label") or "run").split(" c=")[0]


def markdown(results: list[dict]) -> str:
    head = ("| server | concurrency | ok / failed | req/s | output tok/s | TTFT mean / median / P99 (ms) "
            "| TPOT mean / median / P99 (ms) | ITL mean / median / P99 (ms) | E2E mean / median / P99 (s) | load avg |")
    lines = [head, "|" + "---|" * 10]
    results = sorted(results, key=lambda s: (_name(s), s["config"].get("max_concurrency") or 1 << 30))
    for s in results:
        c = s["config"].get("max_concurrency") or "∞"

        def three(k, scale=1.0, fmt="{:.0f}"):
            return " / ".join(fmt.format(s[f"{p}_{k}_ms"] * scale) for p in ("mean", "median", "p99"))

        lines.append(
            f"| {_name(s)} | {c} | {s['completed']} / {s['failed']} | {s['request_throughput']:.2f} "
            f"| {s['output_throughput']:.1f} | {three('ttft')} | {three('tpot', fmt='{:.1f}')} "
            f"| {three('itl', fmt='{:.1f}')} | {three('e2el', 1e-3, '{:.2f}')} "
            f"| {s.get('loadavg_start', float('nan')):.1f} → {s.get('loadavg_end', float('nan')):.1f} |"
        )
    by = {(_name(s), s["config"].get("max_concurrency")): s for s in results}
    names = sorted({_name(s) for s in results})
    if "kvserve" in names:
        for peer in [n for n in names if n != "kvserve"]:
            for (name, c), s in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
                p = by.get((peer, c))
                if name != "kvserve" or p is None or p["output_throughput"] == 0:
                    continue
                lines.append("")
                lines.append(
                    f"concurrency {c}: kvserve / {peer} output throughput = "
                    f"{s['output_throughput'] / p['output_throughput']:.2f}x; P99 TTFT "
                    f"{s['p99_ttft_ms']:.0f} ms vs {p['p99_ttft_ms']:.0f} ms "
                    f"({s['p99_ttft_ms'] / max(p['p99_ttft_ms'], 1e-9):.2f}x)"
                )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    results = [json.loads(Path(p).read_text()) for p in argv]
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
