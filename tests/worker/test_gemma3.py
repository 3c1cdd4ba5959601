"""Gemma 3: tiny random-weight models (a window of 8 tokens, local and global layers mixed)
give transformers' logits and greedy tokens through the whole engine, on the fused CPU kernels
and on PyTorch ops; config parsing."""

import copy
import functools
import json

import pytest
import torch

import kvserve.worker.worker as worker_mod
from kvserve import LLM, SamplingParams
from kvserve.worker.attention import AttentionMetadata, PrefillSegment, TorchSDPABackend
from kvserve.config import ModelConfig, UnsupportedModelError
from kvserve.kernels import cpu_ops
from kvserve.worker.models.gemma3 import Gemma3ForCausalLM
from tiny_models import GEMMA_ARCHS, prefill_logits

PROMPTS = [
    [5, 17, 99, 3, 250, 40, 41, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],  # 19 tokens > window 8
    [300, 301],
    [77] * 9,
    [(11 * j) % 380 + 3 for j in range(30)],
]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    """Both CPU paths: the default one (where the kernels build: the fused Gemma kernels, and C
    decode attention, windowed on the local layers) and the plain PyTorch one (CUDA's, and
    machines without the kernels)."""
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_logits_match_transformers(tiny_model_dir, arch, path):
    folder, hf = tiny_model_dir(arch)
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    assert type(llm.engine.model).__name__ == "Gemma3ForCausalLM"
    assert llm.engine.model.fused_cpu_ops == (cpu_ops.available() and llm.engine.device.type == "cpu")
    if path == "pytorch":
        assert type(llm.engine.model.attn_backend) is TorchSDPABackend
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 384, (40,), generator=g).tolist()  # 5x the window
    ours = prefill_logits(llm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape == (40, 384)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # the window matters: the same model with full attention on every layer is far off
    for layer in llm.engine.model.layers:
        layer.self_attn.window = None
    assert (prefill_logits(llm, ids) - ref)[8:].abs().max() > 1e-2


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_greedy_matches_transformers_chunked_and_batched(tiny_model_dir, arch, path):
    """4 prompts in one batch, prefill in chunks of at most 7 tokens (so chunks attend over past
    context that crosses the window), 14 decode steps past the window."""
    folder, hf = tiny_model_dir(arch)
    llm = LLM(model=str(folder), dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    assert llm.engine.model.fused_cpu_ops == (cpu_ops.available() and llm.engine.device.type == "cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 14), p
    assert llm.engine.scheduler.num_chunked_prefills > 0


def test_c_kernel_window_equals_sdpa_and_transformers(tiny_model_dir, monkeypatch):
    """Decode 24 tokens after a 40-token prompt (8-13x the window of 8): the local layers' decode
    attention runs on the C kernel with window=8 (spied), the global layers' without; each
    token's logprob equals the SDPA path's and transformers' (1e-4), the tokens are identical.
    Every block is kept (hybrid model: the global layers read the whole context)."""
    folder, hf = tiny_model_dir("gemma3")
    prompt = [(13 * j) % 370 + 5 for j in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    windows = []
    real = cpu_ops.paged_attention_decode

    def spy(*a, **kw):
        windows.append((kw.get("window"), int(a[4].max())))
        return real(*a, **kw)

    monkeypatch.setattr(cpu_ops, "paged_attention_decode", spy)
    kern = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, enable_prefix_caching=False,
               device="cpu")  # (the CPU backend's C kernel)
    assert kern.engine.kv.sliding_window is None  # hybrid: no block is freed
    a = kern.generate([prompt], params)[0].outputs[0]
    if cpu_ops.available():
        assert {w for w, _ in windows} == {8, None}
        assert any(w == 8 and ctx > 8 for w, ctx in windows)  # windowed C decode past the window
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    sdpa = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4, enable_prefix_caching=False,
               device="cpu")
    assert type(sdpa.engine.model.attn_backend) is TorchSDPABackend
    b = sdpa.generate([prompt], params)[0].outputs[0]
    assert a.token_ids == b.token_ids == _hf_greedy(hf, prompt, 24)
    seq = prompt + a.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1)
    want = torch.tensor([ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(a.token_ids)], dtype=torch.float64)
    for out in (a, b):
        got = torch.tensor([lp.logprob for lp in out.token_logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_greedy_one_prompt_at_a_time_in_large_chunks(tiny_model_dir):
    """Whole-prompt prefills (no past context) then decode, one request per batch."""
    folder, hf = tiny_model_dir("gemma3")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, block_size=4)
    for p in PROMPTS:
        out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_prefix_caching_hits_and_stays_exact(tiny_model_dir, path):
    """A second request sharing a 24-token prefix (3x the window) reuses its cached blocks and
    still gets transformers' tokens; so does the same prompt sent again."""
    folder, hf = tiny_model_dir("gemma3")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=96, block_size=4, enable_prefix_caching=True)
    prefix = [(7 * j) % 370 + 5 for j in range(24)]
    a, b = prefix + [11, 12, 13], prefix + [200, 201]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = llm.generate([a], params)[0]
    computed = llm.engine.num_prompt_tokens_computed
    second = llm.generate([b], params)[0]
    assert llm.engine.num_prompt_tokens_computed - computed <= len(b) - 20  # >= 5 blocks came from the cache
    again = llm.generate([a], params)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == _hf_greedy(hf, a, 10)
    assert second.outputs[0].token_ids == _hf_greedy(hf, b, 10)


def test_bfloat16_close_to_float32(tiny_model_dir):
    folder, _ = tiny_model_dir("gemma3")
    ids = list(range(3, 35))
    a = prefill_logits(LLM(model=str(folder), dtype="float32", num_blocks=16), ids)
    b = prefill_logits(LLM(model=str(folder), dtype="bfloat16", num_blocks=16), ids)
    assert b.dtype == torch.bfloat16
    assert (a - b.float()).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.float().argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not cpu_ops.available(), reason="the fused CPU kernels need x86-64 AVX-512 and a C compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_kernels_match_the_pytorch_ops(tiny_model_dir, monkeypatch, dtype):
    """The same engine and attention backend with the model on the fused CPU kernels and on
    PyTorch ops: prefill logits (40 tokens, 5x the window) and greedy decode agree. In bfloat16
    the kernels round where PyTorch does, so the logits agree up to a rare one-ulp flip of a
    float32 sum (on this model they are identical)."""
    folder, _ = tiny_model_dir("gemma3")
    fused = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=4, device="cpu")  # (CPU kernels)
    monkeypatch.setattr(worker_mod, "model_class",
                        lambda arch: functools.partial(Gemma3ForCausalLM, fused_cpu_ops=False))
    plain = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=4, device="cpu")
    assert fused.engine.model.fused_cpu_ops and not plain.engine.model.fused_cpu_ops
    assert type(fused.engine.model.attn_backend) is type(plain.engine.model.attn_backend)
    ids = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = prefill_logits(fused, ids), prefill_logits(plain, ids)
    assert a.dtype == b.dtype == getattr(torch, dtype)
    if dtype == "float32":
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    else:
        assert (a != b).float().mean() <= 0.01 and (a.float() - b.float()).abs().max() <= 0.05
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in fused.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]


def test_max_model_len_not_capped_at_the_window(tiny_model_dir):
    folder, _ = tiny_model_dir("gemma3")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=16)
    assert llm.engine.model_config.sliding_window == 8
    assert llm.engine.max_model_len == 512  # min(context, 4096): global layers see everything


# ------------------------------------------------------------------ config parsing

def _saved_config(tiny_model_dir, arch="gemma3") -> dict:
    folder, _ = tiny_model_dir(arch)
    return json.loads((folder / "config.json").read_text())


def test_config_from_transformers_5_json(tiny_model_dir):
    cfg = ModelConfig.from_hf_dict(_saved_config(tiny_model_dir))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.norm_style == "gemma" and cfg.qk_norm
    assert [cfg.layer_window(i) for i in range(4)] == [8, 8, None, 8]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.attention_scale == 24**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.embedding_multiplier == 8.0 and cfg.tie_word_embeddings
    lin = ModelConfig.from_hf_dict(_saved_config(tiny_model_dir, "gemma3_linear"))
    assert lin.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert lin.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_config_from_older_json_fields():
    """Hub configs of Gemma 3 (transformers 4.5x): rope_theta / rope_local_base_freq /
    rope_scaling and sliding_window_pattern instead of layer_types."""
    d = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
         "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
         "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
         "sliding_window_pattern": 6, "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
         "final_logit_softcapping": None, "attn_logit_softcapping": None, "eos_token_id": [1, 106]}
    cfg = ModelConfig.from_hf_dict(d)
    assert [i for i in range(18) if cfg.layer_window(i) is None] == [5, 11, 17]
    assert cfg.layer_window(0) == 512 and cfg.rope_local_theta == 1e4 and cfg.eos_token_ids == [1, 106]
    assert cfg.attention_scale == 1 / 16


@pytest.mark.parametrize("field,value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                         ("hidden_activation", "relu"), ("use_bidirectional_attention", True)])
def test_unsupported_gemma3_fields_are_named(tiny_model_dir, field, value):
    d = copy.deepcopy(_saved_config(tiny_model_dir))
    d[field] = value
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf_dict(d)


# ------------------------------------------------------------------ GGUF

def _write_tiny_gemma3_gguf(path, hf) -> None:
    """``hf``'s weights as llama.cpp's converter writes a gemma3 GGUF: its tensor names, norm
    weights stored as 1 + w, float32, and only the metadata llama.cpp writes."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{names[rest.removesuffix('.weight')]}.weight"
        if "norm" in gname:
            a = a + 1.0
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_transformers_on_the_same_file(tmp_path):
    """A tiny random Gemma 3 written as llama.cpp does (6 layers: the 6th global, as a gemma3
    GGUF implies; window 8): kvserve's logits from the file equal transformers' from the file
    and the source model's. head_dim is 256 = query_pre_attn_scalar: a GGUF does not store the
    scalar, and llama.cpp takes head_dim where transformers takes its default, 256."""
    import transformers as tf

    from kvserve.worker.attention import default_backend
    from kvserve.worker.loader import load_weights

    torch.manual_seed(3)
    cfg = tf.Gemma3TextConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-6,
                              tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    src = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    path = tmp_path / "tiny-gemma3.gguf"
    _write_tiny_gemma3_gguf(path, src)

    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    kcfg, state = load_weights(path)
    assert [kcfg.layer_window(i) for i in range(6)] == [8, 8, 8, 8, 8, None]
    assert (kcfg.rope_local_theta, kcfg.attention_scale, kcfg.tie_word_embeddings) == (1e4, 1 / 16, True)
    torch.testing.assert_close(state["model.layers.0.input_layernorm.weight"],
                               src.model.layers[0].input_layernorm.weight, atol=1e-6, rtol=0)
    model = Gemma3ForCausalLM(kcfg, default_backend("cpu", torch.float32, 4, 2, 256), torch.float32,
                              torch.device("cpu"), 512)
    model.load_weights(state)
    kv = [(torch.zeros(16, 4, 2, 256), torch.zeros(16, 4, 2, 256)) for _ in range(6)]
    ids = [(13 * j) % 380 + 3 for j in range(30)]
    T = len(ids)
    pos = torch.arange(T)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, T, 0)])
    with torch.inference_mode():
        ours = model(torch.tensor(ids), pos, kv, meta, pos)
        ref = hf(torch.tensor([ids])).logits[0]
        orig = src(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, orig, atol=1e-4, rtol=0)
