"""The C decode kernel on 2-/4-bit pools (KIVI: kvserve.kernels.cpu_ops.paged_attention_decode_lowbit)
against the PyTorch reference path (kvserve.worker.kv_quant_lowbit.gather + SDPA, what
TorchSDPABackend.decode runs) on the same pools: several sequences of different lengths, each
with a partial last block in its residual slot (or a full one), GQA, bfloat16 and float32, int4
and int2, head_dim 64 / 128 / 48 (a short value group); sliding windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu_ops
from kvserve.worker import kv_quant_lowbit as lb

pytestmark = pytest.mark.skipif(not cpu_ops.lowbit_available(), reason="CPU kernels (2-/4-bit decode) not built")


def _pools(nb: int, bs: int, KVH: int, hd: int, bits: int, dtype: torch.dtype, lens: list[int], seed: int = 0):
    """Pools holding ``len(lens)`` sequences written token by token through the engine's write path
    (full blocks quantized, the partial last blocks in residual slots); returns the pools, the
    read map, block tables and context lengths."""
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = lb.allocate_pools(1, nb, bs, KVH, hd, bits, len(lens) + 2, dtype, "cpu")[0]
    rmap = torch.full((nb,), -1, dtype=torch.long)
    perm = torch.randperm(nb - 1, generator=g) + 1  # scattered blocks, block 0 never used
    tables, used, slot = [], 0, 0
    for L in lens:
        nblk = -(-L // bs)
        tables.append(perm[used : used + nblk].tolist())
        used += nblk
        if L % bs:
            rmap[tables[-1][-1]] = slot
            slot += 1
        x = torch.randn(L, 2, KVH, hd, generator=g) * torch.logspace(-1, 0.7, hd)
        x[:, 0, :, 5] += 8.0  # a key outlier channel
        pos = torch.arange(L)
        slots = torch.tensor(tables[-1])[pos // bs] * bs + pos % bs
        lb.write(k_pool, x[:, 0].to(dtype), slots, rmap)
        lb.write(v_pool, x[:, 1].to(dtype), slots, rmap)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return k_pool, v_pool, rmap, bt, torch.tensor(lens, dtype=torch.long)


def _reference(q, k_pool, v_pool, rmap, bt, ctx, scale):
    D, bs = q.shape[0], k_pool.block_size
    L = int(ctx.max())
    grid = torch.arange(L)
    slots = bt.gather(1, (grid // bs).expand(D, -1)) * bs + grid % bs
    valid = grid.unsqueeze(0) < ctx.unsqueeze(1)
    slots = torch.where(valid, slots, 0)
    kc = lb.gather(k_pool, slots, rmap, q.dtype).transpose(1, 2)
    vc = lb.gather(v_pool, slots, rmap, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=valid.view(D, 1, 1, L), scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,hd,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 48, 8)])
def test_decode_kernel_matches_the_reference_path(bits, dtype, H, KVH, hd, bs):
    lens = [1, bs, bs + 3, 5 * bs - 1, 7 * bs, 150]
    k_pool, v_pool, rmap, bt, ctx = _pools(96, bs, KVH, hd, bits, dtype, lens)
    q = torch.randn(len(lens), H, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = hd ** -0.5
    ref = _reference(q, k_pool, v_pool, rmap, bt, ctx, scale).float()
    got = cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, scale).float()
    # the same dequantized K/V (float32 math, one rounding to the model dtype); the attention's sums in
    # another order: float32 to ~1e-6 relative, bfloat16 to one bf16 ulp of the largest output
    # (2^-7 relative: outputs up to ~9 differ by at most 0.031 here)
    err = (got - ref).abs().max().item()
    amax = ref.abs().max().item()
    assert err <= (2e-6 if dtype == torch.float32 else 2**-7) * amax, (err, amax)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_split_along_the_keys_matches_the_reference_path(bits, dtype):
    """Contexts past 512 keys run in splits of whole blocks (dequantized split by split) merged by
    their softmax maxima and sums: 513, 1,100 and 1,300 keys (partial last blocks in residual slots)
    equal the reference path, and each sequence's output is bit for bit the same alone."""
    H, KVH, hd, bs = 9, 3, 64, 16
    lens = [30, 513, 1100, 1300]
    k_pool, v_pool, rmap, bt, ctx = _pools(sum(-(-n // bs) for n in lens) + 2, bs, KVH, hd, bits, dtype, lens, seed=3)
    q = torch.randn(len(lens), H, hd, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = hd ** -0.5
    ref = _reference(q, k_pool, v_pool, rmap, bt, ctx, scale).float()
    got = cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, scale)
    err = (got.float() - ref).abs().max().item()
    assert err <= (2e-6 if dtype == torch.float32 else 2**-7) * ref.abs().max().item(), err
    for d in range(len(lens)):
        alone = cpu_ops.paged_attention_decode_pools(q[d : d + 1], k_pool, v_pool, rmap, bt[d : d + 1].contiguous(),
                                                     ctx[d : d + 1], scale)
        assert torch.equal(alone[0], got[d]), d


def test_decode_kernel_reads_the_residual_for_partial_blocks_only():
    """A partial block's residual rows are read as they are (changing one changes the output); a full
    block's residual slot (the read map says -1) is never read."""
    k_pool, v_pool, rmap, bt, ctx = _pools(32, 16, 2, 64, 4, torch.float32, [20, 32])
    q = torch.randn(2, 4, 64)
    base = cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, 0.125)
    slot = int(rmap[bt[0, 1]])
    v_pool.residual[slot, 2] += 1.0  # row 18 of sequence 0 (partial block)
    after = cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, 0.125)
    assert not torch.equal(after[0], base[0]) and torch.equal(after[1], base[1])
    v_pool.residual[slot + 1 :] = 1e6  # unused slots: never read
    assert torch.equal(cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, 0.125), after)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_over_a_sliding_window_matches_the_reference_path(window, dtype):
    """Only the last ``window`` keys of each sequence attended; the blocks before the window's first
    one are never read (their table entries point at a block of NaN scales)."""
    bs, lens = 16, [1, 5, 16, 20, 47, 150]
    k_pool, v_pool, rmap, bt, ctx = _pools(64, bs, 3, 64, 4, dtype, lens)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = 0.125
    D, L = len(lens), int(ctx.max())
    grid = torch.arange(L)
    slots = bt.gather(1, (grid // bs).expand(D, -1)) * bs + grid % bs
    valid = (grid.unsqueeze(0) < ctx.unsqueeze(1)) & (grid.unsqueeze(0) >= ctx.unsqueeze(1) - window)
    slots = torch.where(valid, slots, 0)
    kc = lb.gather(k_pool, slots, rmap, dtype).transpose(1, 2)
    vc = lb.gather(v_pool, slots, rmap, dtype).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=valid.view(D, 1, 1, L), scale=scale,
                                         enable_gqa=True).squeeze(2).float()
    before = (ctx - window).clamp(min=0) // bs  # blocks wholly before each window
    for d in range(D):
        bt[d, : int(before[d])] = 0  # block 0: never written; make it poison
    k_pool.data[0].view(torch.uint8).fill_(0xFF)  # (NaN scales and zeros)
    v_pool.data[0].view(torch.uint8).fill_(0xFF)
    got = cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, scale, window=window).float()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= (2e-6 if dtype == torch.float32 else 2**-7) * ref.abs().max().item(), err
    with pytest.raises(ValueError, match="window must be ≥ 1"):
        cpu_ops.paged_attention_decode_pools(q, k_pool, v_pool, rmap, bt, ctx, scale, window=0)


def test_the_registered_op_runs_the_kernel():
    """``torch.ops.kvserve.paged_attention_decode_lowbit`` (opcheck: schema, fake, AOT dispatch) writes
    what the function returns."""
    k_pool, v_pool, rmap, bt, ctx = _pools(16, 16, 2, 64, 2, torch.float32, [20, 7])
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2))
    args = (q, k_pool.data, v_pool.data, k_pool.residual, v_pool.residual, rmap, bt, ctx, 0.125, 2)
    out = torch.empty_like(q)
    torch.ops.kvserve.paged_attention_decode_lowbit(*args, out)
    assert torch.equal(out, cpu_ops.paged_attention_decode_lowbit(*args))
    torch.library.opcheck(torch.ops.kvserve.paged_attention_decode_lowbit, (*args, torch.empty_like(q)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("is_key", [True, False])
@pytest.mark.parametrize("hd", [64, 48, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_dequantize_equals_the_pytorch_formula_bit_for_bit(bits, is_key, hd, dtype):
    """cpu_ops.lowbit_dequantize (what LowBitPool.dequantize, hence gather and the prefill path, runs
    on here) gives lb.dequantize_blocks' values exactly: blocks in any order and repeated, a short
    last value group (head_dim 48), outlier channels."""
    g = torch.Generator().manual_seed(bits * 100 + hd)
    x = torch.randn(20, 16, 3, hd, generator=g) * torch.logspace(-2, 1, hd)
    x[..., 3] += 25.0
    data = lb.quantize_blocks(x, bits, is_key)
    blocks = torch.tensor([3, 0, 19, 7, 7])
    ref = lb.dequantize_blocks(data.index_select(0, blocks), bits, is_key, 16, hd, dtype)
    got = cpu_ops.lowbit_dequantize(data, blocks, bits, is_key, 16, hd, dtype)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match=r"blocks must be in \[0, 20\)"):
        cpu_ops.lowbit_dequantize(data, torch.tensor([20]), bits, is_key, 16, hd, dtype)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("is_key", [True, False])
@pytest.mark.parametrize("hd", [64, 48, 128, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_quantize_equals_the_pytorch_formula_bit_for_bit(bits, is_key, hd, dtype):
    """cpu_ops.lowbit_quantize (what the KV write and compaction run on here, lb.quantize) gives
    lb.quantize_blocks' bytes exactly, on channels of magnitudes 1e-3 .. 1e2 and the edge cases of
    the parameters: constant blocks (scale 1), a channel beyond float16's range (the zero rounded
    down from inf to 65504), codes exactly halfway between two levels (round half to even), float16
    subnormal scales."""
    g = torch.Generator().manual_seed(bits * 1000 + hd)
    x = (torch.randn(12, 16, 3, hd, generator=g) * torch.logspace(-3, 2, hd)).to(dtype)
    x[0], x[1] = 0.0, 1.5
    x[2, :, :, 0] = 70000.0 if dtype == torch.float32 else 1e5
    x[3] = (torch.randint(-4, 5, x[3].shape, generator=g) * 0.5).to(dtype)
    x[4] *= 1e-7
    assert torch.equal(cpu_ops.lowbit_quantize(x, bits, is_key), lb.quantize_blocks(x, bits, is_key))
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        cpu_ops.lowbit_quantize(x, 3, is_key)


def test_the_quantize_and_dequantize_ops_run_the_kernels():
    """``torch.ops.kvserve.lowbit_quantize`` / ``lowbit_dequantize`` (opcheck: schema, fake, AOT
    dispatch) return what the functions return."""
    x = torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    data = torch.ops.kvserve.lowbit_quantize(x, 4, False)
    assert torch.equal(data, cpu_ops.lowbit_quantize(x, 4, False))
    blocks = torch.tensor([2, 0])
    deq = torch.ops.kvserve.lowbit_dequantize(data, blocks, 4, False, 16, 64, torch.bfloat16)
    assert torch.equal(deq, cpu_ops.lowbit_dequantize(data, blocks, 4, False, 16, 64, torch.bfloat16))
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.kvserve.lowbit_quantize, (x, 4, False), test_utils=utils)
    torch.library.opcheck(torch.ops.kvserve.lowbit_dequantize, (data, blocks, 4, False, 16, 64, torch.bfloat16),
                          test_utils=utils)
