"""kvserve.worker.layers.linear: every backend agrees with F.linear; int8 is opt-in and close."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvserve.worker.layers import linear as L
from kvserve.worker.layers.linear import Linear, cpu_kernels, onednn_available, quantize_int8

KERNELS = cpu_kernels()
HAS_BF16 = KERNELS is not None and KERNELS.has_bf16
HAS_F32 = KERNELS is not None and KERNELS.has_f32
HAS_ONEDNN = onednn_available()
HAS_AMX = KERNELS is not None and KERNELS.has_amx

# (M, K, N): decode-sized and odd shapes (K tails that are not a multiple of the vector width,
# N not a multiple of the 4-row block), plus M above the gemv threshold (eager path).
SHAPES = [(1, 576, 960), (1, 1536, 576), (3, 64, 5), (8, 33, 7), (5, 1, 3), (2, 100, 1), (1, 576, 192),
          (L.GEMV_MAX_M_BF16, 80, 12), (L.GEMV_MAX_M_F32 + 1, 80, 12), (40, 96, 33),
          (L.GEMV_MAX_M_BF16_NO_AMX, 80, 12), (L.GEMV_MAX_M_BF16_NO_AMX + 1, 576, 96),
          # tile-eligible (N % 16 == 0, K % 32 == 0): one partial tile of rows, full tiles,
          # the largest M it takes, and the first M past it
          (L.GEMV_MAX_M_BF16 + 1, 576, 960), (16, 64, 32), (21, 1536, 576), (L.TILE_MAX_M_BF16, 96, 48),
          (L.TILE_MAX_M_BF16 + 1, 64, 16),
          # an odd number of 16-column blocks per thread (one thread: 3 blocks; two threads: 2
          # and 3), for 1-2 AMX row tiles (pairs of column blocks) and 3 (one at a time)
          (7, 64, 48), (30, 512, 80), (40, 512, 80)]


def _data(M, K, N, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if ref.dtype == torch.bfloat16:
        torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-2)  # ~2 bf16 ulps
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "eager", "gemv", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(dtype, backend, bias):
    for i, (M, K, N) in enumerate(SHAPES):
        x, w, b = _data(M, K, N, dtype, bias, seed=i)
        layer = Linear(w, b, backend=backend)
        _check(layer(x), F.linear(x, w, b))


def test_resolved_backend():
    w = torch.randn(8, 16)
    assert Linear(w, backend="eager").backend == "eager"
    assert Linear(w).backend == ("gemv" if HAS_F32 else "eager")  # fp32: MKL above gemv sizes
    want = "+".join((["gemv"] if HAS_BF16 else []) + (["onednn"] if HAS_ONEDNN else [])) or "eager"
    assert Linear(w.bfloat16()).backend == want
    assert Linear(w.bfloat16(), backend="gemv").backend == ("gemv" if HAS_BF16 else "eager")
    assert Linear(w.double()).backend == "eager"  # no kernel for float64: plain F.linear
    if HAS_BF16:  # (8 x 16: no tile kernel) bf16 gemv up to 4 tokens with AMX, 2 without, oneDNN above
        assert Linear(w.bfloat16())._gemv_max_m == (L.GEMV_MAX_M_BF16 if HAS_AMX else L.GEMV_MAX_M_BF16_NO_AMX)
    assert Linear(w).quantization is None  # int8 only on request


@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("bias", [False, True])
def test_tile_path_runs_for_batched_decode_and_matches_f_linear(bias, monkeypatch):
    x, w, b = _data(L.TILE_MAX_M_BF16 + 1, 576, 960, torch.bfloat16, bias, seed=3)
    x = torch.cat([x, x, x])  # 195 rows: past the AMX limit, and prefill-sized
    layer = Linear(w, b)
    # AMX: tiles up to TILE_MAX_M_BF16 tokens, oneDNN above (its own copy of the weight);
    # AVX512-BF16 alone: tiles for every M above gemv's, and no oneDNN copy
    # AVX512-BF16 alone: tiles for every M, gemv for none, and no oneDNN copy
    onednn = HAS_ONEDNN and HAS_AMX
    assert layer.backend == "+".join((["gemv"] if HAS_AMX else []) + [KERNELS.tile_kernel]
                                     + (["onednn"] if onednn else []))
    assert KERNELS.tile_kernel == ("amx" if HAS_AMX else "avx512bf16")
    assert (layer._packed is not None) == onednn
    g = layer._gemv_max_m
    assert g == (L.GEMV_MAX_M_BF16 if HAS_AMX else 0)
    calls = []
    real = L.tile_linear
    monkeypatch.setattr(L, "tile_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    Ms = (1, g, g + 1, 17, L.TILE_MAX_M_BF16, L.TILE_MAX_M_BF16 + 1, 195)
    for M in Ms:
        ref = F.linear(x[:M].float(), w.float(), None if b is None else b.float())
        y = layer(x[:M])
        # float32 accumulation and one rounding: within one bf16 ulp of the exact product
        torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-3)
        torch.testing.assert_close(y, F.linear(x[:M], w, b), rtol=1.6e-2, atol=1e-2)
    assert calls == [M for M in Ms if g < M <= (L.TILE_MAX_M_BF16 if HAS_AMX else 1 << 62)]


def _bf16p_linear(x, packed, N, b):
    """The AVX512-BF16 tile kernel itself (``kv_bf16p_linear``), also on a CPU where
    :func:`~kvserve.worker.layers.linear.tile_linear` runs AMX."""
    M, K = x.shape
    y = x.new_empty((M, N))
    assert KERNELS.bf16p_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                                y.data_ptr(), N, M, N, K, torch.get_num_threads()) == 0
    return y


@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("kernel", ["tile_linear", "bf16p"])
@pytest.mark.parametrize("N", [80, 960])
def test_tile_rows_do_not_depend_on_the_blocking(kernel, N):
    # AMX: 1-2 row tiles run on pairs of column blocks, 3-4 on one block at a time (and 5+ in
    # groups of 4); AVX512-BF16: register tiles of 1-4 rows x 1-6 column blocks (N = 80: 5
    # blocks, split 2 + 3 between two threads). Every output element sums the same products in
    # the same order either way, so a row's values do not depend on M or on the other rows.
    fn = L.tile_linear if kernel == "tile_linear" else _bf16p_linear
    x, w, b = _data(L.TILE_MAX_M_BF16, 512, N, torch.bfloat16, True, seed=5)
    packed = L.tile_pack(w)
    full = fn(x, packed, N, b)
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(full.float(), exact, rtol=8e-3, atol=1e-3)
    for M in (1, 2, 3, 5, 6, 7, 16, 17, 31, 32, 33, 48, 49):
        assert torch.equal(fn(x[:M], packed, N, b), full[:M]), M
        assert torch.equal(fn(x[M:], packed, N, b), full[M:]), M  # the same rows at other tile offsets
    assert fn(x[:0], packed, N, b).shape == (0, N)  # no rows (a prefill chunk that samples nothing)
    tall = torch.cat([x, x[:21]])  # 85 rows: a group of 4 row tiles, then 2
    assert torch.equal(fn(tall, packed, N, b), torch.cat([full, full[:21]]))
    strided = torch.cat([x, x], dim=1)[:, :512]  # rows 1024 elements apart (ldx != K)
    assert torch.equal(fn(strided, packed, N, b), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "eager", "gemv", "onednn"])
def test_zero_rows(dtype, backend):
    # the LM head of a step whose prefill chunks all end inside their prompts gets no rows
    x, w, b = _data(4, 576, 960, dtype, True)
    layer = Linear(w, b, backend=backend)
    assert layer(x[:0]).shape == (0, 960)
    assert layer(x[:0].view(0, 1, 576)).shape == (0, 1, 960)


def test_tile_pack_rejects_unsupported_weights():
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        L.tile_pack(torch.randn(24, 64).bfloat16())
    with pytest.raises(ValueError, match="float32"):
        L.tile_pack(torch.randn(32, 64))


def test_falls_back_off_cpu():
    w = torch.empty(8, 16, device="meta")
    layer = Linear(w)
    assert layer.backend == "eager"
    assert layer(torch.empty(2, 16, device="meta")).shape == (2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_dims_and_strided_input(dtype):
    x, w, b = _data(6, 48, 20, dtype, True)
    layer = Linear(w, b)
    x3 = x.view(2, 3, 48)
    _check(layer(x3), F.linear(x3, w, b))
    wide = torch.randn(4, 96).to(dtype)
    xs = wide[:, ::2]  # last-dim stride 2
    _check(layer(xs), F.linear(xs, w, b))
    xr = wide[:, :48]  # row stride 96, unit last-dim stride
    _check(layer(xr), F.linear(xr, w, b))
    assert layer(x[:0]).shape == (0, 20)


@pytest.mark.skipif(not HAS_BF16, reason="no AVX512_BF16 gemv kernel on this CPU")
def test_gemv_bf16_mostly_bitwise_equal():
    x, w, b = _data(1, 576, 3072, torch.bfloat16, False)
    y, ref = L.gemv(x, w), F.linear(x, w)
    assert (y == ref).float().mean() > 0.99


def test_autograd_falls_back():
    x, w, _ = _data(2, 16, 8, torch.float32, False)
    x.requires_grad_(True)
    Linear(w)(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, L.GEMV_MAX_M_INT8 + 1])
def test_int8_close_to_f_linear(dtype, M):
    x, w, b = _data(M, 576, 200, dtype, True)
    layer = Linear(w, b, quantization="int8")
    assert layer.weight is None and layer.qweight.dtype == torch.int8
    y = layer(x)
    assert y.shape == (M, 200) and y.dtype == dtype
    ref = F.linear(x.double(), w.double(), b.double())
    err = (y.double() - ref).norm() / ref.norm()
    assert err < 0.02, err
    # kernel path and dequantized path compute the same quantized product
    deq = F.linear(x.double(), layer.qweight.double() * layer.scale.double()[:, None], b.double())
    torch.testing.assert_close(y.double(), deq, rtol=2e-2, atol=2e-2)


def test_quantize_int8_roundtrip():
    w = torch.randn(32, 64)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (32,) and q.abs().max() <= 127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()


def test_rejects_bad_arguments():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError):
        Linear(w, quantization="int4")
    with pytest.raises(ValueError):
        Linear(w, backend="fast")
    with pytest.raises(ValueError):
        Linear(w[0])
    with pytest.raises(ValueError):
        Linear(w, torch.randn(5))


@pytest.mark.skipif(not HAS_F32, reason="no AVX-512 gemv kernel on this CPU")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_custom_op_under_torch_compile(quantization):
    x, w, b = _data(1, 64, 24, torch.float32, True)
    layer = Linear(w, b, quantization=quantization)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), layer(x))
