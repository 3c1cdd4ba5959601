"""The 8-bit KV cache (``kv_cache_dtype``: kvserve.worker.kv_quant): the formats' error bounds, the pool
sizing, logits close to the unquantized cache's on tiny Llama/Qwen3/Gemma 3 models, the engine's
invariants (batching, preemption, chunked prefill, prefix caching, forks, beams) holding exactly
with a quantized cache, SmolLM2's greedy tokens, and bad values.

(The C kernels on 8-bit pools against PyTorch on the same pools: tests/kernels/test_cpu_ops.py.)
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker import kv_quant
from kvserve.config import ModelConfig
from kvserve.engine.llm_engine import EngineArgs
from kvserve.core.kv_cache_manager import plan_kv_cache

KV8 = ["int8", "fp8"]


def _rows(n: int, hd: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, with outliers, zeros and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hd, generator=g) * torch.logspace(-6, 3, n).unsqueeze(1)
    x[::7, 3] *= 40  # an outlier channel
    x[5] = 0
    x[6, 1:] = 0
    return x


# ---------------------------------------------------------------------- formats
def test_int8_round_trip_error_is_at_most_half_a_step():
    x = _rows(500)
    q = kv_quant.quantize(x, torch.int8)
    s = q.view(torch.uint8)[:, 64:].contiguous().view(torch.float32)  # [n, 1]
    assert torch.allclose(s[x.abs().amax(1) > 0].squeeze(1), x.abs().amax(1)[x.abs().amax(1) > 0] / 127)
    err = (kv_quant.dequantize(q, torch.float32) - x).abs()
    bound = s / 2 * (1 + 1e-6)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.95  # the bound is reached: a coarser step would fail it
    assert torch.equal(kv_quant.dequantize(q[5:6], torch.float32), torch.zeros(1, 64))  # zero row: exact
    # the row maximum is exact (code ±127)
    i = x.abs().argmax(1)
    assert torch.allclose(kv_quant.dequantize(q, torch.float32).gather(1, i[:, None]), x.gather(1, i[:, None]),
                          rtol=1e-6, atol=0)


def test_fp8_round_trip_error_is_at_most_half_an_e4m3_step():
    x = _rows(500)
    q = kv_quant.quantize(x, torch.float8_e4m3fn)
    s = q.view(torch.uint8)[:, 64:].contiguous().view(torch.float32)
    err = (kv_quant.dequantize(q, torch.float32) - x).abs()
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value's binade floor (relative
    # <= 2^-4) for |x / s| >= 2^-6, and half the subnormal step 2^-9 below
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.9
    codes = q.view(torch.uint8)[:, :64]
    assert not ((codes & 0x7F) == 0x7F).any()  # never NaN: the row max maps to 448 (0x7e)


@pytest.mark.parametrize("kv", KV8)
def test_quantization_is_per_row_and_deterministic(kv):
    x = _rows(64)
    dt = kv_quant.storage_dtype(kv, torch.float32)
    whole = kv_quant.quantize(x, dt).view(torch.uint8)
    parts = torch.cat([kv_quant.quantize(x[i : i + 5], dt).view(torch.uint8) for i in range(0, 64, 5)])
    assert torch.equal(whole, parts)  # a row's codes never depend on the other rows of its batch


# --------------------------------------------------------------------- capacity
def _smollm2_cfg() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("kv,dtype,bpt", [("auto", torch.bfloat16, 2 * 30 * 3 * 64 * 2),
                                          ("auto", torch.float32, 2 * 30 * 3 * 64 * 4),
                                          ("int8", torch.bfloat16, 2 * 30 * 3 * (64 + 4)),
                                          ("fp8", torch.bfloat16, 2 * 30 * 3 * (64 + 4)),
                                          ("fp8_e4m3", torch.float32, 2 * 30 * 3 * (64 + 4))])
def test_planner_uses_the_real_bytes_per_token(kv, dtype, bpt):
    cfg = _smollm2_cfg()
    spec = plan_kv_cache(cfg, kv_quant.storage_dtype(kv, dtype), 2.0, 16, 1024)
    assert spec.bytes_per_token == bpt
    assert spec.num_blocks == (2 << 30) // (bpt * 16)
    bf16 = plan_kv_cache(cfg, torch.bfloat16, 2.0, 16, 1024)
    if kv != "auto":
        assert 1.88 < spec.capacity_tokens / bf16.capacity_tokens < 1.89  # 128 / 68 bytes per head


@pytest.mark.parametrize("kv,storage", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn),
                                        ("fp8_e4m3", torch.float8_e4m3fn), ("auto", torch.float32)])
def test_engine_allocates_the_pools_and_logs_the_dtype(tiny_model_dir, caplog, kv, storage):
    folder, _ = tiny_model_dir("llama")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=0.01, kv_cache_dtype=kv)
    k, v = llm.engine.kv_caches[0]
    hd = 16
    assert k.dtype == v.dtype == storage and k.shape[1:] == (16, 2, hd + 4 * (kv != "auto"))
    spec = llm.engine.kv_spec
    assert spec.bytes_per_token == 2 * 2 * 2 * (hd + 4 if kv != "auto" else hd * 4)
    assert spec.num_blocks == int(0.01 * (1 << 30)) // (spec.bytes_per_token * 16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    name = {"int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "auto": "float32"}[kv]
    assert line.startswith(f"KV cache: {name}") and f"{spec.bytes_per_token} bytes/token" in line
    assert f"{spec.capacity_tokens} tokens" in line


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", ["fp16", "FP8", "", None, 8, "fp8_e5m2", torch.int8])
def test_bad_kv_cache_dtype_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'int8', 'int4', 'int2'\]"):
        EngineArgs(kv_cache_dtype=bad).check()
    with pytest.raises(ValueError, match=r"--kv-cache-dtype must be one of"):
        EngineArgs(kv_cache_dtype=bad).check(option_names=True)


def test_bad_kv_cache_dtype_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model="/nonexistent/model", kv_cache_dtype="int3")


def test_cli_refuses_a_bad_kv_cache_dtype(capsys):
    from kvserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--kv-cache-dtype", "int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'int8'" in err


def test_head_dim_must_be_a_multiple_of_4_for_8bit_pools():
    kv_quant.check_head_dim(64, "int8")
    kv_quant.check_head_dim(6, "auto")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a head_dim divisible by 4, the model's is 6"):
        kv_quant.check_head_dim(6, "fp8")


# ------------------------------------------------------------- tiny models: logits
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 2
#: max |logit difference| against the unquantized cache (float32 model; measured 0.029 / 0.054 /
#: 0.072 for int8 and 0.12 / 0.20 / 0.30 for fp8 on llama / qwen3 / gemma3, logits up to ~4)
LOGIT_TOL = {"int8": 0.15, "fp8": 0.6}


@pytest.mark.parametrize("kv", KV8)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_logits_close_to_the_unquantized_cache(tiny_model_dir, arch, kv):
    """Every position's logits of a 44-token prompt (longer than Gemma's 8-token window), and
    the next 8 greedy tokens' logprobs through decode (C kernel on the global layers, SDPA on
    windowed ones past the window)."""
    from tiny_models import prefill_logits

    folder, _ = tiny_model_dir(arch)
    base = LLM(model=str(folder), dtype="float32", num_blocks=64)
    quant = LLM(model=str(folder), dtype="float32", num_blocks=64, kv_cache_dtype=kv)
    ids = base.engine.encode(PROMPT)
    ref, got = prefill_logits(base, ids), prefill_logits(quant, ids)
    diff = (got - ref).abs().max().item()
    assert 0 < diff < LOGIT_TOL[kv]  # > 0: the cache is really quantized
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    a, b = base.generate([ids], params)[0].outputs[0], quant.generate([ids], params)[0].outputs[0]
    for la, lb in zip(a.token_logprobs, b.token_logprobs):
        if la.token_id != lb.token_id:
            break
        assert abs(la.logprob - lb.logprob) < LOGIT_TOL[kv]


# ---------------------------------------------------- tiny models: exact invariants
def _prompts(llm) -> list[list[int]]:
    base = llm.engine.encode(PROMPT)
    return [base[: 5 + (i * 11) % 40] + [7 + i] for i in range(10)]


@pytest.fixture(scope="module", params=[("llama", "int8"), ("llama", "fp8"), ("gemma3", "int8")],
                ids=lambda p: "-".join(p))
def alone(request, tiny_model_dir):
    arch, kv = request.param
    folder = str(tiny_model_dir(arch)[0])
    llm = LLM(model=folder, dtype="float32", num_blocks=256, block_size=4, kv_cache_dtype=kv,
              enable_prefix_caching=False)
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return folder, kv, prompts, params, [llm.generate([p], params)[0].token_ids for p in prompts]


def test_batch_equals_alone(alone):
    folder, kv, prompts, params, expected = alone
    llm = LLM(model=folder, dtype="float32", num_blocks=256, block_size=4, kv_cache_dtype=kv)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_batch_equals_alone_under_preemption_and_chunking(alone):
    folder, kv, prompts, params, expected = alone
    llm = LLM(model=folder, dtype="float32", num_blocks=24, block_size=4, kv_cache_dtype=kv,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_chunked_prefills > 0
    assert llm.engine.kv.num_free_blocks == 24


def test_prefix_cache_hits_change_nothing(alone):
    """Prompts sharing prefixes of every length (partial blocks copied token by token, scales
    included), run twice through one engine: the second pass is served from the cache."""
    folder, kv, prompts, params, expected = alone
    llm = LLM(model=folder, dtype="float32", num_blocks=256, block_size=4, kv_cache_dtype=kv)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    st = llm.engine.stats()
    assert st["prefix_cache_hits"] > 0


def test_forks_and_beams_are_batch_independent(alone):
    """n > 1 samples (the prompt's blocks shared by the forks) and beam search (copy-on-write
    of partial blocks) give the same outputs alone and next to the other prompts."""
    folder, kv, prompts, _, _ = alone
    sample = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8, temperature=0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(batch: bool):
        llm = LLM(model=folder, dtype="float32", num_blocks=256, block_size=4, kv_cache_dtype=kv)
        extra = prompts[2:6] if batch else []
        outs = llm.generate([prompts[7], prompts[8]] + extra, [sample, beam] + [greedy] * len(extra))
        return [[c.token_ids for c in o.outputs] for o in outs[:2]]

    assert run(False) == run(True)


# -------------------------------------------------------------- SmolLM2 (real model)
@pytest.mark.slow
def test_smollm2_bf16_int8_cache_tracks_the_reference_like_the_bf16_cache(smollm2_path, reference):
    """Teacher-forced on the 7 reference sequences (prompt + transformers' fp32 greedy output),
    prefilled in chunks of 16 tokens so that every chunk reads its context back from the
    (quantized) pool: at each output position, does the bf16 model's argmax equal the reference
    token (rank 1), and how far is its log-probability of that token from the bf16 cache's?
    Measured on an AMD Zen 4 CPU (AVX-512 kernels), 181 positions: top-1 agreement 99.4% with
    the bf16 cache, 97.8% with int8 (fp8, not run here: 96.1%), mean |delta logprob| against
    the bf16 cache 0.031 (fp8 0.043). Free-running greedy prefixes are not compared: one near-tie
    sends them apart (a prompt diverged at its 5th token on Zen 4, at none before the 12th on
    an AMX Xeon). Asserted: the bf16 cache >= 95%, int8 within 4 points of it, mean
    |delta logprob| < 0.08."""
    seqs = [c["prompt_ids"] + c["greedy_ids"] for c in reference["cases"]]
    starts = [len(c["prompt_ids"]) for c in reference["cases"]]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=0.1, kv_cache_dtype=kv,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
        outs = llm.generate(seqs, params)
        assert llm.engine.scheduler.num_chunked_prefills > 0
        runs[kv] = [o.prompt_token_logprobs[s:] for o, s in zip(outs, starts)]
    top1 = {kv: sum(lp.rank == 1 for r in runs[kv] for lp in r) / sum(len(r) for r in runs[kv])
            for kv in runs}
    dlp = [abs(a.logprob - b.logprob) for ra, rb in zip(runs["auto"], runs["int8"]) for a, b in zip(ra, rb)]
    assert top1["auto"] >= 0.95 and top1["int8"] >= top1["auto"] - 0.04, top1
    assert sum(dlp) / len(dlp) < 0.08, sum(dlp) / len(dlp)
