"""benchmarks/weight_quality.py's pieces (issue #22, the quality rows), a few seconds:

* its K-quant quantizer writes blocks that gguf-py reads back (equal to kvserve's own unpacking)
  with the error of a 4/5/6-bit grid, and the GGUF re-quantizing loader swaps every GGUF tensor;
* :func:`compare` on known inputs; bad rows name ``--types``;
* the report's plumbing end to end on a tiny random Hugging Face Llama (float32) with int4 rows:
  the reference row agrees with itself exactly, the int4 rows do not, and hold fewer bytes.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "weight_quality.py"
_spec = importlib.util.spec_from_file_location("weight_quality_bench", _PATH)
wq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wq)


@pytest.mark.parametrize("qtype, rms_bound", [("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.025)])
def test_k_quantizer_round_trips_through_gguf(qtype, rms_bound):
    """Gaussian rows: gguf-py's dequantization of our blocks equals kvserve's unpacking, and the
    relative RMS error is that of the grid (a uniform b-bit grid over a 32-value group of a
    Gaussian: ~0.08 / 0.04 / 0.02 of the std for 4 / 5 / 6 bits); a packing mistake gives ~1."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 768, generator=g) * 0.02 + 0.003
    gw = wq.requantize(w, qtype)
    ref = torch.from_numpy(np.asarray(dequantize(gw.data.numpy(), GGMLQuantizationType[qtype]),
                                      dtype=np.float32)).reshape(6, 768)
    assert torch.equal(gw.dequantize(), ref)
    rel = float((ref - w).pow(2).mean().sqrt() / w.std())
    assert rel <= rms_bound, rel
    assert rel >= rms_bound / 10  # (it is a quantization)
    with pytest.raises(ValueError, match="K=96 is not a multiple of 256"):
        wq.quantize_k(torch.randn(2, 96), qtype)


def test_k_rows_fall_back_where_rows_are_not_whole_super_blocks():
    assert wq.requantize(torch.randn(2, 576), "Q4_K").qtype == "Q5_0"
    assert wq.requantize(torch.randn(2, 576), "Q6_K").qtype == "Q8_0"
    assert wq.requantize(torch.randn(2, 512), "Q6_K").qtype == "Q6_K"


def test_requantizing_loader_swaps_every_gguf_tensor():
    from kvserve.worker.layers.quant import GGUFWeight

    w = torch.randn(4, 256)
    src = {"a": wq.requantize(w, "Q8_0"), "norm": torch.ones(4)}
    load = wq.requantizing_loader(lambda path, progress=None, keep_quantized=False: ("cfg", src), "Q4_K")
    cfg, state = load("x.gguf", keep_quantized=True)
    assert cfg == "cfg" and state["norm"] is src["norm"]
    assert isinstance(state["a"], GGUFWeight) and state["a"].qtype == "Q4_K"
    assert torch.equal(state["a"].dequantize(), wq.requantize(src["a"].dequantize(), "Q4_K").dequantize())
    assert load.types == {"Q4_K": 1}
    src["model.embed_tokens.weight"] = wq.requantize(torch.randn(8, 256), "Q8_0")
    keep = wq.requantizing_loader(lambda path, progress=None, keep_quantized=False: ("cfg", src), "Q4_K", wq.TABLES)
    _, state = keep("x.gguf", keep_quantized=True)
    emb = state["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32 and torch.equal(emb, src["model.embed_tokens.weight"].dequantize())
    assert keep.types == {"Q4_K": 1}


def test_compare_on_known_inputs():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]]), -1)
    same = wq.compare(ref, ref, [0, 1, 2])
    assert same["top1"] == 1.0 and same["kl"] == 0.0 and same["dlp_top1"] == 0.0 and same["dlp_text"] == 0.0
    got = ref.clone()
    got[0] = torch.log_softmax(torch.tensor([0.0, 2.0, 0.0]), -1)  # position 0: another argmax
    c = wq.compare(ref, got, [0, 1, 2])
    assert c["top1"] == 0.5
    d0 = float(ref[0, 0] - got[0, 0])  # the reference's top-1 token (0) lost this much
    assert c["dlp_top1"] == pytest.approx(abs(d0) / 2)
    assert c["dlp_text"] == pytest.approx(abs(float(ref[0, 1] - got[0, 1])) / 2)  # the text's next token: 1
    kl0 = float((ref[0].exp() * (ref[0] - got[0])).sum())
    assert c["kl"] == pytest.approx(kl0 / 2)
    assert c["ppl"] == pytest.approx(math.exp(-(float(got[0, 1]) + float(got[1, 2])) / 2))
    with pytest.raises(ValueError, match="must be"):
        wq.compare(ref, ref[:2], [0, 1, 2])


def test_rows_and_bad_rows():
    assert wq.row_config("Q6_K") == ("Q6_K", "gguf")
    assert wq.row_config("Q4_1+int8act") == ("Q4_1", "gguf_int8")
    assert wq.row_config("int4_g64") == (None, "int4_g64")
    with pytest.raises(ValueError, match="--types: unknown row 'Q3_K'"):
        wq.row_config("Q3_K")
    with pytest.raises(ValueError, match="--types: unknown row 'Q4_0\\+fp8act'"):
        wq.row_config("Q4_0+fp8act")


@pytest.mark.skipif(not __import__("kvserve.worker.layers.quant", fromlist=["x"]).weight_only_available(),
                    reason="needs the qgemv kernel and AVX512_BF16")
def test_report_plumbing_on_a_tiny_model(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    ids = list(range(3, 60))
    rows = wq.report(str(folder), ["int4", "int4_g128", "int4_g16"], ids, kv_cache_memory=0.05)  # (g128: refused)
    assert [r["row"] for r in rows] == ["float32 (reference)", "int4", "int4_g16"]
    ref, g32, g16 = rows
    assert ref["top1"] == 1.0 and ref["kl"] == 0.0
    for r in (g32, g16):
        assert 0.5 <= r["top1"] < 1.0 and r["kl"] > 0 and r["dlp_top1"] > 0
    # tiny llama: linears 2 x (64·128 + 64·64 + 128·128 + 128·64) values, embedding and head 384 x 64 (float32)
    lin = 2 * (64 * 128 + 64 * 64 + 128 * 128 + 128 * 64)
    table = 2 * 384 * 64 * 4
    assert ref["bytes"] == (lin * 4, lin * 4 + table)
    assert g32["bytes"] == (lin * 0.75, lin * 0.75 + table) and g16["bytes"] == (lin * 1.0, lin * 1.0 + table)
    assert "| int4_g16 |" in wq.format_table(rows)
