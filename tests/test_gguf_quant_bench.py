"""benchmarks/gguf_quant.py's per-type kernel timing (``--kernels``) on a small shape: one row
per packed type plus the bf16 gemv, each with its packed bytes; under a second."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvserve.worker.layers import quant as Q

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.skipif(not Q.weight_only_available(), reason="needs the qgemv kernel and AVX512_BF16")
def test_kernel_rows_cover_every_type(monkeypatch):
    monkeypatch.syspath_prepend(str(_DIR))
    spec = importlib.util.spec_from_file_location("gguf_quant_bench", _DIR / "gguf_quant.py")
    gq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gq)
    rows = gq.kernels(n=16, k=512, reps=2)
    want = [*Q.KEPT_TYPES, "int4_g32", "int4_g16", "bf16 (gemv)"]
    assert [r["type"] for r in rows] == want
    per_value = {r["type"]: r["bytes"] / (16 * 512) for r in rows}
    assert per_value["Q4_1"] == 0.75 and per_value["Q6_K"] == 1.5 and per_value["Q2_K"] == 1.0
    assert per_value["int4_g16"] == 1.0 and per_value["bf16 (gemv)"] == 2.0
    assert all(r["best_ms"] > 0 and r["median_ms"] >= r["best_ms"] for r in rows)
