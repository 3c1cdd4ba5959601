"""Latency distributions of a ``kvserve bench serve`` run as one picture (``--plot out.png``).

Four panels, TTFT, TPOT, ITL and end-to-end latency: a histogram of the run's samples
(milliseconds) with its CDF on a second axis, and the mean, median and P99 of the summary
marked (and written in the panel's title). matplotlib is an optional dependency (``pip install 'kvserve[plot]'``), imported only
when a plot is drawn.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

#: The series of :func:`kvserve.bench.serve.summarize` (``summary["series_ms"]``) and their titles.
SERIES = (("ttft", "Time to first token"), ("tpot", "Time per output token (after the first)"),
          ("itl", "Inter-token latency"), ("e2el", "End-to-end latency"))
STATS = (("mean", "mean", ":"), ("median", "median", "--"), ("p99", "P99", "-."))  # summary key, label, line
FORMATS = (".png", ".svg", ".pdf")
MATPLOTLIB_HINT = "pip install 'kvserve[plot]' (matplotlib==3.11.2)"


def check_plot_path(path: str | Path) -> None:
    """What ``--plot PATH`` needs before a run: a known image suffix, a folder that can be
    created, and matplotlib installed.

    Raises:
        ValueError: naming ``--plot`` and what is wrong.
    """
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot must end in {', '.join(FORMATS)} (the image format), got {str(path)!r}")
    if out.is_dir():
        raise ValueError(f"--plot must be a file path, got the folder {str(path)!r}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--plot: cannot create {str(out.parent)!r}: {e.strerror or e}") from None
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--plot needs matplotlib, which is not installed: {MATPLOTLIB_HINT}")


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"drawing latency plots needs matplotlib: {MATPLOTLIB_HINT}") from e
    return Figure


def plot_latencies(summary: dict[str, Any], path: str | Path, dpi: int = 100) -> Path:
    """Draw ``summary``'s latency distributions into ``path`` (its suffix picks the format).

    Args:
        summary: a :func:`~kvserve.bench.serve.summarize` result, with ``series_ms`` (each
            request's TTFT, TPOT and end-to-end latency, and every inter-token gap, in ms) and
            the ``mean_/median_/p99_<name>_ms`` figures.
        path: the image file to write (``.png``, ``.svg`` or ``.pdf``).
        dpi: resolution of a PNG (the figure is 12 × 8 inches).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        KeyError: ``summary`` has no ``series_ms`` (a summary from an older kvserve).
    """
    Figure = _figure_class()
    series = summary["series_ms"]
    fig = Figure(figsize=(12, 8), layout="constrained")
    handles = []
    for ax, (name, title) in zip(fig.subplots(2, 2).flat, SERIES):
        xs = sorted(series.get(name) or [])
        stats = [(label, style, summary.get(f"{key}_{name}_ms")) for key, label, style in STATS]
        ax.set_title(f"{title} (n = {len(xs)})\n" + " · ".join(f"{label} {v:.1f}" for label, _, v in stats
                                                                if v is not None) + " ms", fontsize="medium")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("gaps" if name == "itl" else "requests")
        if not xs:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(xs, bins=max(5, min(60, 2 * int(len(xs) ** 0.5))), color="C0", alpha=0.55, label="histogram")
        cdf = ax.twinx()
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color="C1", drawstyle="steps-post", label="CDF")
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("CDF", color="C1")
        for label, style, v in stats:
            if v is not None:
                ax.axvline(v, color="k", linestyle=style, linewidth=1, label=label)
        if not handles:
            handles = ax.get_legend_handles_labels()[0] + cdf.get_legend_handles_labels()[0]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small")
    cfg = summary.get("config", {})
    fig.suptitle(f"kvserve bench serve {summary.get('label') or ''}: {summary.get('completed', 0)} requests, "
                 f"concurrency {cfg.get('max_concurrency') or '∞'}, rate {cfg.get('request_rate', '?')} req/s, "
                 f"{summary.get('output_throughput', 0.0):.1f} output tok/s")
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    return out
