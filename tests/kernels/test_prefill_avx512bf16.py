"""The AVX512-BF16 prefill attention kernel (``prefill_dp`` in csrc/cpu/cpu_ops.c, reached through
kvserve.kernels.cpu_ops.paged_attention_prefill on CPUs with AVX512_BF16 and without AMX) against
float32 SDPA on the gathered K/V.

On an AMX machine the tests switch AMX off (``set_amx(False)``) so that they run this kernel and
not the AMX one. Tolerance: the kernel rounds the probabilities to bf16 for P·V (relative error
<= 2^-9 each) and its output to bf16 (<= 2^-9 relative); both are well inside atol = rtol = 1e-2
on outputs of magnitude ~0.1-1, and the mean error is checked separately (< 2e-3), so that a
systematic error (a wrong mask lane, a missed rescale) cannot hide under the elementwise bound.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops as K

pytestmark = pytest.mark.skipif(not K.available(), reason="CPU kernels need x86-64 AVX-512 and the install's build")


@pytest.fixture
def dp():
    """AMX off for the test (the AVX512-BF16 kernel is the one that runs); skip without it."""
    K.set_amx(False)
    try:
        if not K.avx512bf16_prefill_supported(torch.bfloat16, 9, 3, 64, 16):
            pytest.skip("needs the cpu_ops_avx512bf16 library on a CPU with AVX512_BF16")
        yield
    finally:
        K.set_amx(True)


def _run(H, KVH, hd, bs, chunks, seed, op=False, nan_unused=True):
    """The kernel on prefill chunks ``[(tokens, num_past), ...]`` whose K/V lie in randomly
    permuted blocks of the pools (slots no chunk covers hold NaN), against causal float32 SDPA per
    chunk; q rows are strided (a slice of a qkv matrix, as in the model)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil((n + past) / bs) for n, past in chunks)
    nb = need + 7
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n, past in chunks:
        tables.append(perm[i : i + math.ceil((n + past) / bs)])
        i += len(tables[-1])
    kc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
    vc = torch.randn(nb, bs, KVH, hd, generator=g).bfloat16()
    if nan_unused:
        used = torch.zeros(nb * bs, dtype=torch.bool)
        for t, (n, past) in zip(tables, chunks):
            used[torch.tensor([t[j // bs] * bs + j % bs for j in range(n + past)])] = True
        kc.view(nb * bs, -1)[~used] = float("nan")
        vc.view(nb * bs, -1)[~used] = float("nan")
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    T = sum(n for n, _ in chunks)
    qkv = torch.randn(T, (H + 2 * KVH) * hd, generator=g).bfloat16()
    q = qkv[:, : H * hd].view(T, H, hd)
    starts = [sum(n for n, _ in chunks[:p]) for p in range(len(chunks))]
    info = torch.tensor([[s, n, past] for s, (n, past) in zip(starts, chunks)])
    out = torch.full((T, H, hd), float("nan"), dtype=torch.bfloat16)
    scale = hd**-0.5
    if op:
        torch.ops.kvserve.paged_attention_prefill(q, kc, vc, bt, info, scale, out)
    else:
        K.paged_attention_prefill(q, kc, vc, bt, info, scale, out)
    refs = []
    for p, (s, (n, past)) in enumerate(zip(starts, chunks)):
        L = n + past
        slots = torch.tensor([tables[p][j // bs] * bs + j % bs for j in range(L)])
        k = kc.view(-1, KVH, hd)[slots].transpose(0, 1).float()
        v = vc.view(-1, KVH, hd)[slots].transpose(0, 1).float()
        mask = torch.arange(L).unsqueeze(0) <= (past + torch.arange(n)).unsqueeze(1)
        refs.append(F.scaled_dot_product_attention(q[s : s + n].float().transpose(0, 1), k, v, attn_mask=mask,
                                                   scale=scale, enable_gqa=True).transpose(0, 1))
    e = torch.cat(refs)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), e, rtol=1e-2, atol=1e-2)
    assert (out.float() - e).abs().mean() < 2e-3
    return out


#: (tokens, num_past) per chunk: no past, partial-block past, many blocks of past, one token,
#: lengths on and off the 16-token / 64-key tile sizes, a past that is a whole key block
MIXED = [(7, 0), (20, 5), (33, 0), (1, 17), (64, 60), (130, 0), (45, 203), (17, 64), (2, 1)]


@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (4, 4, 64, 16), (8, 2, 128, 32), (16, 4, 64, 8),
                                         (3, 3, 128, 16), (4, 1, 256, 16), (4, 2, 32, 5), (40, 1, 64, 16)])
def test_prefill_dp_mixed_chunks_match_sdpa(dp, H, KVH, hd, bs):
    """Several chunks of different lengths and cached prefixes in one call; G = 1, 3, 4, 40;
    head_dim 32, 64, 128, 256; block sizes 5 (odd), 8, 16, 32; non-contiguous block tables."""
    _run(H, KVH, hd, bs, MIXED, seed=H * hd + bs)


@pytest.mark.parametrize("n,past", [(256, 0), (100, 0), (1, 0), (77, 300)])
def test_prefill_dp_one_chunk_matches_sdpa(dp, n, past):
    """One chunk alone (SmolLM2's shape), with and without cached context."""
    _run(9, 3, 64, 16, [(n, past)], seed=n + past)


def test_prefill_dp_via_torch_op_and_large_scores(dp):
    """Through the registered op (torch.ops.kvserve.paged_attention_prefill); then queries
    scaled x8 (scores up to ~±60 before the softmax scale: the running max moves a lot between
    key blocks, so the online rescaling carries most of the result)."""
    _run(9, 3, 64, 16, [(40, 90), (70, 0)], seed=5, op=True)
    g = torch.Generator().manual_seed(3)
    bs, KVH, H, hd, n, past = 16, 1, 2, 64, 150, 150
    L = n + past
    kc = torch.randn(L // bs + 1, bs, KVH, hd, generator=g).bfloat16()
    # keys grow along the sequence, so each key block raises the max
    kc = (kc.float() * torch.linspace(0.2, 3, (L // bs + 1) * bs).view(-1, bs, 1, 1)).bfloat16()
    vc = torch.randn(L // bs + 1, bs, KVH, hd, generator=g).bfloat16()
    q = (torch.randn(n, H, hd, generator=g) * 3).bfloat16()
    bt = torch.arange(L // bs + 1).unsqueeze(0)
    out = torch.empty(n, H, hd, dtype=torch.bfloat16)
    K.paged_attention_prefill(q, kc, vc, bt, torch.tensor([[0, n, past]]), hd**-0.5, out)
    k = kc.view(-1, KVH, hd)[:L].transpose(0, 1).float()
    v = vc.view(-1, KVH, hd)[:L].transpose(0, 1).float()
    mask = torch.arange(L).unsqueeze(0) <= (past + torch.arange(n)).unsqueeze(1)
    e = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=hd**-0.5,
                                       enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out.float(), e, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_prefill_dp_on_8bit_pools_matches_sdpa_on_dequantized(dp, kv_dtype):
    """8-bit pools: the chunks' contexts are dequantized to bf16 first, then this kernel runs."""
    from kvserve.worker import kv_quant

    H, KVH, hd, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(11)
    chunks = [(20, 5), (64, 60), (33, 0)]
    nb = 24
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n, past in chunks:
        tables.append(perm[i : i + math.ceil((n + past) / bs)])
        i += len(tables[-1])
    pools = []
    for _ in range(2):
        x = torch.randn(nb * bs, KVH, hd, generator=g) * torch.rand(nb * bs, KVH, 1, generator=g) * 4
        pools.append(kv_quant.quantize(x, kv_dtype).view(nb, bs, KVH, hd + 4))
    kc, vc = pools
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    T = sum(n for n, _ in chunks)
    q = torch.randn(T, H, hd, generator=g).bfloat16()
    starts = [0, 20, 84]
    out = torch.full((T, H, hd), float("nan"), dtype=torch.bfloat16)
    K.paged_attention_prefill(q, kc, vc, bt, torch.tensor([[s, n, p] for s, (n, p) in zip(starts, chunks)]),
                              hd**-0.5, out)
    for p, (s, (n, past)) in enumerate(zip(starts, chunks)):
        L = n + past
        slots = torch.tensor([tables[p][j // bs] * bs + j % bs for j in range(L)])
        k = kv_quant.gather(kc, slots, torch.bfloat16).transpose(0, 1).float()
        v = kv_quant.gather(vc, slots, torch.bfloat16).transpose(0, 1).float()
        mask = torch.arange(L).unsqueeze(0) <= (past + torch.arange(n)).unsqueeze(1)
        e = F.scaled_dot_product_attention(q[s : s + n].float().transpose(0, 1), k, v, attn_mask=mask,
                                           scale=hd**-0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[s : s + n].float(), e, rtol=1e-2, atol=1e-2)


def test_prefill_support_checks_name_the_limits(dp):
    """What the kernel cannot run: float32, head_dim not a multiple of 32 or above 256, a GQA
    group above 64; bf16 dot products switched off (set_bf16_dot(False)) leaves it to SDPA."""
    assert K.prefill_supported(torch.bfloat16, 9, 3, 64, 16)
    assert not K.amx_prefill_supported(torch.bfloat16, 9, 3, 64, 16)
    assert not K.avx512bf16_prefill_supported(torch.float32, 9, 3, 64, 16)
    assert not K.avx512bf16_prefill_supported(torch.bfloat16, 4, 2, 80, 16)
    assert not K.avx512bf16_prefill_supported(torch.bfloat16, 4, 2, 288, 16)
    assert K.avx512bf16_prefill_supported(torch.bfloat16, 64, 1, 64, 16)
    assert not K.avx512bf16_prefill_supported(torch.bfloat16, 65, 1, 64, 16)
    q = torch.randn(4, 4, 80).bfloat16()
    kc = torch.randn(2, 16, 2, 80).bfloat16()
    with pytest.raises(ValueError, match="head_dim 80"):
        K.paged_attention_prefill(q, kc, kc, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[0, 4, 0]]), 0.1,
                                  torch.empty_like(q))
    K.set_bf16_dot(False)
    try:
        assert not K.prefill_supported(torch.bfloat16, 9, 3, 64, 16)
    finally:
        K.set_bf16_dot(True)
