"""``kvserve bench serve --plot``: the latency distributions of a real run against a tiny model's
server drawn into a PNG (checked by its signature, size and dimensions), the samples kept in
the result JSON, a progress bar when asked, and --plot's errors before anything is sent."""

from __future__ import annotations

import asyncio
import builtins
import json
import struct

import pytest
from server_helpers import ServerThread

from kvserve.engine.llm_engine import EngineArgs, LLMEngine

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def server(tiny_folder):
    engine = LLMEngine(EngineArgs(model=str(tiny_folder), dtype="float32", num_blocks=256, block_size=4,
                                  max_model_len=256))
    with ServerThread(engine, names=["tiny"]) as s:
        yield s


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_the_run(server, tiny_folder, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    png, js = tmp_path / "plots" / "latency.png", tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_folder), "--num-prompts", "8",
               "--random-input-len", "12", "--random-output-len", "6", "--max-concurrency", "4", "--label", "tiny",
               "--save-json", str(js), "--plot", str(png)])
    out, err = capsys.readouterr()
    assert rc == 0 and "Output token throughput" in out and f"saved {png}" in err
    assert "req/s]" not in err and "it/s]" not in err  # (no progress bar when stderr is not a terminal)
    data = png.read_bytes()
    assert _png_size(data) == (1200, 800) and len(data) > 20_000  # 12 x 8 inches at 100 dpi, four drawn panels
    s = json.loads(js.read_text())
    series = s["series_ms"]
    assert [len(series[k]) for k in ("ttft", "tpot", "e2el")] == [8, 8, 8]
    assert 8 <= len(series["itl"]) <= 8 * 5  # (a gap per text chunk after the first: ≤ 5 for 6 tokens)
    assert sorted(series["ttft"])[len(series["ttft"]) // 2 - 1] <= s["median_ttft_ms"] <= max(series["ttft"])
    assert s["mean_e2el_ms"] == pytest.approx(sum(series["e2el"]) / 8)


def test_plot_latencies_draws_svg_and_empty_series(tmp_path):
    from kvserve.bench.plot import plot_latencies

    summary = {"label": "x", "completed": 3, "config": {"max_concurrency": 2, "request_rate": "inf"},
               "output_throughput": 12.5, "series_ms": {"ttft": [10.0, 12.0, 30.0], "tpot": [2.0, 2.5, 3.0],
                                                        "itl": [], "e2el": [50.0, 60.0, 90.0]},
               **{f"{s}_{n}_ms": 1.0 for s in ("mean", "median", "p99") for n in ("ttft", "tpot", "itl", "e2el")}}
    svg = plot_latencies(summary, tmp_path / "l.svg")
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text
    assert "no samples" in text and "Inter-token latency (n = 0)" in text and "Time to first token (n = 3)" in text
    with pytest.raises(KeyError):
        plot_latencies({"completed": 0}, tmp_path / "none.png")


def test_plot_option_is_checked_before_sending(tmp_path, capsys):
    from kvserve.entrypoints.cli import main
    from server_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # (nothing listens: a checked option fails before the warm-up)
    for value, words in [(tmp_path / "out.jpg", "--plot must end in .png, .svg, .pdf (the image format), got "),
                         (tmp_path, "--plot must end in"),
                         (tmp_path / "d.png", "--plot must be a file path, got the folder"),
                         ("/proc/no/such/out.png", "--plot: cannot create '/proc/no/such'")]:
        if str(value).endswith("d.png"):
            (tmp_path / "d.png").mkdir()
        assert main(["bench", "serve", "--base-url", url, "--model", "x", "--plot", str(value)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {words}") and err.count("\n") == 1, err


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    from kvserve.bench import plot
    from kvserve.entrypoints.cli import main

    real_import, real_find = builtins.__import__, importlib.util.find_spec

    def no_matplotlib(name, *args, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real_find(n, *a))
    with pytest.raises(ImportError, match=r"matplotlib: pip install 'kvserve\[plot\]' \(matplotlib==3\.11\.2\)"):
        plot.plot_latencies({"series_ms": {}}, tmp_path / "x.png")
    assert main(["bench", "serve", "--model", "x", "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == ("error: --plot needs matplotlib, which is not installed: pip install "
                                       "'kvserve[plot]' (matplotlib==3.11.2)\n")


def test_the_progress_bar_counts_the_answered_requests(server, capsys):
    from kvserve.bench.serve import BenchConfig, run_benchmark

    cfg = BenchConfig(base_url=server.base_url, model="tiny", num_prompts=5, input_len=4, output_len=3, warmup=0,
                      label="bar")
    s = asyncio.run(run_benchmark(cfg, [[5, 6, 7, 8]] * 5, progress=True))
    err = capsys.readouterr().err
    assert s["completed"] == 5 and "bar: 100%" in err and "5/5" in err
    s = asyncio.run(run_benchmark(cfg, [[5, 6, 7, 8]] * 5))  # (the default: none)
    assert s["completed"] == 5 and capsys.readouterr().err == ""
