"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) on 2 gloo ranks in spawned processes
(tests/tp_harness.py): each parallel layer against the whole layer, tiny models at TP = 2
against TP = 1 through chunked prefill and paged decode (float32, 1e-5), KV heads replicated
past num_kv_heads, and the clear errors."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.distributed import get_tp_rank, get_tp_world_size
from kvserve.worker.layers.linear import Linear
from kvserve.worker.layers.parallel_linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
from kvserve.worker.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, vocab_range
from tp_harness import local_generate, tp_generate

#: 19 + 4 tokens: past mistral_window's 16-token window and Gemma 3's 8
PROMPTS = [[5, 17, 99, 3, 250, 40, 41, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [300, 301], [77] * 7]


# ----------------------------------------------------------------------------- layers (rank jobs)

def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layer_case(case: str):
    """(this rank's output, the reference computed from the full layer) of one layer ``case``."""
    rank, ws = get_tp_rank(), get_tp_world_size()
    x = _rand(5, 16, seed=1)
    if case in ("column_gather", "column_local", "column_int8"):
        W, b = _rand(12, 16, seed=2), _rand(12, seed=3)
        q = "int8" if case == "column_int8" else None
        layer = ColumnParallelLinear(16, 12, bias=True, gather_output=case != "column_local", quantization=q)
        layer.weight_loader(W, b)
        ref = Linear(W, b, quantization=q)(x)
        return layer(x), ref if case != "column_local" else ref[:, rank * 12 // ws:(rank + 1) * 12 // ws]
    if case == "merged":
        G, U = _rand(8, 16, seed=2), _rand(8, 16, seed=3)
        layer = MergedColumnParallelLinear(16, [8, 8])
        layer.weight_loader([G, U])
        n = 8 // ws
        return layer(x), torch.cat([F.linear(x, G)[:, rank * n:(rank + 1) * n], F.linear(x, U)[:, rank * n:(rank + 1) * n]], -1)
    if case.startswith("qkv"):  # qkv_<heads>_<kv heads>, head_dim 4, with biases
        heads, kv = (int(c) for c in case.split("_")[1:])
        hd = 4
        Wq, Wk, Wv = _rand(heads * hd, 16, seed=2), _rand(kv * hd, 16, seed=3), _rand(kv * hd, 16, seed=4)
        bq, bk, bv = _rand(heads * hd, seed=5), _rand(kv * hd, seed=6), _rand(kv * hd, seed=7)
        layer = QKVParallelLinear(16, hd, heads, kv, bias=True)
        layer.weight_loader([Wq, Wk, Wv], [bq, bk, bv])
        h, k = layer.num_heads, layer.num_kv_heads
        kv_head = rank * k if layer.num_kv_head_replicas == 1 else rank // layer.num_kv_head_replicas
        q_ref = F.linear(x, Wq, bq)[:, rank * h * hd:(rank + 1) * h * hd]
        k_ref = F.linear(x, Wk, bk)[:, kv_head * hd:(kv_head + k) * hd]
        v_ref = F.linear(x, Wv, bv)[:, kv_head * hd:(kv_head + k) * hd]
        return layer(x), torch.cat([q_ref, k_ref, v_ref], -1)
    if case in ("row_parallel_input", "row_full_input", "row_int8", "row_bf16"):
        W, b = _rand(12, 16, seed=2), _rand(12, seed=3)
        dt = torch.bfloat16 if case == "row_bf16" else torch.float32
        layer = RowParallelLinear(16, 12, bias=True, input_is_parallel=case != "row_full_input", dtype=dt,
                                  quantization="int8" if case == "row_int8" else None)
        layer.weight_loader(W, b)
        k = 16 // ws
        xin = x if case == "row_full_input" else x[:, rank * k:(rank + 1) * k]
        return layer(xin.to(dt)).float(), F.linear(x, W, b)
    if case in ("embedding", "lm_head", "lm_head_dst0", "lm_head_tied"):
        V, H = 13, 8  # odd: the last rank holds a padding row
        E = _rand(V, H, seed=2)
        if case == "embedding":
            emb = VocabParallelEmbedding(V, H, dtype=torch.float32)
            emb.weight_loader(E)
            ids = torch.tensor([[0, 6, 7, 12], [12, 3, 9, 1]])
            return emb(ids), F.embedding(ids, E)
        head = ParallelLMHead(V, H, gather_dst=0 if case == "lm_head_dst0" else None)
        if case == "lm_head_tied":
            emb = VocabParallelEmbedding(V, H, dtype=torch.float32)
            emb.weight_loader(E)
            head.tie_weights(emb)
            assert head.weight.data_ptr() == emb.weight.data_ptr()  # shared, not copied
        else:
            head.weight_loader(E)
        h = _rand(3, H, seed=4)
        return head(h), F.linear(h, E)
    raise ValueError(case)


LAYER_CASES = ["column_gather", "column_local", "column_int8", "merged", "qkv_4_2", "qkv_4_1", "qkv_8_2",
               "row_parallel_input", "row_full_input", "row_int8", "row_bf16", "embedding", "lm_head",
               "lm_head_dst0", "lm_head_tied"]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_parallel_layer_matches_the_whole_layer(tp_pool, case):
    for rank, (out, ref) in enumerate(tp_pool(2).run(_layer_case, case)):
        if case == "lm_head_dst0" and rank == 1:
            assert out is None  # gathered to rank 0 only
            continue
        assert out.shape == ref.shape
        if case == "row_int8":  # per-shard int8 scales: the int8 error, not bit-equal
            assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
        elif case == "row_bf16":
            assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
        else:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_layers_at_one_rank_are_the_whole_layer():
    """tp_size 1: the shard is the weight itself (no copy in float32), no padding, no collective."""
    W, b = _rand(12, 16, seed=2), _rand(12, seed=3)
    col = ColumnParallelLinear(16, 12, bias=True)
    col.weight_loader(W, b)
    row = RowParallelLinear(16, 12, bias=True)
    row.weight_loader(W, b)
    x = _rand(3, 16, seed=1)
    for layer in (col, row):
        assert layer.tp_size == 1 and layer.weight.data_ptr() == W.data_ptr()
        assert torch.equal(layer(x), Linear(W, b)(x))
    emb = VocabParallelEmbedding(13, 16)
    emb.weight_loader(W.new_ones(13, 16))
    assert emb.weight.shape == (13, 16) and vocab_range(13, 0, 1) == (0, 13, 13, 13)


def test_shards_hold_their_slice_and_not_the_checkpoint():
    """A shard narrowed from a float32 checkpoint tensor is copied (keeping it does not keep the
    whole tensor alive); the column shard, row shard and vocabulary rows are the right ones."""
    W = _rand(12, 16, seed=2)
    col = ColumnParallelLinear(16, 12, tp_rank=1, tp_size=2)
    col.weight_loader(W)
    row = RowParallelLinear(16, 12, bias=True, tp_rank=1, tp_size=2)
    row.weight_loader(W, _rand(12, seed=3))
    assert torch.equal(col.weight, W[6:]) and col.weight.untyped_storage().nbytes() == 6 * 16 * 4
    assert torch.equal(row.weight, W[:, 8:]) and row.bias is None  # the bias is added by rank 0 only
    head = ParallelLMHead(13, 16, tp_rank=1, tp_size=2)
    head.weight_loader(_rand(13, 16, seed=4))
    assert head.weight.shape == (7, 16) and torch.equal(head.weight[6], torch.zeros(16))  # the padding row
    assert vocab_range(13, 1, 2) == (7, 13, 7, 14) and vocab_range(2, 3, 4) == (3, 3, 1, 4)


# ---------------------------------------------------------------------------------- errors

def _cfg(**kw):
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=8)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, tp, match", [
    (dict(num_heads=6, num_kv_heads=2), 4, "tensor_parallel_size=4 does not divide the model's 6 attention heads"),
    (dict(num_heads=6, num_kv_heads=3), 2, "tensor_parallel_size=2 does not divide the model's 3 KV heads"),
    (dict(num_heads=12, num_kv_heads=4), 6, "neither a divisor nor a multiple of the model's 4 KV heads"),
    (dict(intermediate_size=66), 4, r"tensor_parallel_size=4 does not divide the model's intermediate_size \(66\)"),
])
def test_a_model_the_ranks_cannot_split_is_a_clear_error(kw, tp, match):
    from kvserve.worker.attention import TorchSDPABackend
    from kvserve.worker.models.llama import LlamaForCausalLM

    cfg = _cfg(**kw)
    with pytest.raises(ValueError, match=match):
        cfg.check_tensor_parallel(tp)
    with pytest.raises(ValueError, match=match):  # before any weight is allocated
        LlamaForCausalLM(cfg, TorchSDPABackend(), torch.float32, torch.device("cpu"), 16, tp_rank=0, tp_size=tp)
    if "heads" in match:
        with pytest.raises(ValueError, match=match):
            QKVParallelLinear(32, 8, cfg.num_heads, cfg.num_kv_heads, tp_rank=0, tp_size=tp)


def test_kv_pool_and_bytes_are_per_rank():
    from kvserve.core.kv_cache_manager import allocate_kv_cache, plan_kv_cache

    cfg = _cfg(num_heads=4, num_kv_heads=2)
    assert cfg.heads_per_rank(2) == (2, 1) and cfg.heads_per_rank(4) == (1, 1)  # replicated at 4
    assert cfg.kv_bytes_per_token(torch.float32, 2) == cfg.kv_bytes_per_token(torch.float32) // 2
    assert cfg.kv_bytes_per_token(torch.float32, 4) == cfg.kv_bytes_per_token(torch.float32, 2)
    spec = plan_kv_cache(cfg, torch.float32, 1.0, 4, 64, num_blocks=8, tp_size=2)
    assert spec.tp_size == 2 and "on each of 2 tensor-parallel ranks" in spec.describe()
    assert allocate_kv_cache(cfg, spec, torch.float32, torch.device("cpu"))[0][0].shape == (8, 4, 1, 8)


def test_worker_argument_errors(tiny_model_dir):
    from kvserve.core.kv_cache_manager import plan_kv_cache
    from kvserve.worker.worker import Worker

    with pytest.raises(ValueError, match="distributed_init_method"):
        Worker(torch.float32, torch.device("cpu"), 0, 2)
    with pytest.raises(ValueError, match="rank"):
        Worker(torch.float32, torch.device("cpu"), 2, 2, "file:///x")
    w = Worker(torch.float32, torch.device("cpu"))
    cfg = _cfg()
    with pytest.raises(ValueError, match="planned for tensor_parallel_size=2"):
        w.initialize_kv_cache(cfg, plan_kv_cache(cfg, torch.float32, 1.0, 4, 64, num_blocks=4, tp_size=2),
                              torch.float32)


def test_a_sharded_layer_without_its_group_raises():
    layer = RowParallelLinear(16, 12, tp_rank=0, tp_size=2)
    layer.weight_loader(_rand(12, 16, seed=2))
    with pytest.raises(RuntimeError, match="init_distributed"):
        layer(_rand(2, 8, seed=1))
    with pytest.raises(ValueError, match=r"must be \[12, 16\]"):
        layer.weight_loader(_rand(12, 8, seed=2))  # a shard is not the full tensor


# --------------------------------------------------------------------- models, TP = 2 vs TP = 1

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama_mqa", "mistral_window", "gemma3"])
def test_tp2_logits_equal_tp1(tiny_model_dir, tp_pool, arch):
    """Chunked prefill (5 tokens a step) batched with decodes, 4 new tokens per prompt: every
    step's logits at TP = 2 equal TP = 1's within 1e-5 (float32), on both ranks (all-gathered),
    and the greedy tokens are the same. llama_mqa has one KV head (replicated on both ranks,
    tied embeddings, a vocabulary of 385: padded); qwen2 has QKV biases, qwen3 QK-norm,
    mistral_window a 16-token window, gemma3 Gemma 3's sandwich norms and local/global layers."""
    folder, _ = tiny_model_dir(arch)
    ref = local_generate(str(folder), PROMPTS, 4)
    ranks = tp_pool(2).run(tp_generate, str(folder), PROMPTS, 4)
    assert ranks[0]["num_heads"] == 2 and ranks[0]["kv_heads"] == 1  # 4 query / 2 (or 1) KV heads, halved
    assert len(ranks[0]["logits"]) == len(ref["logits"]) > 4
    for out in ranks:
        assert out["tokens"] == ref["tokens"]
        for a, b, c in zip(out["logits"], ref["logits"], ranks[0]["logits"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            assert torch.equal(a, c)  # every rank has the same logits


def test_tp2_pytorch_path_equals_tp1(tiny_model_dir, tp_pool):
    """Without the fused CPU kernels (the path CUDA takes: PyTorch ops, SDPA attention)."""
    folder, _ = tiny_model_dir("qwen2")
    ref = local_generate(str(folder), PROMPTS, 3, fused_cpu_ops=False)
    for out in tp_pool(2).run(tp_generate, str(folder), PROMPTS, 3, "float32", None, False):
        assert out["tokens"] == ref["tokens"]
        for a, b in zip(out["logits"], ref["logits"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_tp2_logits_gathered_to_rank0_only(tiny_model_dir, tp_pool):
    """logits_dst=0: rank 0 gets TP = 1's logits, rank 1 none (its runner samples nothing); the
    tokens rank 0 samples, broadcast to rank 1 each step, keep the ranks in step."""
    folder, _ = tiny_model_dir("llama")
    ref = local_generate(str(folder), PROMPTS, 3)
    rank0, rank1 = tp_pool(2).run(tp_generate, str(folder), PROMPTS, 3, "float32", None, True, 0)
    assert rank0["tokens"] == rank1["tokens"] == ref["tokens"]
    assert rank1["logits"] == [] and len(rank0["logits"]) == len(ref["logits"])
    for a, b in zip(rank0["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "int8"), ("float32", "int4")])
def test_tp2_bf16_and_int8_close_to_tp1(tiny_model_dir, tp_pool, dtype, quantization):
    """bf16 (gloo all-reduces bf16) and int8 weights (row-parallel shards have their own scales):
    not bit-equal to TP = 1, within their rounding. int4 (g32): each shard quantizes its own
    slice, whose groups are TP = 1's (the row-parallel cut falls on a group boundary), so only
    the order of additions differs."""
    folder, _ = tiny_model_dir("llama")
    ref = local_generate(str(folder), PROMPTS, 3, dtype, quantization)
    for out in tp_pool(2).run(tp_generate, str(folder), PROMPTS, 3, dtype, quantization):
        assert len(out["logits"]) == len(ref["logits"])
        for a, b in zip(out["logits"], ref["logits"]):  # (measured: 1.1-1.6% of the largest logit)
            assert (a - b).abs().max() <= (1e-5 if quantization == "int4" else 0.05) * b.abs().max()


@pytest.mark.slow
def test_smollm2_tp3_greedy_matches_reference(smollm2_path, reference):
    """SmolLM2-135M (9 query / 3 KV heads, intermediate 1536) split over 3 ranks: the first 8
    greedy tokens of a reference prompt are transformers' (tests/data/smollm2_greedy.json)."""
    from tp_harness import RankPool

    case = reference["cases"][0]
    pool = RankPool(3)
    try:
        outs = pool.run(tp_generate, str(smollm2_path), [case["prompt_ids"]], 8, timeout_s=240)
    finally:
        pool.close()
    for out in outs:
        assert (out["num_heads"], out["kv_heads"]) == (3, 1)
        assert out["tokens"][0] == case["greedy_ids"][:8]
