"""Capacity planner (kvserve.capacity, `kvserve plan`): the engine's own sizing, the KV formula,
and the decode rooflines by batch size."""

import math

import pytest
import torch

from kvserve import LLM
from kvserve.capacity import plan_capacity
from kvserve.entrypoints.cli import main


def test_plan_matches_the_engines_pool(tiny_model_dir):
    folder, hf = tiny_model_dir("qwen3")
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=0.01, block_size=8, max_model_len=256)
    plan = plan_capacity(folder, "float32", kv_cache_memory=0.01, max_model_len=256, block_size=8, context_len=100)
    cfg = llm.engine.model_config
    assert plan.kv.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert plan.kv.num_blocks == llm.engine.kv_spec.num_blocks == int(0.01 * 2**30) // (plan.kv.bytes_per_token * 8)
    assert plan.kv.capacity_tokens == plan.kv.num_blocks * 8
    assert plan.max_sequences == plan.kv.num_blocks // math.ceil(100 / 8)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())  # transformers' count
    assert plan.weight_bytes == cfg.num_parameters() * 4
    assert plan.matmul_params == cfg.num_parameters(include_embeddings=False)


def test_decode_roofline_by_batch(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    plan = plan_capacity(folder, "bfloat16", kv_cache_memory=0.05, max_model_len=512, context_len=300)
    W, kv, P = plan.weight_bytes_per_step, plan.kv.bytes_per_token, plan.matmul_params
    bw = 20e9
    for b in (1, 7, 64):
        assert plan.decode_step_bytes(b) == W + b * 300 * kv
        assert plan.decode_tokens_per_s(b, bw) == pytest.approx(b * bw / (W + b * 300 * kv))
    # a slow enough matmul rate makes the step compute-bound: tokens/s = F / (2 P)
    slow = 1e6
    assert plan.decode_tokens_per_s(8, bw, slow) == pytest.approx(slow / (2 * P))
    text = plan.format(bw, slow)
    assert "| 1 |" in text and "compute" in text
    assert f"{plan.kv.bytes_per_token} bytes/token" in text


def test_smollm2_numbers_from_metadata(smollm2_path):
    plan = plan_capacity(smollm2_path, "bfloat16", kv_cache_memory=4, max_model_len=2048)
    assert plan.kv.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert plan.kv.num_blocks == 4 * 2**30 // (23040 * 16)
    assert plan.context_len == 1024 and plan.max_sequences == plan.kv.num_blocks // 64
    assert plan.dtype is torch.bfloat16


def test_8bit_kv_cache_plan(tiny_model_dir, smollm2_path):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=0.01, kv_cache_dtype="int8", max_model_len=256)
    plan = plan_capacity(folder, "float32", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype="int8")
    assert plan.kv.num_blocks == llm.engine.kv_spec.num_blocks and plan.kv_cache_dtype is torch.int8
    smol = plan_capacity(smollm2_path, "bfloat16", kv_cache_memory=2, kv_cache_dtype="fp8")
    assert smol.kv.bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12240
    assert smol.kv_cache_dtype is torch.float8_e4m3fn
    assert "(64 + 4 scale) · 1 byte, float8_e4m3fn" in smol.format()


def test_plan_cli(tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama")
    assert main(["plan", "--model", str(folder), "--kv-cache-memory", "0.05", "--max-model-len", "256",
                 "--no-measure", "--bandwidth", "10"]) == 0
    out = capsys.readouterr().out
    plan = plan_capacity(folder, "bfloat16", kv_cache_memory=0.05, max_model_len=256)
    assert f"{plan.kv.num_blocks} blocks = {plan.kv.capacity_tokens} tokens" in out
    assert "decode roofline at 10.0 GB/s" in out
    tps = plan.decode_tokens_per_s(1, 10e9)
    assert f"| 1 | {plan.decode_step_bytes(1) / 1e6:.0f} MB | {1e3 / tps:.1f} | {tps:.0f} | memory |" in out


@pytest.mark.parametrize("argv, message", [
    (["--context-len", "0"], "--context-len must be an integer ≥ 1"),
    (["--context-len", "999"], "--context-len must be in [1, max_model_len=256]"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory must be in (0, 1048576] GiB"),
    (["--kv-cache-memory", "1e300"], "--kv-cache-memory must be in (0, 1048576] GiB"),
    (["--bandwidth", "1e308"], "--bandwidth must be in (0, 1e+06]"),
    (["--flops", "1e308"], "--flops must be in (0, 1e+09]"),
    (["--kv-cache-memory", "1e-9"], "--kv-cache-memory=1e-09 GiB holds no block"),
    (["--block-size", "0"], "--block-size must be an integer ≥ 1"),
    (["--max-model-len", "100000"], "--max-model-len must be in [2, 512]"),
    (["--bandwidth", "-1"], "--bandwidth must be in (0, 1e+06]"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype must be one of"),
])
def test_plan_bad_options(tiny_model_dir, capsys, argv, message):
    folder, _ = tiny_model_dir("llama")
    base = ["plan", "--model", str(folder), "--no-measure", "--max-model-len", "256"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_plan_bad_model(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "missing.gguf"), "--no-measure"]) == 2
    assert "does not exist" in capsys.readouterr().err
