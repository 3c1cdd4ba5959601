"""GGUF-quantized weights kept quantized: unpacking, the kernel-friendly packed layout, and the
linear kernel over it (``csrc/cpu/qgemv.c``) with its PyTorch reference.

A GGUF linear weight ``[N, K]`` is stored in blocks of 32 (or 256) values along ``K``. Every
type handled here is, per sub-block of ``S`` values ``b`` of row ``n`` (``S = 32``; 16 for
``Q6_K``), an affine map of unsigned integers::

    w[n, S b + t] = d[n, b] * u[n, S b + t] + m[n, b]        (d, m float32)

=========  ===========================================  ================================  =====
type       ggml block                                   u, d, m                           bits
=========  ===========================================  ================================  =====
``Q2_K``   256 values: 16 bytes of 4-bit scale/min      per 16: d = d·sc, m = -dmin·mn    4
           pairs, 64 bytes of 2-bit values, fp16 d, dmin
``Q3_K``   256 values: 32 bytes of high bits, 64 of     per 16: d = d·(sc - 32),          4
           2-bit values, 12 bytes of 6-bit scales, d    m = -4 d, u = q (0..7)
``Q4_0``   fp16 d, 16 bytes of nibbles (q - 8)          u = q, m = -8 d                   4
``Q4_1``   fp16 d, fp16 m, 16 bytes of nibbles          as stored                         4
``Q5_0``   fp16 d, 4 bytes of 5th bits, 16 of nibbles   u = q (0..31), m = -16 d          8
``Q8_0``   fp16 d, 32 int8                              u = q + 128, m = -128 d           8
``Q4_K``   256 values: fp16 d, dmin, 12 bytes of 6-bit  per 32: d = d·sc, m = -dmin·mn    4
           scales/mins, 128 bytes of nibbles
``Q5_K``   as Q4_K plus 32 bytes of 5th bits            per 32: d = d·sc, m = -dmin·mn    8
``Q6_K``   256 values: 128 bytes of low nibbles, 64 of  per 16: d = d·sc, m = -32 d,      8
           high 2-bit pairs, 16 int8 scales, fp16 d     u = q (0..63)
=========  ===========================================  ================================  =====

(ggml's formats: ``ggml-common.h`` / ``ggml-quants.c`` of llama.cpp, and gguf-py's
``gguf/quants.py``; :func:`unpack` reproduces ``gguf.quants.dequantize`` bit for bit, tested.)
The other types (Q5_1, the IQ types ...) are not kept quantized: their layers are
dequantized at load as before (:data:`KEPT_TYPES`). Group-wise int4 of float checkpoints
(``quantization="int4"``, :func:`quantize_int4`: gpt-fast's and torchao's asymmetric int4,
``w = scale · u + min`` per group) uses the same layout and kernels.

The packed layout (:class:`PackedWeight`) keeps the quantized values and float32 ``d``/``m``
in separate arrays, rows interleaved in groups of 4 so that one 64-byte load covers one block
of 4 rows (llama.cpp's repacked ``block_q4_0x4`` idea): see ``csrc/cpu/qgemv.c``. Resident
size per weight value: 4-bit types 0.75 bytes (0.5 for the nibbles + 8 bytes of ``d``, ``m``
per 32), 8-bit types 1.25 bytes, Q6_K (``d``, ``m`` per 16: the ``sub16`` layout) 1.5 bytes;
Q4_1 in the file is 0.625, Q6_K 0.82.

Two kernels run on it (:func:`qlinear`, ``csrc/cpu/qgemv.c``, OpenMP over groups of rows):

* weight-only (``quantization="gguf"``, the default): each block is dequantized in registers to
  the float32 values the loader's dequantization gives (bf16-rounded for bf16 activations, as
  the dequantized bf16 model holds them) and multiplied in float32 (FMA; ``VDPBF16PS``): the
  dequantized model's numbers up to the order of the float32 additions.
* int8 activations (``"gguf_int8"``): the activations are quantized per block of 32 to int8
  (``s = max|x| / 127``, round to nearest even: llama.cpp's ``q8_0`` activations) and
  ``s · (d · Σ u·q + m · Σ q)`` is summed over the blocks with AVX512-VNNI ``VPDPBUSD`` (exact
  int32 block sums, float32 accumulation). Error bound against the float32 product with the
  dequantized weight (:func:`activation_error_bound`): per output ``|y - y_ref| <= Σ_b
  (max_t |x_bt| / 254) · Σ_t |w_bt|`` plus float32 rounding (a few ulp of ``Σ |w·x|``). It
  does ~3x less work per weight than the weight-only kernel, but its rounding makes a token's
  result jump when an upstream value moves by one float32 ulp across a rounding boundary, so
  two runs that compute the same token through different kernels (a prefill chunk against a
  decode step, after a preemption, a prefix-cache hit or a speculative verification) may
  sample differently.

For many tokens (prefill), the layer instead dequantizes the weight in chunks of rows into a
small scratch buffer and runs ``F.linear`` on each, with the same numbers as its kernel
(:func:`kvserve.worker.layers.linear.chunked_linear`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_flags, load_library

#: GGUF types kept quantized, with their block size (values) and bytes per block.
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q2_K": (256, 84),
         "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
KEPT_TYPES = tuple(BLOCK)
#: bits of the packed values per type (4: two per byte; 8: one per byte)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q8_0": 8, "Q2_K": 4, "Q3_K": 4, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
#: values per scale/offset pair (``d``, ``m``) per type: 32, or 16 (the ``sub16`` layout)
SUB = {t: 16 if t in ("Q2_K", "Q3_K", "Q6_K") else 32 for t in BLOCK}
#: Group of weight rows interleaved in the packed layout.
ROWS = 4


class GGUFWeight:
    """A GGUF tensor ``[N, K]`` (torch order: ``N`` rows of ``K`` values) as its raw blocks.

    Args:
        qtype: the GGUF type name, one of :data:`KEPT_TYPES`.
        data: ``[N, K / block * block_bytes]`` uint8, each row its blocks in file order.
        shape: ``(N, K)``.

    Raises:
        ValueError: an unknown type, ``K`` not a multiple of the block size, or data of the wrong size.
    """

    def __init__(self, qtype: str, data: torch.Tensor, shape: tuple[int, int]) -> None:
        if qtype not in BLOCK:
            raise ValueError(f"GGUFWeight: qtype must be one of {KEPT_TYPES}, got {qtype!r}")
        n, k = (int(s) for s in shape)
        bs, bb = BLOCK[qtype]
        if k % bs:
            raise ValueError(f"GGUFWeight: K={k} is not a multiple of {qtype}'s block of {bs} values")
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, k // bs * bb):
            raise ValueError(f"GGUFWeight: data must be uint8 [{n}, {k // bs * bb}] for {qtype} {shape}, got "
                             f"{data.dtype} {tuple(data.shape)}")
        self.qtype, self.data, self.shape = qtype, data, (n, k)

    @property
    def block_size(self) -> int:
        return BLOCK[self.qtype][0]

    def __repr__(self) -> str:
        return f"GGUFWeight({self.qtype}, shape={self.shape})"

    def rows(self, index: torch.Tensor) -> "GGUFWeight":
        """The rows ``index`` (an int64 permutation or selection), as a new weight."""
        return GGUFWeight(self.qtype, self.data[index].contiguous(), (int(index.numel()), self.shape[1]))

    def narrow_rows(self, start: int, length: int) -> "GGUFWeight":
        return GGUFWeight(self.qtype, self.data.narrow(0, start, length), (length, self.shape[1]))

    def narrow_cols(self, start: int, length: int) -> "GGUFWeight":
        """Columns ``[start, start + length)``; both must be multiples of the block size.

        Raises:
            ValueError: a cut inside a quantization block.
        """
        bs, bb = BLOCK[self.qtype]
        if start % bs or length % bs:
            raise ValueError(f"GGUFWeight: columns [{start}, {start + length}) cut {self.qtype}'s blocks of {bs}")
        return GGUFWeight(self.qtype, self.data.narrow(1, start // bs * bb, length // bs * bb), (self.shape[0], length))

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``, equal to ``gguf.quants.dequantize`` of the same bytes."""
        u, d, m = unpack(self)
        n, k = self.shape
        sub = SUB[self.qtype]
        if self.qtype == "Q6_K":  # ggml rounds d · (q - 32) once (d · q is not always exact here)
            return (d.unsqueeze(-1) * (u.view(n, k // sub, sub).float() - 32.0)).view(n, k)
        return torch.addcmul(m.unsqueeze(-1), u.view(n, k // sub, sub).float(), d.unsqueeze(-1)).view(n, k)


# ----------------------------------------------------------------------------- unpacking

def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block ``b [..., bytes]`` as float32 ``[...]``."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``get_scale_min_k4`` for all 8 sub-blocks: ``sc [..., 12]`` uint8 -> (scales, mins)
    ``[..., 8]`` int (6 bits each)."""
    s = sc.to(torch.int32)
    lo = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return lo, mn


def unpack(w: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u [N, K] uint8, d [N, K/S] float32, m [N, K/S] float32)`` with ``S = SUB[qtype]`` (32;
    16 for Q6_K) and ``w[n, S b + t] = d[n, b] * u[n, S b + t] + m[n, b]`` (see the module
    docstring); the float32 values ``d`` and ``m`` are ggml's own (``d * sc`` and ``dmin * mn``
    rounded as ggml does)."""
    n, k = w.shape
    bs, bb = BLOCK[w.qtype]
    b = w.data.reshape(n, k // bs, bb)
    t = w.qtype
    if t in ("Q2_K", "Q3_K"):
        # per 128-value half: 32 bytes of 2-bit values, value 32 j + l at bits 2j..2j+1 of byte l
        at = 16 if t == "Q2_K" else 32
        qs = b[..., at:at + 64].reshape(n, k // bs, 2, 1, 32)
        u = (qs >> torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)) & 3  # [n, blocks, 2, 4, 32]
        if t == "Q2_K":  # scales[16] (low nibble: scale, high: min), qs[64], fp16 d, dmin
            sc = b[..., :16].to(torch.int32)
            dd = (_f16(b, 80).unsqueeze(-1) * (sc & 15).float()).reshape(n, k // 16)
            mm = -(_f16(b, 82).unsqueeze(-1) * (sc >> 4).float()).reshape(n, k // 16)
            return u.reshape(n, k), dd, mm
        # Q3_K: hmask[32] (bit 4 h + j of byte l: the high bit of value 128 h + 32 j + l), qs[64],
        # 12 bytes of 6-bit scales (low nibbles of bytes 0..7, then their high nibbles; the top 2
        # bits from bytes 8..11, shifted by 2 (i // 4)), fp16 d; w = d (sc - 32) (q - 4)
        hm = b[..., :32].reshape(n, k // bs, 1, 32)
        hi = ((hm >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1).reshape(n, k // bs, 2, 4, 32)
        u = u | (hi << 2)
        s = b[..., 96:108].to(torch.int32)
        low = torch.cat([s[..., :8] & 15, s[..., :8] >> 4], dim=-1)  # [n, blocks, 16]
        top = ((s[..., 8:12].unsqueeze(-2) >> torch.arange(0, 8, 2).view(4, 1)) & 3).reshape(n, k // bs, 16)
        dd = (_f16(b, 108).unsqueeze(-1) * ((low | (top << 4)) - 32).float()).reshape(n, k // 16)
        return u.reshape(n, k), dd, -4.0 * dd
    if t == "Q6_K":
        # ggml's block_q6_K: ql[128] (per 128-value half: 64 bytes, low nibbles = values 0..63,
        # high nibbles = 64..127), qh[64] (per half: 32 bytes, bits 2j..2j+1 of byte l = the
        # high 2 bits of value 32 j + l), int8 scales[16] (one per 16 values), fp16 d
        ql = b[..., :128].reshape(n, k // bs, 2, 64)
        qh = b[..., 128:192].reshape(n, k // bs, 2, 1, 32)
        lo = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # [n, blocks, 2, 128]
        hi = ((qh >> torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)) & 3).reshape(n, k // bs, 2, 128)
        u = (lo | (hi << 4)).reshape(n, k)
        dd = (_f16(b, 208).unsqueeze(-1) * b[..., 192:208].contiguous().view(torch.int8).float()).reshape(n, k // 16)
        return u, dd, -32.0 * dd
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        d = _f16(b, 0)
        if t == "Q8_0":
            u = (b[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return u.reshape(n, k), d, -128.0 * d
        qs = b[..., -16:]
        u = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        if t == "Q4_0":
            return u.reshape(n, k), d, -8.0 * d
        if t == "Q4_1":
            return u.reshape(n, k), d, _f16(b, 2)
        qh = b[..., 2:6].to(torch.int64)
        bits = (qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)).unsqueeze(-1)
        hi = ((bits >> torch.arange(32)) & 1).to(torch.uint8) << 4
        return (u | hi).reshape(n, k), d, -16.0 * d
    # K-quants: 256-value super-blocks of 8 sub-blocks of 32
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[..., 4:16])
    dd = (d.unsqueeze(-1) * sc.float()).reshape(n, k // 32)
    mm = -(dmin.unsqueeze(-1) * mn.float()).reshape(n, k // 32)
    qs = b[..., -128:].reshape(n, k // bs, 4, 32)  # 4 pairs of sub-blocks: low nibbles, then high
    u = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [n, blocks, 4, 2, 32]
    if t == "Q5_K":
        qh = b[..., 16:48].reshape(n, k // bs, 1, 1, 32)
        shift = torch.arange(8, dtype=torch.uint8).view(4, 2, 1)  # bit 2j (low part), 2j + 1 (high)
        u = u | (((qh >> shift) & 1) << 4)
    return u.reshape(n, k), dd, mm


# ----------------------------------------------------------------------------- packing

class PackedWeight(NamedTuple):
    """A weight ``[N, K]`` in the kernel's layout (``csrc/cpu/qgemv.c``).

    Attributes:
        qs: uint8, ``[ceil(N/4), K/32, 64]`` (bits 4) or ``[ceil(N/4), K/32, 128]`` (bits 8).
        d, m: float32 ``[ceil(N/4), K/32, 4]`` (``sub == 32``) or ``[ceil(N/4), K/32, 2, 4]``
            (``sub == 16``: one per half block).
        bits: 4 or 8.
        shape: ``(N, K)``.
        qtype: the type(s) it came from (``"Q4_1"``, ``"Q5_0+Q8_0"``, ``"int4_g32"``).
        sub: values per ``d``/``m`` pair, 32 or 16.
    """

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    shape: tuple[int, int]
    qtype: str
    sub: int = 32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


def pack(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, qtype: str = "") -> PackedWeight:
    """Pack unpacked values (:func:`unpack`) into the kernel's layout.

    Args:
        u: ``[N, K]`` uint8 (``< 16`` when ``bits == 4``); ``K % 32 == 0``.
        d, m: ``[N, K/32]`` float32, or ``[N, K/16]`` (a pair per 16 values: the ``sub16`` layout).
        bits: 4 or 8.

    Raises:
        ValueError: bad shapes, ``bits``, or 4-bit values over 15.
    """
    if bits not in (4, 8):
        raise ValueError(f"pack: bits must be 4 or 8, got {bits}")
    n, k = u.shape
    sub = 16 if k and d.dim() == 2 and d.shape[1] == k // 16 and k % 32 == 0 else 32
    if k % 32 or tuple(d.shape) != (n, k // sub) or tuple(m.shape) != (n, k // sub):
        raise ValueError(f"pack: u must be [N, K] with K % 32 == 0 and d, m [N, K/32] or [N, K/16]; got "
                         f"{tuple(u.shape)}, {tuple(d.shape)}, {tuple(m.shape)}")
    if bits == 4 and n and int(u.max()) > 15:
        raise ValueError("pack: 4-bit values must be < 16")
    g, kb = -(-n // ROWS), k // 32
    pad = g * ROWS - n
    if pad:
        u = torch.cat([u, u.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
        m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
    ub = u.view(g, ROWS, kb, 2, 16)  # halves: values 0..15 and 16..31 of each block
    if bits == 4:
        qs = (ub[:, :, :, 0] | (ub[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # [g, kb, rows, 16]
    else:
        qs = ub.permute(0, 2, 3, 1, 4)  # [g, kb, half, rows, 16]
    qs = qs.reshape(g, kb, ROWS * 16 * (bits // 4)).contiguous()
    if sub == 16:  # [g, kb, half, rows]
        d4 = d.float().view(g, ROWS, kb, 2).permute(0, 2, 3, 1).contiguous()
        m4 = m.float().view(g, ROWS, kb, 2).permute(0, 2, 3, 1).contiguous()
    else:
        d4 = d.float().view(g, ROWS, kb).permute(0, 2, 1).contiguous()
        m4 = m.float().view(g, ROWS, kb).permute(0, 2, 1).contiguous()
    return PackedWeight(qs, d4, m4, bits, (n, k), qtype, sub)


def pack_gguf(weights: Sequence[GGUFWeight]) -> PackedWeight:
    """Pack the row-wise concatenation of ``weights`` (one, or the parts of a fused q/k/v or
    gate/up layer; types may differ: any 8-bit part makes the whole 8-bit, any Q6_K part the
    whole ``sub16``, the other parts' ``d``, ``m`` then repeated per half block).

    Raises:
        ValueError: parts with different ``K``.
    """
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"pack_gguf: parts have different K: {[w.shape for w in weights]}")
    parts = [unpack(w) for w in weights]
    if len({SUB[w.qtype] for w in weights}) > 1:
        parts = [p if SUB[w.qtype] == 16 else (p[0], p[1].repeat_interleave(2, 1), p[2].repeat_interleave(2, 1))
                 for w, p in zip(weights, parts)]
    bits = max(BITS[w.qtype] for w in weights)
    u, d, m = (torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))
    qtype = "+".join(dict.fromkeys(w.qtype for w in weights))
    return pack(u, d, m, bits, qtype)


def _fma(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``d · u + m`` rounded once to float32, as the C code's FMA (the product of a float32 and
    an 8-bit integer is exact in float64)."""
    return torch.addcmul(m.double(), u.double(), d.double()).float()


def dequantize_packed(p: PackedWeight, start: int = 0, length: Optional[int] = None) -> torch.Tensor:
    """Rows ``[start, start + length)`` of a packed weight as float32 (PyTorch; the reference of
    the C dequantization: ``d · u + m`` with one rounding)."""
    n, k = p.shape
    length = n - start if length is None else length
    g, kb = p.qs.shape[0], k // 32
    if p.bits == 4:
        q = p.qs.view(g, kb, ROWS, 16)
        u = torch.stack([q & 0x0F, q >> 4], dim=3)  # [g, kb, rows, 2, 16]
    else:
        u = p.qs.view(g, kb, 2, ROWS, 16).permute(0, 1, 3, 2, 4)
    u = u.permute(0, 2, 1, 3, 4).reshape(g * ROWS, kb, 2, 16)
    if p.sub == 16:
        d = p.d.permute(0, 3, 1, 2).reshape(g * ROWS, kb, 2, 1)
        mm = p.m.permute(0, 3, 1, 2).reshape(g * ROWS, kb, 2, 1)
    else:
        d = p.d.permute(0, 2, 1).reshape(g * ROWS, kb, 1, 1)
        mm = p.m.permute(0, 2, 1).reshape(g * ROWS, kb, 1, 1)
    rows = slice(start, start + length)
    return _fma(u[rows], d[rows], mm[rows]).reshape(length, k)


def gather_rows(p: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape ``[...]``, each in ``[0, N)``) of a packed weight, dequantized:
    ``[..., K]`` float32 (an embedding lookup on a quantized table; vectorized, no copy of the table)."""
    n, k = p.shape
    flat = ids.reshape(-1)
    g, r = flat // ROWS, flat % ROWS
    kb = k // 32
    halves = 1 if p.bits == 4 else 2
    sel = p.qs.view(-1, kb, halves, ROWS, 16)[g, :, :, r]  # [T, kb, halves, 16]
    if p.bits == 4:
        sel = torch.stack([sel[:, :, 0] & 0x0F, sel[:, :, 0] >> 4], dim=2)
    if p.sub == 16:
        d, m = p.d[g, :, :, r].unsqueeze(-1), p.m[g, :, :, r].unsqueeze(-1)  # [T, kb, 2, 1]
    else:
        d, m = p.d[g, :, r].view(-1, kb, 1, 1), p.m[g, :, r].view(-1, kb, 1, 1)
    return _fma(sel.reshape(-1, kb, 2, 16), d, m).reshape(*ids.shape, k)


# ----------------------------------------------------------------------------- int4 of float weights

#: ``quantization`` value -> int4 group size (values of ``K`` sharing one scale and minimum)
INT4_GROUP_SIZES = {"int4": 32, "int4_g16": 16, "int4_g64": 64, "int4_g128": 128, "int4_g256": 256}


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> PackedWeight:
    """Group-wise asymmetric int4 weight-only quantization (gpt-fast's ``int4`` /
    torchao's ``int4_weight_only``: a scale and a minimum per group of ``group_size`` input
    values), packed for the kernels of this module.

    Per group: ``d = (max - min) / 15`` (at least 1e-12), ``u = round((w - min) / d)`` clamped to
    [0, 15], and the model then uses ``w' = d · u + min`` (float32, one rounding), so
    ``|w - w'| <= d / 2`` per value up to float32 rounding. Unlike gpt-fast, ``d`` and ``min``
    stay float32 (gpt-fast rounds them to bf16). Groups of 16 use the ``sub16`` layout; groups
    of 64-256 repeat their pair per 32 values (the same numbers as the group, the memory of g32).

    Args:
        weight: ``[N, K]`` float (any float dtype; quantized from its float32 values).
        group_size: 16, 32, 64, 128 or 256, dividing ``K``.

    Returns:
        the packed weight (``qtype`` ``"int4_g{group_size}"``, 4 bits).

    Raises:
        ValueError: a group size outside that set, ``K`` not a multiple of it, or a weight that is not 2-D.
    """
    if group_size not in (16, 32, 64, 128, 256):
        raise ValueError(f"quantize_int4: group_size must be one of 16, 32, 64, 128, 256, got {group_size}")
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4: weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % group_size or k % 32:
        raise ValueError(f"quantize_int4: in_features K={k} must be a multiple of the group size {group_size} "
                         "(and of 32)")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((hi - lo) / 15.0).clamp_min(1e-12)
    u = torch.round((w - lo) / d).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    d, lo = d.reshape(n, -1), lo.reshape(n, -1)
    if group_size > 32:
        d, lo = d.repeat_interleave(group_size // 32, 1), lo.repeat_interleave(group_size // 32, 1)
    return pack(u, d, lo, 4, f"int4_g{group_size}")


# ----------------------------------------------------------------------------- the kernels

class _QWeightDesc(ctypes.Structure):
    """``kv_qweight_t`` of ``csrc/cpu/qgemv.c``."""

    _fields_ = [("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("bits", ctypes.c_int64), ("bf16", ctypes.c_int64), ("int8_act", ctypes.c_int64),
                ("sub16", ctypes.c_int64), ("dense", ctypes.c_void_p)]


def gemv_descriptor(p: PackedWeight, bias: Optional[torch.Tensor], dtype: torch.dtype, int8: bool) -> torch.Tensor:
    """The packed weight as the ``w`` argument of ``kv_q_gemv`` (the gemv signature the C decode
    step calls): a uint8 tensor holding a ``kv_qweight_t`` (raw pointers: the caller keeps ``p``
    and ``bias`` (float32 ``[N]`` or None) alive); x and y in ``dtype`` (float32 or bfloat16);
    ``int8``: :func:`qlinear`'s int8-activation kernel, else its weight-only one."""
    desc = _QWeightDesc(p.qs.data_ptr(), p.d.data_ptr(), p.m.data_ptr(), None if bias is None else bias.data_ptr(),
                        p.bits, int(dtype == torch.bfloat16), int(int8), int(p.sub == 16))
    return torch.frombuffer(bytearray(bytes(desc)), dtype=torch.uint8)


def dense_descriptor(weight: torch.Tensor, bias: Optional[torch.Tensor], gemv) -> torch.Tensor:
    """A float weight as the ``w`` argument of ``kv_q_gemv``: a ``kv_qweight_t`` whose ``dense``
    field is ``gemv`` (the ctypes function of ``csrc/cpu/gemv.c`` for the weight's dtype), so
    that a decode step over quantized linears can also run a float layer (an int4 model's LM
    head). ``weight`` ``[N, K]`` contiguous and ``bias`` (``[N]``, the weight's dtype, or None)
    must outlive the descriptor."""
    desc = _QWeightDesc(weight.data_ptr(), None, None, None if bias is None else bias.data_ptr(), 0,
                        int(weight.dtype == torch.bfloat16), 0, 0, ctypes.cast(gemv, ctypes.c_void_p).value)
    return torch.frombuffer(bytearray(bytes(desc)), dtype=torch.uint8)


class _QKernels:
    def __init__(self, lib: ctypes.CDLL, flags: frozenset[str]) -> None:
        i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self.gemv = lib.kv_q_gemv
        self.gemv.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, c_int]
        self.gemv.restype = None
        # kv_q_gemv on a range of output rows, on the calling thread (None: a library built before it)
        self.gemv_rows = getattr(lib, "kv_q_gemv_rows", None)
        if self.gemv_rows is not None:
            self.gemv_rows.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i64, i64, i64]
            self.gemv_rows.restype = None
        self.linear = lib.kv_q_linear
        self.linear.argtypes = [vp, i64, c_int, i64, i64, vp, vp, vp, c_int, c_int, i64, vp, vp, i64, c_int, c_int]
        self.linear.restype = c_int
        self.linear_wo = lib.kv_q_linear_wo
        self.linear_wo.argtypes = [vp, i64, c_int, i64, i64, vp, vp, vp, c_int, c_int, i64, vp, vp, i64, c_int]
        self.linear_wo.restype = None
        self.dequant = lib.kv_q_dequant
        self.dequant.argtypes = [vp, vp, vp, c_int, c_int, i64, i64, i64, vp, c_int, c_int]
        self.dequant.restype = c_int
        # kv_q_gather: rows by index (None: a library built before it)
        self.gather = getattr(lib, "kv_q_gather", None)
        if self.gather is not None:
            self.gather.argtypes = [vp, vp, vp, c_int, c_int, i64, vp, i64, vp, c_int, c_int]
            self.gather.restype = c_int
        self.quantize_act = lib.kv_q_quantize_act
        self.quantize_act.argtypes = [vp, i64, c_int, i64, i64, vp, vp, vp]
        self.quantize_act.restype = None
        self.has_bf16 = "avx512_bf16" in flags


@functools.lru_cache(maxsize=None)
def q_kernels() -> Optional[_QKernels]:
    """The quantized-weight kernels (``csrc/cpu/qgemv.c``, built at install); None where they
    cannot run (no AVX512-VNNI, no build, kernels disabled: see :mod:`kvserve.kernels`)."""
    lib = load_library("qgemv")
    return None if lib is None else _QKernels(lib, cpu_flags())


#: Weights smaller than this many values run on one thread.
_PARALLEL_MIN_ELEMENTS = 1 << 15


def weight_only_available() -> bool:
    """Whether :func:`qlinear`'s weight-only kernel runs here (it needs AVX512_BF16 too)."""
    k = q_kernels()
    return k is not None and k.has_bf16


def qlinear(x: torch.Tensor, p: PackedWeight, bias: Optional[torch.Tensor] = None,
            num_threads: Optional[int] = None, int8: bool = True) -> torch.Tensor:
    """``x @ w^T + bias`` on the packed weight (C kernels, ``csrc/cpu/qgemv.c``).

    Args:
        x: ``[M, K]`` float32 or bfloat16 on the CPU, unit stride in the last dimension.
        p: the packed weight ``[N, K]``.
        bias: optional ``[N]`` float32, contiguous.
        int8: True: activations quantized to int8 per block of 32, AVX512-VNNI (error within
            :func:`activation_error_bound` plus float32 rounding). False: weight-only, the
            weight dequantized in registers to the dequantized model's values (float32; bf16 for
            bf16 ``x``) and multiplied in float32 (the dequantized model's numbers up to the
            order of the additions; needs :func:`weight_only_available`).

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        RuntimeError: no such kernel on this machine, or no memory for the quantized activations.
        ValueError: ``x`` of the wrong shape or dtype.
    """
    kern = q_kernels()
    if kern is None or (not int8 and not kern.has_bf16):
        raise RuntimeError("no quantized-weight CPU kernel on this machine (needs AVX512-VNNI, AVX512_BF16 for "
                           "the weight-only one, and the built qgemv library)")
    n, k = p.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qlinear: x must be [M, {k}] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    y = x.new_empty((M, n))
    bf16 = int(x.dtype == torch.bfloat16)
    nt = num_threads or (torch.get_num_threads() if n * k >= _PARALLEL_MIN_ELEMENTS else 1)
    b = None if bias is None else bias.data_ptr()
    sub16 = int(p.sub == 16)
    if not int8:
        kern.linear_wo(x.data_ptr(), x.stride(0), bf16, M, k, p.qs.data_ptr(), p.d.data_ptr(), p.m.data_ptr(), p.bits,
                       sub16, n, b, y.data_ptr(), n, nt)
    elif kern.linear(x.data_ptr(), x.stride(0), bf16, M, k, p.qs.data_ptr(), p.d.data_ptr(), p.m.data_ptr(), p.bits,
                     sub16, n, b, y.data_ptr(), n, bf16, nt):
        raise RuntimeError("qlinear: could not allocate the quantized activations")
    return y


def dequantize_rows(p: PackedWeight, start: int, length: int, dtype: torch.dtype,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``p`` as ``[length, K]`` ``dtype`` (float32 or bfloat16),
    in C where available (into ``out`` when given: a scratch buffer of at least that size),
    else :func:`dequantize_packed`."""
    n, k = p.shape
    if not 0 <= start <= start + length <= n:
        raise ValueError(f"dequantize_rows: rows [{start}, {start + length}) outside [0, {n})")
    kern = q_kernels()
    if kern is None or dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and not kern.has_bf16):
        return dequantize_packed(p, start, length).to(dtype)
    if out is None or out.numel() < length * k or out.dtype != dtype:
        out = torch.empty(length * k, dtype=dtype)
    out = out.view(-1)[:length * k].view(length, k)
    nt = torch.get_num_threads() if length * k >= _PARALLEL_MIN_ELEMENTS else 1
    if kern.dequant(p.qs.data_ptr(), p.d.data_ptr(), p.m.data_ptr(), p.bits, int(p.sub == 16), k, start, start + length,
                    out.data_ptr(),
                    int(dtype == torch.bfloat16), nt):
        raise RuntimeError("dequantize_rows: out of memory")
    return out


def embedding_rows(p: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An embedding lookup on a quantized table: rows ``ids`` (int64, any shape ``[...]``, each in
    ``[0, N)``) of ``p`` dequantized to ``[..., K]`` ``dtype``, in C where available (one pass,
    rows split across threads for long prompts), else :func:`gather_rows` then a cast. The same
    numbers either way: the float32 values of :func:`dequantize_packed`, rounded to nearest even
    for bfloat16.

    Raises:
        ValueError: an id outside ``[0, N)``.
    """
    n, k = p.shape
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise ValueError(f"embedding_rows: ids must be in [0, {n}), got [{int(flat.min())}, {int(flat.max())}]")
    kern = q_kernels()
    if (kern is None or kern.gather is None or dtype not in (torch.float32, torch.bfloat16)
            or (dtype == torch.bfloat16 and not kern.has_bf16)):
        return gather_rows(p, ids).to(dtype)
    flat = flat.to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=dtype)
    nt = torch.get_num_threads() if flat.numel() * k >= _PARALLEL_MIN_ELEMENTS else 1
    if flat.numel() and kern.gather(p.qs.data_ptr(), p.d.data_ptr(), p.m.data_ptr(), p.bits, int(p.sub == 16), k,
                                    flat.data_ptr(), flat.numel(), out.data_ptr(), int(dtype == torch.bfloat16), nt):
        raise RuntimeError("embedding_rows: out of memory")
    return out.view(*ids.shape, k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in PyTorch: ``x [M, K]`` (``K % 32 == 0``) ->
    ``(q [M, K] int8, s [M, K/32] float32)`` with ``s = max|x_block| / 127`` and
    ``q = round-half-even(x · (1 / s))`` clamped to ±127 (as the C code computes it)."""
    M, k = x.shape
    xb = x.float().view(M, k // 32, 32)
    s = xb.abs().amax(-1) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round((xb * inv.unsqueeze(-1)).clamp(-127, 127)).to(torch.int8)
    return q.view(M, k), s


def qlinear_reference(x: torch.Tensor, p: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 reference: ``F.linear(x, dequantized w, bias)`` in float32 (no activation
    quantization; for bf16 ``x`` the weight rounded to bf16 first, as the dequantized bf16
    model holds it); ``[M, N]`` float32."""
    w = dequantize_packed(p)
    if x.dtype == torch.bfloat16:
        w = w.bfloat16().float()
    return F.linear(x.float(), w, None if bias is None else bias.float())


def activation_error_bound(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """``[M, N]`` float32: the bound on ``|qlinear(x, int8=True) - F.linear(x, dequantized w)|``
    from the int8 activations, ``Σ_b (max_t |x[m, b, t]| / 254) · Σ_t |w[n, b, t]|`` (rounding to nearest
    moves each value by at most half a step ``s / 2``)."""
    M, k = x.shape
    n = p.shape[0]
    amax = x.float().view(M, k // 32, 32).abs().amax(-1)  # [M, kb]
    wabs = dequantize_packed(p).abs().view(n, k // 32, 32).sum(-1)  # [N, kb]
    return (amax / 254.0) @ wabs.T


# ----------------------------------------------------------------------------- GGUF data

def gguf_weight_from_numpy(qtype: str, data: np.ndarray, shape: tuple[int, int]) -> GGUFWeight:
    """A :class:`GGUFWeight` from a GGUF tensor's raw bytes (``GGUFTensor.data``: uint8, the
    bytes of a row last); the bytes are copied (the file map is read-only)."""
    n = int(shape[0])
    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(n, -1))
    return GGUFWeight(qtype, raw, shape)
