"""Weight quality report (issue #22, the quality rows): what each weight type costs against the
float32 model, teacher-forced on natural text, next to the KV-dtype figures of the README.

Reference: the model (default SmolLM2-135M-Instruct, its Q4_1 GGUF) with float32 weights (the
GGUF dequantized, ``quantization="none"``), ``dtype=float32``. Each row re-quantizes those
float32 weights and runs the same text through the engine's model:

* GGUF types (``Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K``): every quantized tensor of the file's
  linear layers (and with ``--embedding type`` the embedding/LM head too; by default they stay
  float32, as int4 keeps them) is dequantized to float32 and quantized again to the type:
  ``gguf.quants.quantize`` where gguf-py has a quantizer (Q4_0, Q4_1, Q5_0, Q8_0),
  else :func:`quantize_k` (this file: plain min/max K-quants, not llama.cpp's iterative
  search, so its K rows are a pessimistic estimate of llama.cpp's); then loaded as a GGUF weight
  (``quantization="gguf"``: kept quantized, weight-only kernel). K-quants need rows of a
  multiple of 256 values: a tensor whose ``K`` is not (SmolLM2's hidden size is 576: every
  layer but ``down_proj``, and the embedding) gets llama.cpp's fallback type instead
  (:data:`K_FALLBACK`: Q4_K -> Q5_0, Q6_K -> Q8_0, as ``llama-quant.cpp`` does; Q5_K -> Q5_0
  where llama.cpp takes Q5_1, which kvserve does not keep quantized); the report lists the
  tensors of each type;
* ``int4`` (``int4_g16`` ... ``int4_g256``): ``quantization="int4"`` on the float32 weights
  (group-wise asymmetric int4 of the linear layers; embedding and LM head stay float32);
* ``TYPE+int8act``: the type with ``quantization="gguf_int8"`` (int8 activations per 32 values).

Caveat: no float checkpoint of the model is on the machine, so the reference's float32 weights
are the file's own values: SmolLM2's linear layers on a Q4_1 grid (4 bits, a scale and minimum
per 32 values), its embedding on a Q8_0 grid. A type whose grid contains that one gives the
file back: ``int4`` (g32; asymmetric min/max per 32 is Q4_1 with float32 scales) and ``Q4_1``
(its scales re-round to the same fp16 values): these rows show 100% here and say nothing of
the loss on a float model. Every other type lands on a grid of its own and shows the error it
adds to these weights: an estimate of what it adds to float weights (quantizing values already
on a coarse grid onto another is not the same draw as quantizing continuous ones). For
SmolLM2 the K-quant rows hold their own type in ``down_proj`` only (30 of 210 tensors, a
quarter of the linear weights). Q2_K and Q3_K (kept quantized by the engine) have no quantizer
here.

Method: the first ``--tokens`` tokens of :func:`kv_quality.natural_text` (license files found on
the machine: the same text as the KV quality report) in one prefill through the model (all
positions' logits, float32; the same numbers as decode for every type: the quantized layers'
prefill path dequantizes to the kernel's values, ``gguf_int8``'s rounds the activations as its
kernel does), log-softmax at every position. Columns, over the ``T - 1`` predicted positions:
**top-1 agree** (the row's argmax equals the reference's), **mean |Δ logprob|** of the
reference's top-1 tokens and of the text's tokens, **mean KL**(ref || row) in nats, **ppl** of
the text, and the **weight bytes** the model holds (linear layers, embedding, LM head; tied
tensors once).

Usage:
    python benchmarks/weight_quality.py [--tokens 900] [--types Q4_0 Q4_1 ... int4 Q4_1+int8act]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional, Sequence

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
DEFAULT_TYPES = (*GGUF_TYPES, "int4", "Q4_1+int8act", "Q8_0+int8act")
#: gguf-py's own quantizers
_GGUF_PY = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
#: the type a K-quant row gives a tensor whose rows are not a multiple of 256 values
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_0", "Q6_K": "Q8_0"}


# ------------------------------------------------------------------------------------ quantizers
def _f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> its fp16 rounding (as float32)."""
    return x.half().float()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[...]`` float32 -> ``[..., 2]`` uint8 (little-endian fp16)."""
    return x.half().contiguous().view(torch.uint8).view(*x.shape, 2)


def _scales_k4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """ggml's 12-byte packing of 8 6-bit scales and mins (the inverse of ``get_scale_min_k4``):
    ``sc, mn [..., 8]`` int -> ``[..., 12]`` uint8."""
    lo, hi = sc[..., :4], sc[..., 4:]
    mlo, mhi = mn[..., :4], mn[..., 4:]
    out = torch.cat([lo | ((hi >> 4) << 6), mlo | ((mhi >> 4) << 6), (hi & 15) | ((mhi & 15) << 4)], dim=-1)
    return out.to(torch.uint8)


def quantize_k(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Quantize ``w [N, K]`` (float32, ``K % 256 == 0``) to ggml's ``Q4_K``, ``Q5_K`` or ``Q6_K``
    blocks: ``[N, K / 256 * block_bytes]`` uint8, readable by ``gguf.quants.dequantize``.

    Plain min/max quantization (not llama.cpp's ``make_qkx2_quants`` / ``make_qx_quants``
    search): Q4_K/Q5_K per 32 values ``scale = (max - min') / (2^b - 1)`` with ``min' = min(min,
    0)``, the super-block's ``d = max scale / 63`` and ``dmin = max(-min') / 63`` in fp16, 6-bit
    scales and mins rounded to nearest, values ``round((w + dmin·m) / (d·sc))`` clamped; Q6_K per
    16 values the signed extreme ``v`` maps to -32 (``s = -v / 32``), ``d = max|s| / 127`` in
    fp16, int8 scales, values ``round(w / (d·sc))`` clamped to [-32, 31].

    Raises:
        ValueError: another type, or ``K`` not a multiple of 256.
    """
    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):
        raise ValueError(f"quantize_k: qtype must be Q4_K, Q5_K or Q6_K, got {qtype!r}")
    n, k = w.shape
    if k % 256:
        raise ValueError(f"quantize_k: K={k} is not a multiple of 256")
    nb = k // 256
    if qtype == "Q6_K":
        x = w.float().reshape(n, nb, 16, 16)
        idx = x.abs().argmax(-1, keepdim=True)
        s = -x.gather(-1, idx).squeeze(-1) / 32.0  # [n, nb, 16]
        d = _f16(s.abs().amax(-1) / 127.0)  # [n, nb]
        sc = torch.where(d.unsqueeze(-1) > 0, torch.round(s / d.unsqueeze(-1).clamp_min(1e-30)), torch.zeros_like(s))
        sc = sc.clamp(-127, 127)
        D = (d.unsqueeze(-1) * sc).unsqueeze(-1)  # [n, nb, 16, 1]
        q = torch.where(D != 0, torch.round(x / torch.where(D != 0, D, torch.ones_like(D))), torch.zeros_like(x))
        q = (q.clamp(-32, 31) + 32).to(torch.uint8).reshape(n, nb, 2, 4, 32)  # [half, quarter j, l]
        ql = torch.cat([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                        (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], dim=-1)  # [n, nb, 2, 64]
        qh = sum(((q[:, :, :, j] >> 4) & 3) << (2 * j) for j in range(4))  # [n, nb, 2, 32]
        blocks = torch.cat([ql.reshape(n, nb, 128), qh.to(torch.uint8).reshape(n, nb, 64),
                            sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=-1)
        return blocks.reshape(n, -1).contiguous()
    levels = 15 if qtype == "Q4_K" else 31
    x = w.float().reshape(n, nb, 8, 32)
    lo = x.amin(-1).clamp_max(0.0)
    scale = (x.amax(-1) - lo) / levels  # [n, nb, 8]
    d, dmin = _f16(scale.amax(-1) / 63.0), _f16((-lo).amax(-1) / 63.0)  # [n, nb]
    safe = lambda t: t.clamp_min(1e-30).unsqueeze(-1)  # noqa: E731
    sc = torch.round(scale / safe(d)).clamp(0, 63).to(torch.int32)
    mn = torch.round(-lo / safe(dmin)).clamp(0, 63).to(torch.int32)
    D = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1)
    M = (dmin.unsqueeze(-1) * mn.float()).unsqueeze(-1)
    q = torch.where(D > 0, torch.round((x + M) / torch.where(D > 0, D, torch.ones_like(D))), torch.zeros_like(x))
    q = q.clamp(0, levels).to(torch.uint8)  # [n, nb, 8, 32]
    qs = (q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)  # [n, nb, 4, 32]: sub-blocks 2p, 2p + 1
    parts = [_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, mn)]
    if qtype == "Q5_K":
        qh = sum(((q[:, :, j] >> 4) & 1).to(torch.int32) << j for j in range(8)).to(torch.uint8)  # [n, nb, 32]
        parts.append(qh)
    parts.append(qs.reshape(n, nb, 128))
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def requantize(w: torch.Tensor, qtype: str):
    """``w [N, K]`` float32 quantized to the GGUF type ``qtype`` as a
    :class:`~kvserve.worker.layers.quant.GGUFWeight` (gguf-py's quantizer where it has one, else
    :func:`quantize_k`; a K-quant with ``K % 256 != 0`` gets :data:`K_FALLBACK`'s type)."""
    from kvserve.worker.layers.quant import GGUFWeight

    n, k = w.shape
    if qtype in K_FALLBACK and k % 256:
        qtype = K_FALLBACK[qtype]
    if qtype in _GGUF_PY:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        raw = quantize(w.float().numpy(), GGMLQuantizationType[qtype])
        data = torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1))
    else:
        data = quantize_k(w, qtype)
    return GGUFWeight(qtype, data, (n, k))


#: the tensors ``--embedding float`` leaves in float32
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def requantizing_loader(load_weights, qtype: str, keep_float: Sequence[str] = ()):
    """``load_weights`` (the worker's) that returns every kept-quantized GGUF tensor re-quantized
    to ``qtype`` from its float32 values, except those named in ``keep_float`` (dequantized to
    float32); other tensors as loaded."""
    from kvserve.worker.layers.quant import GGUFWeight

    def convert(k, v):
        if not isinstance(v, GGUFWeight):
            return v
        return v.dequantize() if k in keep_float else requantize(v.dequantize(), qtype)

    def load(path, progress=None, keep_quantized=False):
        cfg, state = load_weights(path, progress=progress, keep_quantized=keep_quantized)
        state = {k: convert(k, v) for k, v in state.items()}
        load.types = {}
        for v in state.values():
            if isinstance(v, GGUFWeight):
                load.types[v.qtype] = load.types.get(v.qtype, 0) + 1
        return cfg, state

    load.types = {}  # GGUF type -> tensors, of the last load
    return load


# ------------------------------------------------------------------------------------ measures
def all_logprobs(llm, ids: Sequence[int]) -> torch.Tensor:
    """``[T, V]`` float32 log-softmax of the model's logits at every position of ``ids`` (one
    prefill through the engine's model and KV pool)."""
    from kvserve.worker.attention import AttentionMetadata, PrefillSegment

    eng = llm.engine
    T = len(ids)
    pos = torch.arange(T, device=eng.device)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, T, 0)])
    with torch.inference_mode():
        logits = eng.model(torch.tensor(list(ids), device=eng.device), pos, eng.kv_caches, meta, pos)
    return torch.log_softmax(logits.float().cpu(), dim=-1)


def compare(ref: torch.Tensor, got: torch.Tensor, ids: Sequence[int]) -> dict:
    """Quality of ``got`` against ``ref`` (both ``[T, V]`` log-probabilities of the same ``T``
    tokens ``ids``), over the ``T - 1`` positions that predict a next token.

    Returns: {"top1": share of positions whose argmax agrees, "dlp_top1": mean |Δ logprob| of the
    reference's argmax token, "dlp_text": the same for the text's next token, "kl": mean
    KL(ref || got) in nats, "ppl": the text's perplexity under ``got``}.
    """
    if ref.shape != got.shape or ref.shape[0] != len(ids):
        raise ValueError(f"compare: ref {tuple(ref.shape)} and got {tuple(got.shape)} must be [len(ids)={len(ids)}, V]")
    r, g = ref[:-1], got[:-1]
    nxt = torch.tensor(list(ids[1:])).unsqueeze(-1)
    top = r.argmax(-1, keepdim=True)
    kl = (r.exp() * (r - g)).sum(-1)
    return {"top1": float((g.argmax(-1, keepdim=True) == top).float().mean()),
            "dlp_top1": float((r.gather(-1, top) - g.gather(-1, top)).abs().mean()),
            "dlp_text": float((r.gather(-1, nxt) - g.gather(-1, nxt)).abs().mean()),
            "kl": float(kl.mean()), "ppl": math.exp(-float(g.gather(-1, nxt).mean()))}


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of the decoder layers' linear weights, bytes of those plus the embedding and LM
    head) as the model holds them (packed quantized tensors as held; a tensor shared by two
    modules counted once; norms not counted)."""
    from kvserve.worker.layers.linear import Linear
    from kvserve.worker.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    seen, total, linear = set(), 0, 0
    for m in model.modules():
        if isinstance(m, Linear):
            key = id(m.qpacked) if m.qpacked is not None else (m.weight.data_ptr() if m.weight is not None else id(m))
            nbytes = m.weight_nbytes
        elif isinstance(m, VocabParallelEmbedding):
            key = id(m.qpacked) if m.qpacked is not None else m.weight.data_ptr()
            nbytes = m.qpacked.nbytes if m.qpacked is not None else m.weight.numel() * m.weight.element_size()
        else:
            continue
        if key not in seen:
            seen.add(key)
            total += nbytes
            linear += nbytes if isinstance(m, Linear) and not isinstance(m, ParallelLMHead) else 0
    return linear, total


def row_config(row: str) -> tuple[Optional[str], str]:
    """A row name -> (GGUF type to re-quantize to or None, the engine's ``quantization``).

    Raises:
        ValueError: an unknown row, naming ``--types`` and the allowed values.
    """
    from kvserve.worker.layers.quant import INT4_GROUP_SIZES

    if row in INT4_GROUP_SIZES:
        return None, row
    base, _, act = row.partition("+")
    if base in GGUF_TYPES and act in ("", "int8act"):
        return base, "gguf_int8" if act else "gguf"
    raise ValueError(f"--types: unknown row {row!r}; allowed: {', '.join(GGUF_TYPES)}, their TYPE+int8act, "
                     f"{', '.join(INT4_GROUP_SIZES)}")


def run_row(model: str, row: Optional[str], ids: Sequence[int], dtype: str = "float32", quantize_tables: bool = False,
            **kw) -> tuple:
    """(``[T, V]`` log-probabilities, :func:`weight_bytes`, {GGUF type: tensors} of a re-quantized
    row) of the row (None: the float32 reference, ``quantization="none"``; ``quantize_tables``:
    a GGUF row re-quantizes the embedding/LM head too), the engine built, used and shut down
    inside."""
    import kvserve.worker.worker as worker_mod
    from kvserve import LLM

    qtype, quantization = (None, "none") if row is None else row_config(row)
    orig = worker_mod.load_weights
    if qtype is not None:
        worker_mod.load_weights = loader = requantizing_loader(orig, qtype, () if quantize_tables else TABLES)
    try:
        llm = LLM(model=model, dtype=dtype, quantization=quantization, max_model_len=len(ids) + 1,
                  device="cpu", **kw)
    finally:
        worker_mod.load_weights = orig
    try:
        return all_logprobs(llm, ids), weight_bytes(llm.engine.model), dict(loader.types) if qtype else {}
    finally:
        llm.shutdown()


def report(model: str, rows: Sequence[str], ids: Sequence[int], dtype: str = "float32", verbose: bool = False,
           quantize_tables: bool = False, **kw) -> list[dict]:
    """Every row compared with the reference; the reference first (its own row: 100%, 0). A
    row the engine refuses (e.g. an int4 group size that does not divide a layer) is left out,
    its reason printed; ``verbose``: each row printed as it is measured."""
    ref, ref_bytes, _ = run_row(model, None, ids, dtype, **kw)
    out = [{"row": "float32 (reference)", **compare(ref, ref, ids), "bytes": ref_bytes, "s": 0.0, "types": {}}]
    for row in rows:
        t0 = time.perf_counter()
        try:
            got, nbytes, types = run_row(model, row, ids, dtype, quantize_tables, **kw)
        except ValueError as e:
            print(f"{row}: skipped: {e}", flush=True)
            continue
        out.append({"row": row, **compare(ref, got, ids), "bytes": nbytes, "s": time.perf_counter() - t0,
                    "types": types})
        if verbose:
            print(format_table(out[-1:]).splitlines()[-1], flush=True)
        del got
    return out


def format_table(rows: list[dict]) -> str:
    lines = ["| weights | top-1 agree | mean abs Δ logprob (ref top-1) | mean abs Δ logprob (text) | mean KL | ppl | "
             "linear MB | with embedding, head MB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['row']} | {100 * r['top1']:.1f}% | {r['dlp_top1']:.4f} | {r['dlp_text']:.4f} | "
                     f"{r['kl']:.2e} | {r['ppl']:.3f} | {r['bytes'][0] / 1e6:.1f} | {r['bytes'][1] / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from kv_quality import natural_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=900, help="tokens of text (≥ 2)")
    ap.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES), help="rows: " + " ".join(DEFAULT_TYPES))
    ap.add_argument("--embedding", choices=["float", "type"], default="float",
                    help="GGUF rows: the embedding/LM head float32 (default, as int4) or re-quantized to the "
                         "row's type")
    ap.add_argument("--kv-cache-memory", type=float, default=0.5)
    a = ap.parse_args(argv)
    if a.tokens < 2:
        raise SystemExit(f"--tokens must be ≥ 2, got {a.tokens}")
    for r in a.types:
        row_config(r)
    from kvserve.engine.tokenizer import load_tokenizer
    from kvserve.worker.default_model import default_model_path

    model = a.model or str(default_model_path())
    if not model.endswith(".gguf"):
        raise SystemExit(f"--model must be a .gguf file (the rows re-quantize its tensors), got {model!r}")
    ids = load_tokenizer(model).encode(natural_text(8 * a.tokens))[:a.tokens]
    if len(ids) < a.tokens:
        raise SystemExit(f"only {len(ids)} tokens of text")
    print(f"model {model}, {len(ids)} tokens of text, float32; rows: {' '.join(a.types)}", flush=True)
    print(f"embedding and LM head: {'float32' if a.embedding == 'float' else 'the row type'} in GGUF rows", flush=True)
    rows = report(model, a.types, ids, verbose=True, quantize_tables=a.embedding == "type",
                  kv_cache_memory=a.kv_cache_memory)
    print(format_table(rows))
    print("tensors per GGUF type: " + "; ".join(f"{r['row']}: " + ", ".join(f"{t} {n}" for t, n in r["types"].items())
                                                 for r in rows if len(r["types"]) > 1))
    print("seconds per row (load + prefill): " + ", ".join(f"{r['row']} {r['s']:.1f}" for r in rows[1:]))


if __name__ == "__main__":
    main()
