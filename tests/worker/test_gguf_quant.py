"""GGUF-quantized weights kept quantized (issue #22): the formats, the packed layout, the
AVX512-VNNI kernel (``csrc/cpu/qgemv.c``) against its PyTorch reference, the chunked path for
many tokens, and the layers (``Linear``, tensor-parallel shards, embedding and LM head).
Tiny random tensors only; ~3 s."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.worker.layers import linear as L
from kvserve.worker.layers import quant as Q
from kvserve.worker.layers.linear import Linear
from kvserve.worker.layers.parallel_linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
from kvserve.worker.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

HAS_KERNEL = Q.q_kernels() is not None
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs the qgemv kernel (AVX512-VNNI, built at install)")
TYPES = list(Q.KEPT_TYPES)


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> Q.GGUFWeight:
    """Random blocks of ``qtype`` (every bit pattern of the values and 6-bit scales) with sane
    fp16 scales (no inf/NaN)."""
    g = torch.Generator().manual_seed(seed)
    bs, bb = Q.BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // bs, bb), dtype=torch.uint8, generator=g)
    half = lambda lo, hi: (torch.rand(n, k // bs, generator=g) * (hi - lo) + lo).half().view(torch.uint8).view(  # noqa: E731
        n, k // bs, 2)
    if qtype == "Q6_K":  # (fp16 d last; the int8 scales any byte)
        raw[..., 208:210] = half(0.0001, 0.002)
        return Q.GGUFWeight(qtype, raw.reshape(n, -1), (n, k))
    if qtype == "Q3_K":
        raw[..., 108:110] = half(0.0001, 0.002)
        return Q.GGUFWeight(qtype, raw.reshape(n, -1), (n, k))
    if qtype == "Q2_K":
        raw[..., 80:82], raw[..., 82:84] = half(0.001, 0.02), half(0.0, 0.01)
        return Q.GGUFWeight(qtype, raw.reshape(n, -1), (n, k))
    raw[..., 0:2] = half(0.001, 0.02)
    if qtype == "Q4_1":
        raw[..., 2:4] = half(-0.1, 0.1)
    elif qtype in ("Q4_K", "Q5_K"):
        raw[..., 2:4] = half(0.0, 0.01)
    return Q.GGUFWeight(qtype, raw.reshape(n, -1), (n, k))


def k_for(qtype: str) -> int:
    return 512 if Q.BLOCK[qtype][0] == 256 else 96


@pytest.mark.parametrize("qtype", TYPES)
def test_unpack_is_bit_exact_with_gguf(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = random_weight(qtype, 6, k_for(qtype))
    ref = torch.from_numpy(np.asarray(dequantize(w.data.numpy(), GGMLQuantizationType[qtype]), dtype=np.float32))
    assert torch.equal(w.dequantize(), ref.reshape(w.shape))
    u, d, m = Q.unpack(w)
    assert int(u.max()) < (16 if Q.BITS[qtype] == 4 else 256)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_layout_round_trips(qtype):
    n, k = 10, k_for(qtype)  # (10 rows: not a multiple of the 4-row groups)
    w = random_weight(qtype, n, k)
    p = Q.pack_gguf([w])
    full = w.dequantize()
    assert p.shape == (n, k) and p.qs.shape[0] == 3
    assert torch.equal(Q.dequantize_packed(p), full)
    assert torch.equal(Q.dequantize_rows(p, 3, 6, torch.float32), full[3:9])
    assert torch.equal(Q.dequantize_rows(p, 0, n, torch.bfloat16), full.bfloat16())
    ids = torch.tensor([[9, 0, 4], [3, 3, 7]])
    assert torch.equal(Q.gather_rows(p, ids), full[ids])
    many = torch.randint(0, n, (40_000 // k + 1,), generator=torch.Generator().manual_seed(0))  # (rows on threads)
    for dtype in (torch.float32, torch.bfloat16):  # the C lookup (where built) gives the same numbers
        assert torch.equal(Q.embedding_rows(p, ids, dtype), full[ids].to(dtype))
        assert torch.equal(Q.embedding_rows(p, many, dtype), full[many].to(dtype))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 10\)"):
        Q.embedding_rows(p, torch.tensor([10]), torch.float32)
    # Q4_1's file holds 0.625 bytes a value; the packed form 0.75 (fp32 d and m per 32 values;
    # Q6_K per 16: 1.5)
    assert p.nbytes == 12 * k * (Q.BITS[qtype] / 8 + 8 / Q.SUB[qtype])


def test_fused_parts_of_mixed_types_pack_as_8_bit():
    parts = [random_weight("Q4_0", 8, 64, 1), random_weight("Q8_0", 4, 64, 2), random_weight("Q5_0", 4, 64, 3)]
    p = Q.pack_gguf(parts)
    assert p.bits == 8 and p.qtype == "Q4_0+Q8_0+Q5_0"
    assert torch.equal(Q.dequantize_packed(p), torch.cat([w.dequantize() for w in parts]))


def test_fused_parts_with_a_q6_k_part_pack_per_16_values():
    """A Q6_K part (a d and m per 16 values) makes the fused weight ``sub16``: the other parts'
    pairs repeat per half block, and the kernels compute the same values."""
    parts = [random_weight("Q4_K", 4, 256, 1), random_weight("Q6_K", 8, 256, 2)]
    p = Q.pack_gguf(parts)
    assert (p.bits, p.sub, p.qtype) == (8, 16, "Q4_K+Q6_K") and tuple(p.d.shape) == (3, 8, 2, 4)
    full = torch.cat([w.dequantize() for w in parts])
    assert torch.equal(Q.dequantize_packed(p), full)
    if HAS_KERNEL:
        assert torch.equal(Q.dequantize_rows(p, 0, 12, torch.float32), full)
    if Q.weight_only_available():
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
        # float32 sums in another order: the error bound scales with sum |x_k w_k|, not with the result
        bound = 1e-6 * (x.abs() @ full.abs().T).max().item()
        torch.testing.assert_close(Q.qlinear(x, p, int8=False), F.linear(x, full), rtol=0, atol=bound)


@needs_kernel
def test_activation_quantization_matches_the_reference_and_its_bound():
    x = torch.randn(5, 128) * torch.logspace(-3, 2, 128)
    x[2, :32] = 0  # an all-zero block: scale 0, values 0
    q, s = Q.quantize_activations(x)
    cq = torch.empty(5, 128, dtype=torch.int8)
    cs, css = torch.empty(5, 4), torch.empty(5, 4)
    Q.q_kernels().quantize_act(x.data_ptr(), 128, 0, 5, 128, cq.data_ptr(), cs.data_ptr(), css.data_ptr())
    assert torch.equal(cq, q) and torch.equal(cs, s)
    torch.testing.assert_close(css, s * q.view(5, 4, 32).sum(-1).float())
    err = (x.view(5, 4, 32) - s.unsqueeze(-1) * q.view(5, 4, 32).float()).abs()
    # half a step, s / 2 = max|x| / 254, plus float32 rounding: x · (1 / s) is off by up to ~127 · 2^-23
    # of a step, so a value next to a half step can round the other way, and err's own product and
    # difference round too (2.2e-5 of the bound at most in 200,000 draws of x; with 1e-6, 4.5e-4 of
    # the draws failed: x is unseeded, so a run could)
    assert bool((err <= x.view(5, 4, 32).abs().amax(-1, keepdim=True) / 254 * (1 + 1e-4)).all())
    assert bool((q[2, :32] == 0).all()) and float(s[2, 0]) == 0.0


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 3, 8, 13, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_within_the_stated_bound_of_the_reference(qtype, M, dtype):
    """qlinear(int8=True) vs dequantize-then-matmul in float32: within the int8-activation bound
    (plus float32 rounding: 1e-5 of the absolute sum; bf16 output: half a bf16 ulp of the result)."""
    n, k = 10, k_for(qtype)
    w = random_weight(qtype, n, k, seed=M)
    p = Q.pack_gguf([w])
    g = torch.Generator().manual_seed(100 + M)
    x = (torch.randn(M, k, generator=g) * 2).to(dtype)
    bias = torch.randn(n, generator=g)
    y = Q.qlinear(x, p, bias, int8=True)
    assert y.dtype == dtype and y.shape == (M, n)
    ref = F.linear(x.float(), w.dequantize(), bias)
    bound = Q.activation_error_bound(x, p) + 1e-5 * (x.float().abs() @ w.dequantize().abs().T + 1)
    if dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0 ** -8
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # (the int8 activations do change the numbers)


@pytest.mark.skipif(not Q.weight_only_available(), reason="needs the qgemv kernel and AVX512_BF16")
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 3, 5, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernel_gives_the_dequantized_models_numbers(qtype, M, dtype):
    """qlinear(int8=False): the weight as the dequantized model holds it (float32, or rounded to
    bf16 for bf16 activations) times x, float32 sums: within float32 rounding (1e-6 of the
    absolute sum) of the reference, plus half a bf16 ulp for a bf16 output."""
    n, k = 10, k_for(qtype)
    w = random_weight(qtype, n, k, seed=M)
    p = Q.pack_gguf([w])
    g = torch.Generator().manual_seed(200 + M)
    x = (torch.randn(M, k, generator=g) * 2).to(dtype)
    bias = torch.randn(n, generator=g)
    y = Q.qlinear(x, p, bias, int8=False)
    assert y.dtype == dtype and y.shape == (M, n)
    ref = Q.qlinear_reference(x, p, bias)
    wr = w.dequantize() if dtype == torch.float32 else w.dequantize().bfloat16().float()
    tol = 1e-6 * (x.float().abs() @ wr.abs().T + bias.abs()) + 1e-30
    if dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0 ** -8
    err = (y.float() - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())


@pytest.mark.skipif(not Q.weight_only_available(), reason="needs the qgemv kernel and AVX512_BF16")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_batches_through_the_scratch_buffer_equal_the_register_path(qtype, dtype):
    """More than 4 rows dequantize each group of weight rows once into a scratch buffer and run
    every 4 activation rows on it; up to 4 rows dequantize in registers. Same sums in the same
    order: bit for bit (4-bit, 8-bit and per-16 scale layouts; N not a multiple of 4)."""
    n, k = 18, k_for(qtype)
    p = Q.pack_gguf([random_weight(qtype, n, k, seed=3)])
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(11, k, generator=g) * 2).to(dtype)
    bias = torch.randn(n, generator=g)
    batched = Q.qlinear(x, p, bias, int8=False)
    by_four = torch.cat([Q.qlinear(x[i:i + 4], p, bias, int8=False) for i in range(0, 11, 4)])
    assert torch.equal(batched, by_four)
    assert not torch.equal(batched[4:8], batched[:4])  # (different rows: a real comparison)


@needs_kernel
@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
@pytest.mark.parametrize("M", [1, 16, 17, 64, 65, 90])
def test_linear_gguf_picks_the_kernel_then_chunks(M, quantization, monkeypatch):
    """Up to QGEMV_WO_MAX_M (gguf) / QGEMV_MAX_M (gguf_int8) tokens the layer runs qlinear (bit
    for bit); above, dequantized chunks of rows (several here: a 4 KiB chunk size, with N not a
    multiple of the chunk) through F.linear with the kernel's numbers (int8: on the int8-rounded
    activations) up to float32 order; never a full dequantized weight kept."""
    int8 = quantization == "gguf_int8"
    if not int8 and not Q.weight_only_available():
        pytest.skip("needs AVX512_BF16")
    monkeypatch.setattr(L, "QCHUNK_BYTES", 4096)
    monkeypatch.setattr(L, "_scratch", {})
    n, k = 37, 64
    w = random_weight("Q4_1", n, k)
    g = torch.Generator().manual_seed(M)  # (seeded: the bf16 paths differ by an ulp, and a draw can cancel to ~0)
    b = torch.randn(n, generator=g)
    layer = Linear([w], b, quantization=quantization)
    assert layer.weight is None and layer.is_quantized and layer.backend == "qgemv+chunked"
    assert layer.int8_activations == int8 and layer._gemv_max_m == (L.QGEMV_MAX_M if int8 else L.QGEMV_WO_MAX_M)
    assert layer.weight_nbytes == Q.pack_gguf([w]).nbytes
    x = torch.randn(2, M // 2 + 1, k, generator=g)[:, : M // 2 + M % 2] if M > 1 else torch.randn(1, k, generator=g)
    y = layer(x)
    assert y.shape == (*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    kernel = Q.qlinear(x2, layer.qpacked, layer.bias_f32, int8=int8)
    if x2.shape[0] <= layer._gemv_max_m:
        assert torch.equal(y.reshape(-1, n), kernel)
    else:
        torch.testing.assert_close(y.reshape(-1, n), kernel, rtol=1e-5, atol=1e-5)
        yb = layer(x.bfloat16())
        assert yb.dtype == torch.bfloat16
        # (bf16 chunks round the product, then add the bias in bf16: two roundings at the bias's
        # magnitude, ~2-3 here, whose bf16 ulp is 2^-7 = 0.0078; the kernel rounds once)
        torch.testing.assert_close(yb, Q.qlinear(x2.bfloat16(), layer.qpacked, layer.bias_f32, int8=int8).view(
            yb.shape), rtol=1e-2, atol=2.5e-2)
    assert all(t.numel() * t.element_size() <= 4096 for t in L._scratch.values())


def test_linear_gguf_with_a_float_weight_is_plain():
    w = torch.randn(8, 32)
    layer = Linear(w, quantization="gguf")
    assert layer.qpacked is None and not layer.is_quantized
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, w))


@needs_kernel
def test_column_parallel_shards_keep_whole_rows():
    H, hd, heads, kv = 64, 8, 4, 2
    q, k, v = (random_weight("Q4_0", r, H, s) for s, r in enumerate([heads * hd, kv * hd, kv * hd]))
    for rank in (0, 1):
        layer = QKVParallelLinear(H, hd, heads, kv, quantization="gguf", tp_rank=rank, tp_size=2)
        layer.weight_loader([q, k, v])
        want = torch.cat([t.dequantize()[rank * n:(rank + 1) * n] for t, n in zip((q, k, v), (16, 8, 8))])
        assert layer.qpacked is not None and torch.equal(Q.dequantize_packed(layer.qpacked), want)
        gu = [random_weight("Q8_0", 24, H, 5), random_weight("Q8_0", 24, H, 6)]
        m = MergedColumnParallelLinear(H, [24, 24], quantization="gguf", tp_rank=rank, tp_size=2)
        m.weight_loader(gu)
        want = torch.cat([t.dequantize()[rank * 12:(rank + 1) * 12] for t in gu])
        assert torch.equal(Q.dequantize_packed(m.qpacked), want)
        x = torch.randn(2, H)
        torch.testing.assert_close(m(x), Q.qlinear(x, m.qpacked, int8=False))  # (no collective: its slice)


@needs_kernel
def test_row_parallel_shards_cut_whole_blocks_else_dequantize(caplog):
    w = random_weight("Q4_1", 16, 128)
    for rank in (0, 1):
        layer = RowParallelLinear(128, 16, quantization="gguf", tp_rank=rank, tp_size=2)  # 64 columns: 2 blocks
        layer.weight_loader(w)
        assert torch.equal(Q.dequantize_packed(layer.qpacked), w.dequantize()[:, rank * 64:(rank + 1) * 64])
    wk = random_weight("Q4_K", 16, 512)
    with caplog.at_level("INFO", logger="kvserve.worker.layers.parallel_linear"):
        layer = RowParallelLinear(512, 16, quantization="gguf", tp_rank=1, tp_size=4)  # 128 columns: half a block
        layer.weight_loader(wk)
    assert layer.qpacked is None and torch.equal(layer.weight, wk.dequantize()[:, 128:256])
    assert "cuts Q4_K's blocks of 256 values: this layer is dequantized" in caplog.text
    plain = ColumnParallelLinear(64, 16, quantization=None, tp_rank=0, tp_size=1)  # not asked: dequantized
    plain.weight_loader(random_weight("Q8_0", 16, 64))
    assert plain.qpacked is None and plain.weight.dtype == torch.float32


@needs_kernel
def test_row_parallel_q6_k_shards_keep_the_per_16_scales():
    w = random_weight("Q6_K", 8, 512)
    for rank in (0, 1):
        layer = RowParallelLinear(512, 8, quantization="gguf", tp_rank=rank, tp_size=2)  # one super-block each
        layer.weight_loader(w)
        assert layer.qpacked.sub == 16
        assert torch.equal(Q.dequantize_packed(layer.qpacked), w.dequantize()[:, rank * 256:(rank + 1) * 256])


@needs_kernel
def test_quantized_embedding_and_tied_head_share_one_table():
    V, H = 50, 64
    w = random_weight("Q8_0", V, H)
    emb = VocabParallelEmbedding(V, H, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    emb.weight_loader(w)
    assert emb.weight is None and emb.qpacked is not None
    ids = torch.tensor([3, 49, 0, 3])
    assert torch.equal(emb(ids), w.dequantize()[ids].bfloat16())
    head = ParallelLMHead(V, H, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    head.tie_weights(emb)
    assert head.qpacked is emb.qpacked
    h = torch.randn(2, H)
    assert torch.equal(head(h), Q.qlinear(h, emb.qpacked, int8=False))
    emb2 = VocabParallelEmbedding(V, H, dtype=torch.float32, tp_rank=0, tp_size=2)  # TP: dequantized shard
    emb2.weight_loader(w)
    assert emb2.qpacked is None and torch.equal(emb2.weight, w.dequantize()[:25])


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match=r"qtype must be one of .*'Q4_0'.*got 'Q5_1'"):
        Q.GGUFWeight("Q5_1", torch.zeros(1, 24, dtype=torch.uint8), (1, 32))
    with pytest.raises(ValueError, match="K=48 is not a multiple of Q4_0's block of 32"):
        Q.GGUFWeight("Q4_0", torch.zeros(1, 27, dtype=torch.uint8), (1, 48))
    with pytest.raises(ValueError, match=r"data must be uint8 \[2, 36\]"):
        Q.GGUFWeight("Q4_0", torch.zeros(2, 18, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match=r"columns \[16, 48\) cut Q4_1's blocks of 32"):
        random_weight("Q4_1", 2, 64).narrow_cols(16, 32)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 5"):
        Q.pack(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(4, 1), 5)
    with pytest.raises(ValueError, match="4-bit values must be < 16"):
        Q.pack(torch.full((4, 32), 16, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(4, 1), 4)
    with pytest.raises(ValueError, match="parts have different K"):
        Q.pack_gguf([random_weight("Q4_0", 4, 32), random_weight("Q4_0", 4, 64)])
    with pytest.raises(ValueError, match=r"rows \[8, 12\) outside \[0, 10\)"):
        Q.dequantize_rows(Q.pack_gguf([random_weight("Q8_0", 10, 32)]), 8, 4, torch.float32)
    if HAS_KERNEL:
        with pytest.raises(ValueError, match=r"x must be \[M, 64\] float32 or bfloat16, got \(2, 32\)"):
            Q.qlinear(torch.randn(2, 32), Q.pack_gguf([random_weight("Q8_0", 4, 64)]))
