"""The fused CPU kernels (kvserve.kernels.cpu_ops) against the PyTorch ops they replace."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops as K

pytestmark = pytest.mark.skipif(not K.available(), reason="CPU kernels need x86-64 AVX-512 and the install's build")

DTYPES = [torch.float32, torch.bfloat16]


def _greedy_via_op(logits):
    tokens, row_max, log_z = torch.ops.kvserve.greedy(logits)
    return None if logits.shape[1] == 0 or bool((tokens < 0).any()) else (tokens, row_max, log_z)


def _decode_via_op(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, max_context_len=None,
                   window=None):
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    torch.ops.kvserve.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                             max_context_len, window)
    return out


def _gemma_add_via_op(x, weight, residual, eps, next_weight=None):
    out = torch.ops.kvserve.gemma_add_rms_norm_(x, weight, residual, eps, next_weight)
    assert next_weight is not None or out.shape == (0, x.shape[1])
    return None if next_weight is None else out


def _decode_lowbit_via_op(q, k_data, v_data, k_res, v_res, rmap, bt, ctx, scale, bits, out=None):
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    torch.ops.kvserve.paged_attention_decode_lowbit(q, k_data, v_data, k_res, v_res, rmap, bt, ctx, scale, bits, out)
    return out


#: The module's functions as their registered torch.library ops (torch.ops.kvserve.*).
VIA_OPS = {
    "rms_norm": lambda x, w, eps, residual=None: torch.ops.kvserve.rms_norm(x, w, eps, residual),
    "silu_and_mul": lambda x: torch.ops.kvserve.silu_and_mul(x),
    "gelu_tanh_and_mul": lambda x: torch.ops.kvserve.gelu_tanh_and_mul(x),
    "log_sum_exp": lambda x, mx: torch.ops.kvserve.log_sum_exp(x, mx),
    "apply_token_bitmask_": lambda x, bm, rows=None: torch.ops.kvserve.apply_token_bitmask_(x, bm, rows),
    "greedy": _greedy_via_op,
    "rope_": lambda *a: torch.ops.kvserve.rope_(*a),
    "gemma_rms_norm": lambda x, w, eps: torch.ops.kvserve.gemma_rms_norm(x, w, eps),
    "gemma_add_rms_norm_": _gemma_add_via_op,
    "gemma_qk_norm_rope_": lambda *a: torch.ops.kvserve.gemma_qk_norm_rope_(*a),
    "reshape_and_cache": lambda *a: torch.ops.kvserve.reshape_and_cache(*a),
    "paged_attention_decode": _decode_via_op,
    "paged_attention_prefill": lambda *a: torch.ops.kvserve.paged_attention_prefill(*a),
    "paged_attention_decode_lowbit": _decode_lowbit_via_op,  # (tested in test_cpu_ops_lowbit.py)
    "prefill_ranges": None,  # (tested in test_prefill_ranges.py)
    "lowbit_quantize": None,  # (these two in test_cpu_ops_lowbit.py)
    "lowbit_dequantize": None,
    "probe_colsum": None,  # (tested in test_probe_colsum.py)
}
assert set(VIA_OPS) == set(K.OPS)


@pytest.fixture(params=["python", "torch.ops"])
def via(request, monkeypatch):
    """Run a test on the module's functions, then again with each of them replaced by a call of
    its registered op (``torch.ops.kvserve.<name>``, the path torch.compile sees)."""
    if request.param == "torch.ops":
        for name, fn in VIA_OPS.items():
            if fn is not None:
                monkeypatch.setattr(K, name, fn)
    return request.param


def ref_rms_norm(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def close(a, b, dtype):
    """float32: float rounding; bfloat16: identical values (the kernels round where PyTorch does)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,dim", [(1, 576), (5, 64), (33, 100), (300, 1024)])
def test_rms_norm(dtype, M, dim, via):
    g = torch.Generator().manual_seed(M * dim)
    x = torch.randn(M, dim, generator=g).to(dtype) * 3
    w = torch.randn(dim, generator=g).to(dtype)
    close(K.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_on_strided_rows(dtype, via):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9, 200, generator=g).to(dtype)
    x = big[:, 10:110]  # row stride 200
    res = torch.randn(9, 100, generator=g).to(dtype)
    w = torch.randn(100, generator=g).to(dtype)
    expect_res = x + res
    y = K.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(res, expect_res)  # updated in place, rounded like PyTorch's add
    close(y, ref_rms_norm(expect_res, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,inter", [(1, 1536), (7, 40), (129, 512)])
def test_silu_and_mul(dtype, M, inter, via):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(M, 2 * inter, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    expect = F.silu(x[:, :inter]) * x[:, inter:]
    got = K.silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expect, rtol=2e-6, atol=1e-6)
    else:
        # silu's exp differs from PyTorch's in the last float bit now and then; after bf16
        # rounding that changes at most one ulp, and rarely.
        diff = (got.float() - expect.float()).abs()
        assert (diff <= expect.float().abs() * 2**-7 + 1e-30).all()
        assert (got != expect).float().mean() < 0.01


@pytest.mark.skipif("avx512_bf16" not in K.cpu_flags(), reason="needs AVX512_BF16 (VCVTNEPS2BF16)")
def test_hardware_and_software_bf16_rounding_agree():
    """On AVX512_BF16 CPUs the loader picks the cpu_ops_avx512bf16 library, which rounds float32
    -> bf16 with VCVTNEPS2BF16; the cpu_ops_avx512 one (other AVX-512 CPUs) rounds in software.
    Both are round-to-nearest-even: the same bf16 results, bit for bit, for RMSNorm (with
    residual) and SiLU-and-mul."""
    from kvserve.kernels import load_library

    lib = load_library("cpu_ops", variant="cpu_ops_avx512")
    assert lib is not None
    sw = K._Lib(lib)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 576, generator=g) * 5).bfloat16()
    res = torch.randn(64, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    res_hw, res_sw, out_sw = res.clone(), res.clone(), torch.empty_like(x)
    out_hw = K.rms_norm(x, w, 1e-5, residual=res_hw)
    sw.rms_norm(x.data_ptr(), 576, res_sw.data_ptr(), 576, w.data_ptr(), out_sw.data_ptr(), 576, 64, 576, 1e-5, 1, 1)
    assert torch.equal(res_hw, res_sw) and torch.equal(out_hw, out_sw)
    gu = (torch.randn(64, 2 * 1536, generator=g) * 4).bfloat16()
    act_sw = torch.empty(64, 1536, dtype=torch.bfloat16)
    sw.silu_and_mul(gu.data_ptr(), 3072, act_sw.data_ptr(), 1536, 64, 1536, 1, 1)
    assert torch.equal(K.silu_and_mul(gu), act_sw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rope_in_place_on_fused_qkv(dtype, head_dim, via):
    g = torch.Generator().manual_seed(head_dim)
    T, H, KVH, P = 11, 4, 2, 300
    qkv = torch.randn(T, (H + 2 * KVH) * head_dim, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.outer(torch.arange(P).float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    pos = torch.randint(0, P, (T,), generator=g)

    def rotate_half(x):
        return torch.cat((-x[..., head_dim // 2:], x[..., : head_dim // 2]), dim=-1)

    qk = qkv[:, : (H + KVH) * head_dim].reshape(T, H + KVH, head_dim)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    expect = qk * c + rotate_half(qk) * s
    v_before = qkv[:, (H + KVH) * head_dim:].clone()
    K.rope_(qkv, H + KVH, head_dim, pos, cos, sin)
    close(qkv[:, : (H + KVH) * head_dim].reshape(T, H + KVH, head_dim), expect, dtype)
    assert torch.equal(qkv[:, (H + KVH) * head_dim:], v_before)  # V untouched


# ------------------------------------------------------------------ Gemma 3's ops

def ref_gemma_rms_norm(x, w, eps):
    """Gemma3RMSNorm (transformers; kvserve.worker.models.gemma3.GemmaRMSNorm): float32, rounded once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype)


def ulps(a, b):
    """Distance between two bfloat16 tensors in units in the last place (0 for equal values,
    +0 and -0 equal)."""
    assert a.dtype == b.dtype == torch.bfloat16

    def key(t):
        v = t.view(torch.int16).int()
        return torch.where(v >= 0, v, -(v & 0x7FFF))

    return (key(a) - key(b)).abs()


def close_gemma(a, b, dtype, max_diff_frac=0.001):
    """float32: float rounding (a float32 reduction in another order); bfloat16: at most one ulp
    apart, and rarely (a float32 sum that rounds the other way)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        d = ulps(a, b)
        assert d.max() <= 1, f"{d.max().item()} ulps apart"
        assert (d > 0).float().mean() <= max_diff_frac, f"{(d > 0).float().mean().item()} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,dim", [(1, 640), (5, 64), (33, 100), (300, 1024), (3, 7)])
def test_gemma_rms_norm(dtype, M, dim, via):
    g = torch.Generator().manual_seed(M * dim + 1)
    x = (torch.randn(M, dim, generator=g) * 3).to(dtype)
    w = (torch.randn(dim, generator=g) * 0.5).to(dtype)
    close_gemma(K.gemma_rms_norm(x, w, 1e-6), ref_gemma_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_on_strided_rows_and_exact_cases(dtype, via):
    g = torch.Generator().manual_seed(2)
    big = (torch.randn(9, 300, generator=g) * 2).to(dtype)
    x = big[:, 17:117]  # row stride 300, 100 columns (a 4-element tail)
    w = torch.randn(100, generator=g).to(dtype)
    y = K.gemma_rms_norm(x, w, 1e-6)
    assert y.is_contiguous() and y.shape == (9, 100)
    close_gemma(y, ref_gemma_rms_norm(x, w, 1e-6), dtype)
    # a zero weight is the identity scale; a constant row normalizes to +-1 exactly
    ones = torch.full((2, 48), -3.0, dtype=dtype)
    assert torch.equal(K.gemma_rms_norm(ones, torch.zeros(48, dtype=dtype), 0.0), torch.full((2, 48), -1.0, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,dim", [(1, 640), (7, 100), (65, 640)])
def test_gemma_add_rms_norm_is_the_sandwich_step(dtype, M, dim, via):
    """``h += post_norm(a)`` (norm rounded, then the add rounded: PyTorch's ``h + norm(a)``),
    then the next norm of the updated ``h``; ``a`` a strided view."""
    g = torch.Generator().manual_seed(M + dim)
    big = (torch.randn(M, dim + 40, generator=g) * 4).to(dtype)
    a = big[:, 40:]
    h = (torch.randn(M, dim, generator=g) * 10).to(dtype)
    w, w_next = [(torch.randn(dim, generator=g) * 0.5).to(dtype) for _ in range(2)]
    expect_h = h + ref_gemma_rms_norm(a, w, 1e-6)
    expect = ref_gemma_rms_norm(expect_h, w_next, 1e-6)
    big_before = big.clone()
    got_h = h.clone()
    out = K.gemma_add_rms_norm_(a, w, got_h, 1e-6, next_weight=w_next)
    assert torch.equal(big, big_before)  # the input is not written
    if dtype == torch.float32:
        torch.testing.assert_close(got_h, expect_h, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    else:
        close_gemma(got_h, expect_h, dtype, max_diff_frac=0.002)
        # compare the next norm on the residual the kernel produced (one rounding, not two)
        close_gemma(out, ref_gemma_rms_norm(got_h, w_next, 1e-6), dtype)
    again = h.clone()
    assert K.gemma_add_rms_norm_(a, w, again, 1e-6) is None  # without next_weight: only the add
    assert torch.equal(again, got_h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,head_dim", [(4, 1, 256), (4, 2, 24), (3, 3, 64)])
def test_gemma_qk_norm_rope_on_fused_qkv(dtype, H, KVH, head_dim, via):
    """Per-head Gemma norm of q (q weight) and k (k weight), rounded, then RoPE, in place on a
    fused QKV output whose rows are padded (row stride > width); v and the padding untouched."""
    from kvserve.worker.models.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(H * 100 + head_dim)
    T, P, pad = 13, 200, 8
    width = (H + 2 * KVH) * head_dim
    buf = (torch.randn(T, width + pad, generator=g) * 3).to(dtype)
    qkv = buf[:, :width]
    qw, kw = [(torch.randn(head_dim, generator=g) * 0.5).to(dtype) for _ in range(2)]
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rot = RotaryEmbedding(inv, P, dtype, "cpu", fused=False)
    pos = torch.randint(0, P, (T,), generator=g)
    q = ref_gemma_rms_norm(qkv[:, : H * head_dim].reshape(T, H, head_dim), qw, 1e-6)
    k = ref_gemma_rms_norm(qkv[:, H * head_dim: (H + KVH) * head_dim].reshape(T, KVH, head_dim), kw, 1e-6)
    rope_inputs = rot.prepare(pos)
    expect_q, expect_k = RotaryEmbedding.rotate(q, rope_inputs), RotaryEmbedding.rotate(k, rope_inputs)
    rest_before = buf[:, (H + KVH) * head_dim:].clone()
    K.gemma_qk_norm_rope_(qkv, H, KVH, head_dim, qw, kw, 1e-6, pos, rot.cos_table, rot.sin_table)
    got_q = qkv[:, : H * head_dim].reshape(T, H, head_dim)
    got_k = qkv[:, H * head_dim: (H + KVH) * head_dim].reshape(T, KVH, head_dim)
    if dtype == torch.float32:
        torch.testing.assert_close(got_q, expect_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, expect_k, rtol=1e-5, atol=1e-5)
    else:
        # a norm value one ulp off (rare) moves the rotated value by at most about one ulp
        for got, exp in ((got_q, expect_q), (got_k, expect_k)):
            d = ulps(got, exp)
            assert (d > 0).float().mean() <= 0.002
            assert ((got.float() - exp.float()).abs() <= exp.float().abs() * 2**-7 + 2**-10).all()
    assert torch.equal(buf[:, (H + KVH) * head_dim:], rest_before)  # v and the padding untouched


def ref_gelu_and_mul(x):
    inter = x.shape[1] // 2
    return F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]


def close_gelu_bf16(got, expect):
    """At most one bf16 ulp apart (and rarely) except on values below 1e-5 in magnitude, which
    differ by less than 1e-5: where gelu is tiny (gate < -4.5) 1 + tanh has cancelled, and
    PyTorch itself gives 0 on its vector path (Sleef's tanh) and ~1e-7 on its scalar tail
    (std::tanh) for the same gate."""
    d = ulps(got, expect)
    tiny = (expect.float().abs() < 1e-5) & ((got.float() - expect.float()).abs() < 1e-5)
    assert (d[~tiny] <= 1).all(), f"{d[~tiny].max().item()} ulps apart"
    assert (d[~tiny] > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,inter", [(1, 2048), (7, 40), (129, 512), (2, 9)])
def test_gelu_tanh_and_mul(dtype, M, inter, via):
    g = torch.Generator().manual_seed(inter + M)
    x = (torch.randn(M, 2 * inter, generator=g) * 4).to(dtype)
    x[0, :9] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -5.0, 5.0, 0.6, -0.6, 1e-3])
    expect = ref_gelu_and_mul(x)
    got = K.gelu_tanh_and_mul(x)
    assert got.shape == (M, inter) and got.dtype == dtype
    if dtype == torch.float32:
        # tanh differs from PyTorch's (Sleef) by an ulp now and then; where gelu is tiny
        # (gate < -3) PyTorch's own 1 + tanh has cancelled, hence the absolute part.
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    else:
        close_gelu_bf16(got, expect)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_alone_and_on_strided_rows(dtype):
    """With up = 1 the kernel gives gelu itself, rounded once (bf16: what F.gelu returns, within
    an ulp); a row-strided view of a wider buffer needs no copy."""
    g = torch.Generator().manual_seed(5)
    gate = torch.linspace(-12, 12, 4096).to(dtype)  # a multiple of 64: all of it on PyTorch's vector path
    x = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0)
    expect = F.gelu(gate, approximate="tanh").unsqueeze(0)
    got = K.gelu_tanh_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    else:
        close_gelu_bf16(got, expect)
    big = (torch.randn(6, 2 * 50 + 30, generator=g) * 3).to(dtype)
    view = big[:, 30:]
    close_gemma(K.gelu_tanh_and_mul(view), K.gelu_tanh_and_mul(view.contiguous()), dtype)
    torch.testing.assert_close(K.gelu_tanh_and_mul(view).float(), ref_gelu_and_mul(view).float(),
                               rtol=2**-7, atol=1e-5)


def test_gemma_kernels_reject_bad_input():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        K.gemma_rms_norm(x, torch.zeros(63), 1e-6)
    with pytest.raises(ValueError, match="bfloat16"):
        K.gemma_rms_norm(x.bfloat16(), torch.zeros(64), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        K.gemma_add_rms_norm_(x, torch.zeros(64), torch.zeros(3, 64), 1e-6)
    with pytest.raises(ValueError, match="even"):
        K.gelu_tanh_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="2-D"):
        K.gelu_tanh_and_mul(torch.randn(2, 2, 8))
    cos = torch.zeros(10, 16)
    with pytest.raises(ValueError, match="heads"):
        K.gemma_qk_norm_rope_(torch.randn(2, 40), 2, 1, 16, torch.zeros(16), torch.zeros(16), 1e-6,
                              torch.zeros(2, dtype=torch.int64), cos, cos)
    with pytest.raises(ValueError, match="positions"):
        K.gemma_qk_norm_rope_(torch.randn(2, 64), 2, 1, 16, torch.zeros(16), torch.zeros(16), 1e-6,
                              torch.zeros(2, dtype=torch.int32), cos, cos)


@pytest.mark.skipif("avx512_bf16" not in K.cpu_flags(), reason="needs AVX512_BF16 (VCVTNEPS2BF16)")
def test_gemma_kernels_hardware_and_software_bf16_rounding_agree():
    from kvserve.kernels import load_library

    lib = load_library("cpu_ops", variant="cpu_ops_avx512")
    assert lib is not None
    sw = K._Lib(lib)
    g = torch.Generator().manual_seed(9)
    M, E = 16, 640
    a = (torch.randn(M, E, generator=g) * 5).bfloat16()
    w, w2 = torch.randn(E, generator=g).bfloat16(), torch.randn(E, generator=g).bfloat16()
    h_hw, h_sw = [(torch.randn(M, E, generator=torch.Generator().manual_seed(1)) * 9).bfloat16() for _ in range(2)]
    out_sw = torch.empty(M, E, dtype=torch.bfloat16)
    out_hw = K.gemma_add_rms_norm_(a, w, h_hw, 1e-6, next_weight=w2)
    sw.gemma_rms_norm(a.data_ptr(), E, w.data_ptr(), h_sw.data_ptr(), E, w2.data_ptr(), out_sw.data_ptr(), E, M, E,
                      1e-6, 1, 1)
    assert torch.equal(h_hw, h_sw) and torch.equal(out_hw, out_sw)
    gu = (torch.randn(M, 2 * 2048, generator=g) * 4).bfloat16()
    act_sw = torch.empty(M, 2048, dtype=torch.bfloat16)
    sw.gelu_tanh_and_mul(gu.data_ptr(), 4096, act_sw.data_ptr(), 2048, M, 2048, 1, 1)
    assert torch.equal(K.gelu_tanh_and_mul(gu), act_sw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype, via):
    nb, bs, KVH, hd, T = 6, 4, 2, 16, 5
    qkv = torch.randn(T, 3 * KVH * hd).to(dtype)
    k = qkv[:, KVH * hd : 2 * KVH * hd].view(T, KVH, hd)
    v = qkv[:, 2 * KVH * hd :].view(T, KVH, hd)
    kc, vc = torch.zeros(nb, bs, KVH, hd, dtype=dtype), torch.zeros(nb, bs, KVH, hd, dtype=dtype)
    slots = torch.tensor([3, 17, -1, 0, 23])
    K.reshape_and_cache(k, v, kc, vc, slots)
    ek, ev = torch.zeros_like(kc).view(-1, KVH, hd), torch.zeros_like(vc).view(-1, KVH, hd)
    keep = slots >= 0
    ek[slots[keep]] = k[keep]
    ev[slots[keep]] = v[keep]
    assert torch.equal(kc.view(-1, KVH, hd), ek) and torch.equal(vc.view(-1, KVH, hd), ev)


@pytest.fixture(params=[True, False], ids=["amx", "avx512"])
def amx(request):
    """Run a test with the AMX decode-attention path on (where the CPU has it) and off."""
    used = K.set_amx(request.param)
    yield used
    K.set_amx(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (9, 3, 64, 32), (4, 4, 80, 16), (8, 2, 128, 16),
                                         (16, 1, 32, 16), (32, 2, 64, 16)])
def test_paged_attention_decode_matches_sdpa(dtype, H, KVH, hd, bs, amx, via):
    g = torch.Generator().manual_seed(H * hd)
    nb = 1024 // bs
    ctx = [1, 15, 16, 17, 31, 100, 333]
    kc = torch.randn(nb, bs, KVH, hd, generator=g).to(dtype)
    vc = torch.randn(nb, bs, KVH, hd, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n in ctx:
        nblk = math.ceil(n / bs)
        tables.append(perm[i : i + nblk])
        i += nblk
    # Slots outside every context hold NaN: kernels that load whole tiles or blocks must not
    # let them reach the output.
    used = torch.zeros(nb * bs, dtype=torch.bool)
    for t, n in zip(tables, ctx):
        used[torch.tensor([t[j // bs] * bs + j % bs for j in range(n)])] = True
    kc.view(nb * bs, -1)[~used] = float("nan")
    vc.view(nb * bs, -1)[~used] = float("nan")
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(ctx), (H + 2 * KVH) * hd, generator=g).to(dtype)
    q = qkv[:, : H * hd].view(len(ctx), H, hd)  # strided rows, as in the model
    scale = hd**-0.5
    out = K.paged_attention_decode(q, kc, vc, bt, torch.tensor(ctx), scale)
    assert not out.isnan().any()
    for d, n in enumerate(ctx):
        slots = torch.tensor([tables[d][j // bs] * bs + j % bs for j in range(n)])
        k = kc.view(-1, KVH, hd)[slots].transpose(0, 1).float()  # [KVH, n, hd]
        v = vc.view(-1, KVH, hd)[slots].transpose(0, 1).float()
        e = F.scaled_dot_product_attention(q[d].float().unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[d].float(), e, rtol=tol, atol=tol)


@pytest.mark.skipif(not K.amx_prefill_supported(torch.bfloat16, 9, 3, 64, 16), reason="needs AMX-BF16")
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (16, 8, 128, 32), (4, 1, 32, 16), (32, 2, 64, 16)])
def test_paged_attention_prefill_matches_causal_sdpa(H, KVH, hd, bs, via):
    """Chunks with and without cached context before them (chunked prefill, prefix hits), one
    token, lengths that are not multiples of a tile; NaN in every slot no context covers."""
    g = torch.Generator().manual_seed(H + hd)

    def pools(nb, used):
        kc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
        vc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
        kc.view(nb * bs, -1)[~used] = float("nan")
        vc.view(nb * bs, -1)[~used] = float("nan")
        return kc, vc

    _check_prefill_matches_sdpa(H, KVH, hd, bs, g, pools, lambda c, slots: c.view(-1, KVH, hd)[slots])


#: (tokens, num_past) of the chunks in one prefill batch
PREFILL_CHUNKS = [(7, 0), (20, 5), (33, 0), (1, 17), (64, 60), (130, 0)]


def _check_prefill_matches_sdpa(H, KVH, hd, bs, g, pools, gather):
    """The C prefill kernel over PREFILL_CHUNKS in scattered blocks of the pools
    ``pools(num_blocks, used_slots) -> (k_cache, v_cache)`` against causal SDPA per chunk over
    ``gather(cache, slots) -> [L, KVH, hd]``."""
    nb = 2048 // bs
    chunks = PREFILL_CHUNKS
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n, past in chunks:
        tables.append(perm[i : i + math.ceil((n + past) / bs)])
        i += len(tables[-1])
    used = torch.zeros(nb * bs, dtype=torch.bool)
    for t, (n, past) in zip(tables, chunks):
        used[torch.tensor([t[j // bs] * bs + j % bs for j in range(n + past)])] = True
    kc, vc = pools(nb, used)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    T = sum(n for n, _ in chunks)
    qkv = torch.randn(T, (H + 2 * KVH) * hd, generator=g).bfloat16()
    q = qkv[:, : H * hd].view(T, H, hd)  # strided rows, as in the model
    starts = [sum(n for n, _ in chunks[:p]) for p in range(len(chunks))]
    info = torch.tensor([[s, n, past] for s, (n, past) in zip(starts, chunks)])
    out = torch.full((T, H, hd), float("nan"), dtype=torch.bfloat16)
    K.paged_attention_prefill(q, kc, vc, bt, info, hd**-0.5, out)
    for p, (s, (n, past)) in enumerate(zip(starts, chunks)):
        L = n + past
        slots = torch.tensor([tables[p][j // bs] * bs + j % bs for j in range(L)])
        k = gather(kc, slots).transpose(0, 1).float()
        v = gather(vc, slots).transpose(0, 1).float()
        mask = torch.arange(L).unsqueeze(0) <= (past + torch.arange(n)).unsqueeze(1)
        e = F.scaled_dot_product_attention(q[s : s + n].float().transpose(0, 1), k, v, attn_mask=mask,
                                           scale=hd**-0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[s : s + n].float(), e, rtol=1e-2, atol=1e-2)


def test_paged_attention_prefill_rejects_what_it_cannot_run():
    q = torch.randn(4, 4, 80).bfloat16()
    kc = torch.randn(2, 16, 2, 80).bfloat16()
    with pytest.raises(ValueError, match="head_dim 80"):
        K.paged_attention_prefill(q, kc, kc, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[0, 4, 0]]), 0.1,
                                  torch.empty_like(q))


def test_paged_attention_decode_rejects_unsupported_shapes():
    q = torch.randn(1, 6, 64)
    kc = torch.randn(2, 16, 4, 64)
    with pytest.raises(ValueError, match="kv_heads 4"):
        K.paged_attention_decode(q, kc, kc, torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), 0.1)


def test_kernels_reject_non_2d_input():
    with pytest.raises(ValueError, match="x must be 2-D"):
        K.silu_and_mul(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="even number of columns"):
        K.silu_and_mul(torch.randn(2, 5))


def test_set_amx_reports_what_is_in_effect():
    try:
        assert K.set_amx(False) is False
        assert K.set_amx(True) == ({"amx_tile", "amx_bf16", "avx512_bf16"} <= K.cpu_flags())
    finally:
        K.set_amx(True)


@pytest.mark.parametrize("bf16_dot", [True, False])
def test_paged_attention_bf16_paths_agree(bf16_dot):
    """bf16 attention on VDPBF16PS (probabilities rounded to bf16, as PyTorch's CPU flash
    attention does) and on float32 FMAs both stay within bf16 noise of float32 SDPA."""
    used = K.set_bf16_dot(bf16_dot)
    try:
        g = torch.Generator().manual_seed(7)
        H, KVH, hd, bs, L = 8, 2, 128, 16, 77
        kc = torch.randn(8, bs, KVH, hd, generator=g).bfloat16()
        vc = torch.randn(8, bs, KVH, hd, generator=g).bfloat16()
        q = torch.randn(1, H, hd, generator=g).bfloat16()
        bt = torch.tensor([[5, 0, 7, 2, 3]])
        out = K.paged_attention_decode(q, kc, vc, bt, torch.tensor([L]), hd**-0.5)
        slots = torch.tensor([bt[0, j // bs].item() * bs + j % bs for j in range(L)])
        k = kc.view(-1, KVH, hd)[slots].transpose(0, 1).float()
        v = vc.view(-1, KVH, hd)[slots].transpose(0, 1).float()
        e = F.scaled_dot_product_attention(q[0].float().unsqueeze(1), k, v, scale=hd**-0.5, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[0].float(), e, rtol=1e-2, atol=1e-2)
        assert used == (bf16_dot and "avx512_bf16" in K.cpu_flags())
    finally:
        K.set_bf16_dot(True)


def test_default_backend_falls_back_for_shapes_the_kernel_does_not_handle():
    from kvserve.worker.attention import CPUPagedAttentionBackend, TorchSDPABackend, default_backend

    cpu = torch.device("cpu")
    assert isinstance(default_backend(cpu, torch.bfloat16, 9, 3, 64), CPUPagedAttentionBackend)
    assert type(default_backend(cpu, torch.bfloat16, 8, 2, 512)) is TorchSDPABackend  # head_dim > 256
    assert type(default_backend(cpu, torch.float32, 128, 1, 64)) is TorchSDPABackend  # 128 heads per KV head
    assert type(default_backend(cpu, torch.float16, 9, 3, 64)) is TorchSDPABackend


@pytest.mark.parametrize("M,V", [(1, 49152), (5, 37), (64, 1000)])
def test_log_sum_exp(M, V, via):
    g = torch.Generator().manual_seed(V)
    big = torch.randn(M, V + 3, generator=g) * 6
    x = big[:, 2 : 2 + V]  # row stride V + 3, tail shorter than one vector
    x[0, : V // 2] = float("-inf")  # -inf logits contribute nothing
    mx = x.amax(dim=1, keepdim=True)
    expect = torch.logsumexp(x.double() - mx.double(), dim=1, keepdim=True).float()
    got = K.log_sum_exp(x, mx)
    assert got.shape == (M, 1)
    torch.testing.assert_close(got, expect, rtol=2e-6, atol=2e-6)


def test_log_sum_exp_rejects_bad_input():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="float32"):
        K.log_sum_exp(x.bfloat16(), x.amax(1))
    with pytest.raises(ValueError, match="row_max must have 4"):
        K.log_sum_exp(x, torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,V", [(1, 49152), (5, 37), (64, 1000)])
def test_greedy_is_first_argmax_with_the_log_partition_of_log_sum_exp(dtype, M, V, via):
    g = torch.Generator().manual_seed(M + V)
    big = (torch.randn(M, V + 5, generator=g) * 4).to(dtype)
    x = big[:, 3 : 3 + V]  # row stride V + 5
    x[0, : V // 2] = float("-inf")
    if V > 20:  # a tie for the maximum: the first index wins
        x[-1, 7] = x[-1, V - 2] = x[-1].float().amax() + 1
    got = K.greedy(x)
    assert got is not None
    tokens, row_max, log_z = got
    xf = x.float()
    assert torch.equal(tokens, torch.from_numpy(np.argmax(xf.numpy(), axis=1)))
    assert torch.equal(row_max, xf.amax(dim=1))
    assert torch.equal(log_z, K.log_sum_exp(xf, row_max).squeeze(1))  # bit for bit


def test_greedy_gives_up_on_non_finite_maxima_and_rejects_bad_input(via):
    x = torch.randn(3, 100)
    x[1, 5] = float("nan")
    assert K.greedy(x) is None
    x[1, 5] = float("inf")
    assert K.greedy(x) is None
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.greedy(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        K.greedy(torch.randn(4, 6).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,V", [(1, 49152), (5, 37), (64, 1000)])
def test_greedy_sample_gives_greedy_tokens_and_minus_log_z(dtype, M, V):
    """The sampler's fast path: greedy's tokens and ``0.0 - log_z`` bit for bit (one call, the
    rows' maxima checked in C); None as soon as one row's maximum is not finite."""
    if not K.available():
        pytest.skip("needs the CPU kernels")
    g = torch.Generator().manual_seed(M * V)
    x = (torch.randn(M, V + 3, generator=g) * 4).to(dtype)[:, 1 : 1 + V]
    x[0, : V // 2] = float("-inf")
    tokens, _, log_z = K.greedy(x)
    got = K.greedy_sample(x)
    assert got is not None
    assert torch.equal(got[0], tokens) and torch.equal(got[1], 0.0 - log_z)
    assert got[1].dtype == torch.float32 and bool((got[1] <= 0).all())
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[M - 1] = float("-inf") if bad == float("-inf") else y[M - 1]
        y[M - 1, V // 3] = bad
        assert K.greedy_sample(y) is None and K.greedy(y) is None
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.greedy_sample(x.half())
    with pytest.raises(ValueError, match="unit stride"):
        K.greedy_sample(torch.randn(4, 6).t())
    assert K.greedy_sample(torch.empty(0, V)) is None


@pytest.mark.parametrize("V,W", [(100, 3), (64, 2)])
def test_apply_token_bitmask(V, W, via):
    """Columns whose bit is clear become -inf in the rows the mask rows name (columns at or past
    32·W too); the other rows and allowed columns are untouched."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, W), dtype=torch.int32, generator=g)
    rows = torch.tensor([4, 0, 2])
    allowed = ((bitmask.long().unsqueeze(-1) >> torch.arange(32)) & 1).bool().reshape(3, 32 * W)
    allowed = F.pad(allowed, (0, max(0, V - 32 * W)))[:, :V]
    want = x.clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    got = x.clone()
    K.apply_token_bitmask_(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], x[[1, 3]])


# ---- 8-bit KV pools (kv_cache_dtype int8 / fp8: kvserve.worker.kv_quant) ------------------------------

KV8 = [torch.int8, torch.float8_e4m3fn]


def _quantized_pools(nb, bs, KVH, hd, kv_dtype, g, used):
    """K and V pools quantized from random values whose magnitude varies per row; rows not in
    ``used`` get a NaN scale, so a kernel that lets them reach the output fails."""
    from kvserve.worker import kv_quant

    pools = []
    for _ in range(2):
        x = torch.randn(nb * bs, KVH, hd, generator=g) * torch.rand(nb * bs, KVH, 1, generator=g) * 4
        rows = kv_quant.quantize(x, kv_dtype).view(torch.uint8)
        rows[~used, :, hd:] = torch.tensor([float("nan")]).view(torch.uint8)
        pools.append(rows.view(kv_dtype).view(nb, bs, KVH, hd + 4))
    return pools


def _scattered_tables(nb, bs, ctx, g):
    """A random permutation of ``nb`` blocks, block tables taking consecutive runs of it for
    contexts of ``ctx`` tokens, and the ``[nb * bs]`` mask of the slots those contexts hold."""
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n in ctx:
        tables.append(perm[i : i + math.ceil(n / bs)])
        i += len(tables[-1])
    used = torch.zeros(nb * bs, dtype=torch.bool)
    for t, n in zip(tables, ctx):
        used[(torch.tensor(t).repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(t)))[:n]] = True
    return perm, tables, used


def _pools_nan_outside(nb, bs, KVH, hd, dtype, kv_dtype, g, used):
    """Random K and V pools in ``dtype`` (``kv_dtype`` None) or 8-bit pools (:func:`_quantized_pools`),
    NaN (or a NaN scale) in every slot not in ``used``."""
    if kv_dtype is not None:
        return _quantized_pools(nb, bs, KVH, hd, kv_dtype, g, used)
    kc = torch.randn(nb, bs, KVH, hd, generator=g).to(dtype)
    vc = torch.randn(nb, bs, KVH, hd, generator=g).to(dtype)
    kc.view(nb * bs, -1)[~used] = float("nan")
    vc.view(nb * bs, -1)[~used] = float("nan")
    return kc, vc


@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_quantizes_bit_for_bit_as_kv_quant(dtype, kv_dtype, via):
    from kvserve.worker import kv_quant

    nb, bs, KVH, hd, T = 6, 4, 2, 48, 7
    qkv = (torch.randn(T, 3 * KVH * hd) * 3).to(dtype)
    qkv[0, KVH * hd : 2 * KVH * hd] = 0  # an all-zero row: scale 1, zero codes
    # e4m3 edge cases: subnormal codes, ties, the largest value (the row's max maps to 448)
    qkv[1, KVH * hd : KVH * hd + 6] = torch.tensor([2.0**-12, 3 * 2.0**-14, 1e-4, -7e-3, 2.5e-3, 1.0]).to(dtype)
    k = qkv[:, KVH * hd : 2 * KVH * hd].view(T, KVH, hd)
    v = qkv[:, 2 * KVH * hd :].view(T, KVH, hd)
    kc = torch.zeros(nb, bs, KVH, hd + 4, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 17, -1, 0, 23, 5, 9])
    K.reshape_and_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    for cache, x in ((kc, k), (vc, v)):
        expect = torch.zeros(nb * bs, KVH, hd + 4, dtype=torch.uint8)
        expect[slots[keep]] = kv_quant.quantize(x[keep], kv_dtype).view(torch.uint8)
        assert torch.equal(cache.view(torch.uint8).view(-1, KVH, hd + 4), expect)


@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 80, 16), (16, 1, 32, 32)])
def test_paged_attention_decode_on_8bit_pools_matches_sdpa_on_dequantized(dtype, kv_dtype, H, KVH, hd, bs, amx):
    """The C kernel (AMX and AVX-512 paths) on int8/fp8 pools equals SDPA over the same pools
    dequantized by kv_quant (codes · scale rounded to the model dtype)."""
    from kvserve.worker import kv_quant

    g = torch.Generator().manual_seed(H * hd + 1)
    nb = 1024 // bs
    ctx = [1, 15, 16, 17, 31, 100, 333]
    _, tables, used = _scattered_tables(nb, bs, ctx, g)
    kc, vc = _quantized_pools(nb, bs, KVH, hd, kv_dtype, g, used)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(ctx), (H + 2 * KVH) * hd, generator=g).to(dtype)
    q = qkv[:, : H * hd].view(len(ctx), H, hd)
    scale = hd**-0.5
    out = K.paged_attention_decode(q, kc, vc, bt, torch.tensor(ctx), scale)
    assert not out.isnan().any()
    for d, n in enumerate(ctx):
        slots = torch.tensor([tables[d][j // bs] * bs + j % bs for j in range(n)])
        k = kv_quant.gather(kc, slots, dtype).transpose(0, 1).float()
        v = kv_quant.gather(vc, slots, dtype).transpose(0, 1).float()
        e = F.scaled_dot_product_attention(q[d].float().unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[d].float(), e, rtol=tol, atol=tol)


@pytest.mark.skipif(not K.amx_prefill_supported(torch.bfloat16, 9, 3, 64, 16), reason="needs AMX-BF16")
@pytest.mark.parametrize("kv_dtype", KV8)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (16, 8, 128, 32)])
def test_paged_attention_prefill_on_8bit_pools_matches_sdpa_on_dequantized(H, KVH, hd, bs, kv_dtype):
    from kvserve.worker import kv_quant

    g = torch.Generator().manual_seed(H + hd + 1)
    _check_prefill_matches_sdpa(H, KVH, hd, bs, g,
                                lambda nb, used: _quantized_pools(nb, bs, KVH, hd, kv_dtype, g, used),
                                lambda c, slots: kv_quant.gather(c, slots, torch.bfloat16))


@pytest.mark.parametrize("kv_dtype", [None] + KV8, ids=["model-dtype", "int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 80, 16), (16, 1, 32, 32)])
def test_paged_attention_decode_window_matches_reference(dtype, kv_dtype, H, KVH, hd, bs, amx, via):
    """Sliding-window decode: the new token at position p = L - 1 sees keys (p - W, p] only.
    Windows of 1, 7, 16, 33 and 100 tokens (odd ones not multiples of the block size) over
    contexts shorter and longer than them; the reference is float32 SDPA over exactly the
    window's keys. Every table entry before the window's first block points at a block of
    NaN (a freed block), so a walk that starts a block too early fails; keys of the first
    block before the window hold finite random values, so a start one key too early changes
    the output beyond the tolerance."""
    from kvserve.worker import kv_quant

    g = torch.Generator().manual_seed(H * hd + bs)
    nb = 2048 // bs
    ctx = [1, 7, 15, 16, 17, 31, 100, 333]
    windows = [1, 7, 16, 33, 100]
    nan_block = nb - 1
    perm = torch.randperm(nb - 1, generator=g).tolist()
    rows = [(n, w) for w in windows for n in ctx]
    tables, i = [], 0
    for n, w in rows:
        first = (n - w) // bs if n > w else 0
        t = [nan_block] * first + perm[i : i + math.ceil(n / bs) - first]
        i += math.ceil(n / bs) - first
        tables.append(t)
    assert i <= nb - 1
    used = torch.zeros(nb * bs, dtype=torch.bool)
    for t, (n, w) in zip(tables, rows):
        first = (n - w) // bs if n > w else 0
        used[torch.tensor([t[j // bs] * bs + j % bs for j in range(first * bs, n)])] = True
    kc, vc = _pools_nan_outside(nb, bs, KVH, hd, dtype, kv_dtype, g, used)
    width = max(map(len, tables))
    bt = torch.tensor([t + [nan_block] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(rows), (H + 2 * KVH) * hd, generator=g).to(dtype)
    q = qkv[:, : H * hd].view(len(rows), H, hd)
    scale = hd**-0.5
    lens = torch.tensor([n for n, _ in rows])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for w in windows:  # one call per window, all contexts batched
        sel = [d for d, (_, wd) in enumerate(rows) if wd == w]
        qs = q[sel]
        out = K.paged_attention_decode(qs, kc, vc, bt[sel].contiguous(), lens[sel].contiguous(), scale, window=w)
        assert not out.isnan().any()
        for r, d in enumerate(sel):
            n = rows[d][0]
            slots = torch.tensor([tables[d][j // bs] * bs + j % bs for j in range(max(0, n - w), n)])
            k = kv_quant.gather(kc, slots, dtype).transpose(0, 1).float()
            v = kv_quant.gather(vc, slots, dtype).transpose(0, 1).float()
            e = F.scaled_dot_product_attention(qs[r].float().unsqueeze(1), k, v, scale=scale,
                                               enable_gqa=True).squeeze(1)
            torch.testing.assert_close(out[r].float(), e, rtol=tol, atol=tol)


def _split_case(dtype, kv_dtype, H, KVH, hd, bs, ctx, seed):
    """Pools, block tables and queries for sequences of ``ctx`` tokens (scattered blocks; NaN, or
    NaN scales, in every slot outside a context)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(math.ceil(n / bs) for n in ctx) + 1
    perm, tables, used = _scattered_tables(nb, bs, ctx, g)
    kc, vc = _pools_nan_outside(nb, bs, KVH, hd, dtype, kv_dtype, g, used)
    width = max(map(len, tables))
    bt = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(ctx), (H + 2 * KVH) * hd, generator=g).to(dtype)
    return kc, vc, bt, qkv[:, : H * hd].view(len(ctx), H, hd), tables


@pytest.mark.parametrize("kv_dtype", [None] + KV8, ids=["model-dtype", "int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (4, 4, 80, 16), (8, 2, 128, 32), (2, 1, 64, 3)])
def test_paged_attention_decode_split_along_the_keys_matches_sdpa(dtype, kv_dtype, H, KVH, hd, bs, amx, via):
    """Contexts longer than 512 keys run in splits of whole blocks, each attended on its own and
    merged by their softmax maxima and sums (flash-decoding): contexts of 511 to 2,500 keys, with no
    window and with windows of 700 and 1,500 keys (the window's first key inside split 0's first
    block), equal float32 SDPA over exactly the attended keys."""
    from kvserve.worker import kv_quant

    ctx = [511, 512, 513, 1000, 1100, 2500]
    kc, vc, bt, q, tables = _split_case(dtype, kv_dtype, H, KVH, hd, bs, ctx, seed=H * hd + bs)
    scale = hd**-0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for w in (None, 700, 1500):
        out = K.paged_attention_decode(q, kc, vc, bt, torch.tensor(ctx), scale, window=w)
        assert not out.isnan().any()
        for d, n in enumerate(ctx):
            first = n - w if w is not None and n > w else 0
            slots = torch.tensor([tables[d][j // bs] * bs + j % bs for j in range(first, n)])
            k = kv_quant.gather(kc, slots, dtype).transpose(0, 1).float()
            v = kv_quant.gather(vc, slots, dtype).transpose(0, 1).float()
            e = F.scaled_dot_product_attention(q[d].float().unsqueeze(1), k, v, scale=scale,
                                               enable_gqa=True).squeeze(1)
            torch.testing.assert_close(out[d].float(), e, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["model-dtype", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (12, 4, 64, 5), (16, 2, 256, 16)])
@pytest.mark.parametrize("window", [None, 333])
def test_split_decode_output_depends_on_the_sequence_alone(dtype, kv_dtype, H, KVH, hd, bs, window):
    """How a context is split depends on its own length: each sequence's output is bit for bit the
    same alone, in a batch of shorter and longer ones, and on one thread or two. (With bf16 pools
    on the VDPBF16PS kernel a batch of at least 4 (sequence, split) pairs a thread runs whole
    pairs as items, every KV head in one pass over the token rows, and one sequence alone runs an
    item per KV head: the same sums in the same order. Block size 5 leaves odd runs of keys.)"""
    ctx = [40, 700, 1500, 2100, 3, 17, 333, 334]
    kc, vc, bt, q, _ = _split_case(dtype, kv_dtype, H, KVH, hd, bs, ctx, seed=7 + H + bs)
    prev = torch.get_num_threads()
    try:
        outs = []
        for threads in (2, 1):
            torch.set_num_threads(threads)
            outs.append(K.paged_attention_decode(q, kc, vc, bt, torch.tensor(ctx), hd**-0.5, window=window))
            assert not outs[-1].isnan().any()
            for d in range(len(ctx)):
                alone = K.paged_attention_decode(q[d : d + 1], kc, vc, bt[d : d + 1].contiguous(),
                                                 torch.tensor(ctx[d : d + 1]), hd**-0.5, window=window)
                assert torch.equal(alone[0], outs[-1][d]), (threads, d)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(prev)


def test_paged_attention_decode_window_reads_only_the_window():
    """The same query over a long context with and without a window: the windowed result
    equals full attention over a context cut to the window's keys, and differs from full
    attention over the whole context (the window is not ignored)."""
    g = torch.Generator().manual_seed(3)
    H, KVH, hd, bs, L, W = 4, 2, 64, 16, 300, 37
    kc = torch.randn(32, bs, KVH, hd, generator=g)
    vc = torch.randn(32, bs, KVH, hd, generator=g)
    bt = torch.randperm(32, generator=g)[: math.ceil(L / bs)].unsqueeze(0)
    q = torch.randn(1, H, hd, generator=g)
    win = K.paged_attention_decode(q, kc, vc, bt, torch.tensor([L]), hd**-0.5, window=W)
    full = K.paged_attention_decode(q, kc, vc, bt, torch.tensor([L]), hd**-0.5)
    assert (win - full).abs().max() > 1e-2
    slots = torch.tensor([bt[0, j // bs].item() * bs + j % bs for j in range(L - W, L)])
    k = kc.view(-1, KVH, hd)[slots].transpose(0, 1)
    v = vc.view(-1, KVH, hd)[slots].transpose(0, 1)
    e = F.scaled_dot_product_attention(q[0].unsqueeze(1), k, v, scale=hd**-0.5, enable_gqa=True).squeeze(1)
    torch.testing.assert_close(win[0], e, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="window"):
        K.paged_attention_decode(q, kc, vc, bt, torch.tensor([L]), hd**-0.5, window=0)
