"""kvserve.kernels.cpu_ops.probe_colsum (``kv_probe_colsum`` in csrc/cpu/cpu_ops.c): column sums of
softmax attention probabilities, the scores H2O and SnapKV rank keys by, against the exact masked
softmax in float64 (GQA groups 1-16, head_dim 32 / 64 / 128, empty sources and ranges, rows that
see no key, F's columns at an offset); its argument checks and op; and the engine's probes
(``attention.record_kv_probes``) on the kernel against its PyTorch path on the same inputs, for a
bf16 model with a bf16 and an int4 KV cache, under H2O and SnapKV."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops
from kvserve.worker import attention as attention_mod

pytestmark = pytest.mark.skipif(not cpu_ops.probe_colsum_supported(torch.bfloat16, 4, 2, 64),
                                reason="probe_colsum needs the AVX512-BF16 kernels")


def _reference(q, kd, kf, ranges, scale, num_cols, f_offset):
    """float64: per token, softmax over D's keys [0, r0) and F's keys [r1, r2), summed per KV head
    into D's key j at column j and F's key j at column f_offset + j."""
    n, H, hd = q.shape
    KVH = kd.shape[1]
    G = H // KVH
    k = torch.cat([kd, kf]).double().repeat_interleave(G, 1)
    Ld = kd.shape[0]
    j = torch.arange(k.shape[0])[None]
    seen = (j < ranges[:, :1]) | ((j >= Ld + ranges[:, 1:2]) & (j < Ld + ranges[:, 2:3]))
    s = torch.einsum("nhd,jhd->hnj", q.double(), k) * scale
    p = torch.softmax(s.masked_fill(~seen[None], float("-inf")), -1).nan_to_num(0.0)  # [H, n, Ld + Lf]
    per_kv = p.sum(1).view(KVH, G, -1).sum(1)  # [KVH, Ld + Lf]
    out = torch.zeros(KVH, num_cols, dtype=torch.float64)
    out[:, :Ld] += per_kv[:, :Ld]
    out[:, f_offset : f_offset + kf.shape[0]] += per_kv[:, Ld:]
    return out


def _case(n, H, KVH, hd, Ld, Lf, seed):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: (torch.randn(*s, generator=g) * 2).bfloat16()  # noqa: E731
    q, kd, kf = bf(n, H, hd), bf(Ld, KVH, hd), bf(Lf, KVH, hd)
    r0 = torch.randint(0, Ld + 1, (n,), generator=g)
    r1 = torch.randint(0, Lf + 1, (n,), generator=g)
    r2 = torch.maximum(r1, torch.randint(0, Lf + 1, (n,), generator=g))
    return q, kd, kf, torch.stack([r0, r1, r2], 1).contiguous()


@pytest.mark.parametrize("n,H,KVH,hd,Ld,Lf,f_offset", [
    (37, 9, 3, 64, 300, 50, 280),  # SmolLM2's heads; F overlapping D's last columns (a query's own block)
    (5, 4, 4, 128, 0, 20, 3),      # no D
    (70, 8, 1, 32, 129, 0, 0),     # no F, GQA group 8
    (16, 16, 1, 64, 1000, 16, 990),  # group 16
    (1, 9, 3, 64, 2049, 7, 2048),  # a decode row over a long context (keys read unpacked: <= 16 rows)
    (4, 8, 2, 64, 300, 40, 270),   # 16 rows: still unpacked, with F ranges
    (33, 4, 2, 64, 64, 64, 64),    # sources exactly one key block, F after D
])
def test_matches_the_exact_masked_softmax(n, H, KVH, hd, Ld, Lf, f_offset):
    q, kd, kf, ranges = _case(n, H, KVH, hd, Ld, Lf, seed=n + Ld)
    if n > 2:
        ranges[0] = torch.tensor([0, 0, 0])  # a token that sees no key adds nothing
        ranges[1] = torch.tensor([min(Ld, 1), Lf, Lf])
    cols = max(Ld, f_offset + Lf) + 3
    got = cpu_ops.probe_colsum(q, kd, kf, ranges, hd ** -0.5, cols, f_offset)
    ref = _reference(q, kd, kf, ranges, hd ** -0.5, cols, f_offset)
    assert got.dtype == torch.float32 and got.shape == (KVH, cols)
    assert torch.equal(got, cpu_ops.probe_colsum(q, kd, kf, ranges, hd ** -0.5, cols, f_offset))  # deterministic
    # float32 scores, exp and sums: relative error ~1e-6 of a probability, summed over <= n * G rows
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)
    seen_rows = ((ranges[:, 0] > 0) | (ranges[:, 2] > ranges[:, 1])).sum().item()
    assert abs(got.sum().item() - seen_rows * H) <= 1e-4 * max(seen_rows * H, 1)  # each row's softmax sums to 1


def test_a_key_seen_through_either_source_scores_the_same():
    """The same keys offered as D's prefix or as F's range put the same probability in each column."""
    q, kd, _, _ = _case(20, 9, 3, 64, 200, 0, seed=7)
    empty = kd[:0]
    via_d = cpu_ops.probe_colsum(q, kd, empty, torch.tensor([[200, 0, 0]] * 20), 0.125, 200)
    via_f = cpu_ops.probe_colsum(q, empty, kd, torch.tensor([[0, 0, 200]] * 20), 0.125, 200, 0)
    split = cpu_ops.probe_colsum(q, kd[:150].contiguous(), kd[150:].contiguous(), torch.tensor([[150, 0, 50]] * 20),
                                 0.125, 200, 150)
    assert torch.equal(via_d, via_f)
    torch.testing.assert_close(split, via_d, rtol=1e-5, atol=1e-7)


def test_bad_arguments_name_the_field():
    q, kd, kf, ranges = _case(8, 4, 2, 64, 40, 10, seed=1)
    bad = ranges.clone()
    bad[3, 0] = 41
    with pytest.raises(ValueError, match=r"ranges must lie in \[0, 40\]"):
        cpu_ops.probe_colsum(q, kd, kf, bad, 0.125, 50, 40)
    with pytest.raises(ValueError, match=r"ranges must be contiguous int64 \[8, 3\]"):
        cpu_ops.probe_colsum(q, kd, kf, ranges.int(), 0.125, 50, 40)
    with pytest.raises(ValueError, match="k_f must be contiguous bf16"):
        cpu_ops.probe_colsum(q, kd, kf.float(), ranges, 0.125, 50, 40)
    with pytest.raises(ValueError, match="unsupported here"):
        cpu_ops.probe_colsum(q.float(), kd, kf, ranges, 0.125, 50, 40)
    with pytest.raises(ValueError, match=r"num_cols must be >= 40 \(Ld\) and >= f_offset \+ 10"):
        cpu_ops.probe_colsum(q, kd, kf, ranges, 0.125, 45, 40)
    with pytest.raises(ValueError, match="num_cols"):
        cpu_ops.probe_colsum(q, kd, kf, ranges, 0.125, 50, -1)
    assert not cpu_ops.probe_colsum_supported(torch.bfloat16, 4, 2, 48)  # head_dim % 32
    assert not cpu_ops.probe_colsum_supported(torch.float32, 4, 2, 64)


def test_the_registered_op_runs_the_kernel():
    """``torch.ops.kvserve.probe_colsum`` (opcheck: schema, fake, AOT dispatch) returns what the
    function returns."""
    q, kd, kf, ranges = _case(9, 4, 2, 64, 70, 20, seed=2)
    got = torch.ops.kvserve.probe_colsum(q, kd, kf, ranges, 0.125, 80, 60)
    assert torch.equal(got, cpu_ops.probe_colsum(q, kd, kf, ranges, 0.125, 80, 60))
    torch.library.opcheck(torch.ops.kvserve.probe_colsum, (q, kd, kf, ranges, 0.125, 80, 60),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_engine_probes_on_the_kernel_match_pytorch(tiny_model_dir, kv, monkeypatch):
    """bf16 tiny Qwen3 (head_dim 32, block 16), H2O and SnapKV requests batched, prompts prefilled in
    chunks of 13 tokens: every layer's probe scores from the kernel equal the PyTorch path's on the
    same queries and pools (a 2-/4-bit pool: each query's own block in the model dtype unless it sits
    at the block's last slot), and the kernel ran for every probe."""
    real = attention_mod.record_kv_probes
    kernel = cpu_ops.probe_colsum
    calls, compared = [], []
    monkeypatch.setattr(cpu_ops, "probe_colsum", lambda *a, **k: calls.append(1) or kernel(*a, **k))

    def both(q, k_cache, meta, scale, k=None):
        n = len(calls)
        real(q, k_cache, meta, scale, k=k)
        got = meta.derived["kv_probe"].pop()
        assert len(calls) - n == len(meta.kv_probes)
        with monkeypatch.context() as m:
            m.setattr(cpu_ops, "probe_colsum_supported", lambda *a: False)
            real(q, k_cache, meta, scale, k=k)
        for g, r in zip(got, meta.derived["kv_probe"][-1]):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
            compared.append(g.shape[-1])

    monkeypatch.setattr(attention_mod, "record_kv_probes", both)
    llm = LLM(model=str(tiny_model_dir("qwen3")[0]), dtype="bfloat16", kv_cache_dtype=kv, block_size=16,
              num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=13,
              device="cpu")  # (the CPU kernel)
    base = llm.engine.encode("The grass is green. The sky is blue. " * 12)
    policies = [{"method": "h2o", "budget": 40, "recent": 8},
                {"method": "snapkv", "budget": 40, "observation_window": 8, "kernel_size": 3}]
    outs = llm.generate([base[:70], base[:90]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                kv_compression=p) for p in policies])
    assert all(len(o.token_ids) == 30 for o in outs)
    assert len(compared) > 50 and max(compared) >= 70
    llm.engine.shutdown()
