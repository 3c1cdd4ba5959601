"""kvserve.kernels.cpu_ops.prefill_ranges (``kv_prefill_ranges`` in csrc/cpu/cpu_ops.c): attention of
query tokens over two key/value sources with a key range per token, the kernel the 2-/4-bit KV
caches' prefill runs on, against the exact masked softmax in float64 (GQA groups 1-16, head_dim 32 /
64 / 128, empty sources and ranges, rows that see no key); its argument checks."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.prefill_ranges_supported(torch.bfloat16, 4, 2, 64),
                                reason="prefill_ranges needs the AVX512-BF16 kernels")


def _reference(q, kd, vd, kf, vf, ranges, scale):
    """float64 softmax over D's keys [0, r0) and F's keys [r1, r2) of each token (zeros if none)."""
    n, H, hd = q.shape
    G = H // kd.shape[1]
    k = torch.cat([kd, kf]).double().repeat_interleave(G, 1)
    v = torch.cat([vd, vf]).double().repeat_interleave(G, 1)
    Ld = kd.shape[0]
    j = torch.arange(k.shape[0])[None]
    seen = (j < ranges[:, :1]) | ((j >= Ld + ranges[:, 1:2]) & (j < Ld + ranges[:, 2:3]))
    s = torch.einsum("nhd,jhd->hnj", q.double(), k) * scale
    p = torch.softmax(s.masked_fill(~seen[None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnj,jhd->nhd", p, v)


def _case(n, H, KVH, hd, Ld, Lf, seed):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: (torch.randn(*s, generator=g) * 2).bfloat16()  # noqa: E731
    q, kd, vd, kf, vf = bf(n, H, hd), bf(Ld, KVH, hd), bf(Ld, KVH, hd), bf(Lf, KVH, hd), bf(Lf, KVH, hd)
    r0 = torch.randint(0, Ld + 1, (n,), generator=g)
    r1 = torch.randint(0, Lf + 1, (n,), generator=g)
    r2 = torch.maximum(r1, torch.randint(0, Lf + 1, (n,), generator=g))
    ranges = torch.stack([r0, r1, r2], 1).contiguous()
    return q, kd, vd, kf, vf, ranges


@pytest.mark.parametrize("n,H,KVH,hd,Ld,Lf", [
    (37, 9, 3, 64, 300, 50),    # SmolLM2's heads; D over several 64-key blocks, F a few
    (5, 4, 4, 128, 0, 20),      # no D
    (70, 8, 1, 32, 129, 0),     # no F, GQA group 8 (8 tokens a work item)
    (16, 16, 1, 64, 1000, 16),  # group 16 (4 tokens a work item)
    (33, 4, 2, 64, 64, 64),     # sources exactly one key block
])
def test_matches_the_exact_masked_softmax(n, H, KVH, hd, Ld, Lf):
    q, kd, vd, kf, vf, ranges = _case(n, H, KVH, hd, Ld, Lf, seed=n + Ld)
    ranges[0] = torch.tensor([0, 0, 0])  # a token that sees no key: zeros
    ranges[1] = torch.tensor([min(Ld, 1), Lf, Lf])
    got = cpu_ops.prefill_ranges(q, kd, vd, kf, vf, ranges, hd ** -0.5).double()
    ref = _reference(q, kd, vd, kf, vf, ranges, hd ** -0.5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    # bf16 probabilities in P.V (relative error 2^-9 each) and a bf16 output: within 2^-7 of the
    # largest |v| (measured up to 0.0015 x max|v| on these cases)
    vmax = max(vd.abs().max().item() if Ld else 0.0, vf.abs().max().item() if Lf else 0.0)
    err = (got - ref).abs().max().item()
    assert err <= 2 ** -7 * vmax, (err, vmax)


def test_a_key_seen_through_either_source_gives_the_same_output():
    """The same keys offered as D's prefix or as F's range: one softmax over them either way (so the
    split between the sources moves no probability mass)."""
    q, kd, vd, _, _, _ = _case(20, 9, 3, 64, 200, 0, seed=7)
    empty = kd[:0]
    via_d = cpu_ops.prefill_ranges(q, kd, vd, empty, empty, torch.tensor([[200, 0, 0]] * 20), 0.125)
    via_f = cpu_ops.prefill_ranges(q, empty, empty, kd, vd, torch.tensor([[0, 0, 200]] * 20), 0.125)
    split = cpu_ops.prefill_ranges(q, kd[:150].contiguous(), vd[:150].contiguous(), kd, vd,
                                   torch.tensor([[150, 150, 200]] * 20), 0.125)
    assert torch.equal(via_d, via_f)
    assert (split.float() - via_d.float()).abs().max().item() <= 2 ** -7 * vd.abs().max().item()
    ref = _reference(q, kd, vd, empty, empty, torch.tensor([[200, 0, 0]] * 20), 0.125)
    assert (via_d.double() - ref).abs().max().item() <= 2 ** -7 * vd.abs().max().item()


def test_bad_arguments_name_the_field():
    q, kd, vd, kf, vf, ranges = _case(8, 4, 2, 64, 40, 10, seed=1)
    bad = ranges.clone()
    bad[3, 0] = 41
    with pytest.raises(ValueError, match=r"ranges must lie in \[0, 40\]"):
        cpu_ops.prefill_ranges(q, kd, vd, kf, vf, bad, 0.125)
    bad = ranges.clone()
    bad[2, 2] = 11
    with pytest.raises(ValueError, match="ranges"):
        cpu_ops.prefill_ranges(q, kd, vd, kf, vf, bad, 0.125)
    with pytest.raises(ValueError, match=r"ranges must be contiguous int64 \[8, 3\]"):
        cpu_ops.prefill_ranges(q, kd, vd, kf, vf, ranges.int(), 0.125)
    with pytest.raises(ValueError, match="k_f must be contiguous bf16"):
        cpu_ops.prefill_ranges(q, kd, vd, kf.float(), vf, ranges, 0.125)
    with pytest.raises(ValueError, match="unsupported here"):
        cpu_ops.prefill_ranges(q.float(), kd, vd, kf, vf, ranges, 0.125)
    with pytest.raises(ValueError, match="out must be bf16"):
        cpu_ops.prefill_ranges(q, kd, vd, kf, vf, ranges, 0.125, out=torch.empty(8, 4, 32, dtype=torch.bfloat16))
    assert not cpu_ops.prefill_ranges_supported(torch.bfloat16, 4, 2, 48)  # head_dim % 32
    assert not cpu_ops.prefill_ranges_supported(torch.bfloat16, 5, 2, 64)  # heads % kv heads


def test_the_registered_op_runs_the_kernel():
    """``torch.ops.kvserve.prefill_ranges`` (opcheck: schema, fake, AOT dispatch) writes what the
    function returns."""
    q, kd, vd, kf, vf, ranges = _case(9, 4, 2, 64, 70, 20, seed=2)
    out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.kvserve.prefill_ranges(q, kd, vd, kf, vf, ranges, 0.125, out)
    assert torch.equal(out, cpu_ops.prefill_ranges(q, kd, vd, kf, vf, ranges, 0.125))
    torch.library.opcheck(torch.ops.kvserve.prefill_ranges, (q, kd, vd, kf, vf, ranges, 0.125, torch.empty_like(out)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
