"""Tiny random-weight Llama-family and Gemma 3 models built with transformers, saved as HF folders,
and prefill_logits (every position's logits from one prefill through an engine's model).

Each folder has config.json, model.safetensors and a small byte-level BPE tokenizer, so
kvserve loads it exactly as it would a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.worker.attention import AttentionMetadata, PrefillSegment

VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little girl who loved to play.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
] * 20


def make_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def _config(arch: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama_long":  # a 4,096-token context (prompts of thousands of tokens, quickly)
        return tf.LlamaConfig(**{**common, "max_position_embeddings": 4096}, rope_theta=10000.0)
    if arch == "llama3":  # tied embeddings + llama3 RoPE scaling
        common["tie_word_embeddings"] = True
        return tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "llama_mqa":  # one KV head (replicated under tensor parallelism), tied, an odd vocabulary
        common.update(num_key_value_heads=1, vocab_size=VOCAB + 1, tie_word_embeddings=True)
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama_3heads":  # 3 query and KV heads: no split over 2 tensor-parallel ranks
        common.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "mistral_window":  # every layer windowed (Mistral v0.1), a window of 16 tokens
        return tf.MistralConfig(**common, sliding_window=16)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    if arch.startswith("gemma3"):
        # head_dim != hidden / heads and query_pre_attn_scalar != head_dim, so that a wrong
        # scale or shape shows; a window of 8 tokens, shorter than the test prompts.
        common.update(tie_word_embeddings=True, bos_token_id=1, pad_token_id=0)
        g = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8)
        if arch == "gemma3":  # local and global layers mixed, transformers 5 rope_parameters
            return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, **g,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                    "sliding_attention"],
                                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}})
        if arch == "gemma3_linear":  # every 3rd layer global (sliding_window_pattern), linear RoPE scaling
            return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, **g, sliding_window_pattern=3,
                                       rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                           "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}})
    raise ValueError(arch)


ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
GEMMA_ARCHS = ["gemma3", "gemma3_linear"]


def make_model(path: Path, arch: str, seed: int = 0):
    """Build, save and return a tiny random transformers model (float32, eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(arch)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Larger-than-default init so logits are far from uniform (greedy ties are unlikely).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif "norm" in name and arch.startswith("gemma3"):  # zero-centred (1 + w) norms: make w matter
                p.normal_(0.0, 0.3)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path)
    return model


def prefill_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position from one prefill through the engine's model and KV pool (returned
    on the CPU, whatever the engine's device)."""
    eng = llm.engine
    T = len(ids)
    pos = torch.arange(T, device=eng.device)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, T, 0)])
    res = getattr(eng.kv, "residual", None)  # 2-/4-bit pools: the partial last block's residual slot
    if res is not None:
        bs = eng.kv.block_size
        if T % bs:
            res.ensure(T // bs)
            res.release_later(T // bs)
        meta.residual_map = res.map.to(eng.device)  # (the KV manager's is on the CPU, as the runner's)
    with torch.inference_mode():
        out = eng.model(torch.tensor(ids, device=eng.device), pos, eng.kv_caches, meta, pos).cpu()
    if res is not None:
        res.end_step()
    return out
