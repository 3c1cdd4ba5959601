"""Write a Hugging Face model folder with random weights and a real model's shapes.

Throughput does not depend on trained weights, so a benchmark can run where the real
checkpoint cannot be had (no model hub here; a GGUF too large to copy to a GPU machine):

    python benchmarks/random_model.py /tmp/smollm2-random --like smollm2-135m --tokenizer TOKENIZER
    python benchmarks/throughput.py --model /tmp/smollm2-random --device cuda

The folder holds ``config.json``, ``model.safetensors`` (weights ~ N(0, 0.02), norms 1, as
transformers initializes them) and the tokenizer files of ``--tokenizer`` (a ``.gguf`` or a
Hugging Face folder; kvserve needs a tokenizer to load a folder, and one with a vocabulary no
larger than the model's serves for token-id prompts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

#: Shapes of real checkpoints (their config.json values that matter for speed).
PRESETS = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                                   max_position_embeddings=8192)),
    # SmolLM2-135M with 8 query heads of 72 and 2 KV heads (its 9 and 3 do not split over 2
    # tensor-parallel ranks; benchmarks/tensor_parallel.py)
    "smollm2-135m-8h": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=49152,
                                      tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                                      max_position_embeddings=8192)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 max_position_embeddings=40960)),
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192)),
}


def make_random_model(out: Path, like: str, tokenizer: Path, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, device: str = "cpu") -> Path:
    """Build the random model ``like`` (a :data:`PRESETS` key) and save it with ``tokenizer``'s files.

    Raises:
        KeyError: an unknown preset; ValueError: the tokenizer's vocabulary exceeds the model's.
    """
    import transformers as tf

    from kvserve.engine.tokenizer import load_tokenizer

    arch, shape = PRESETS[like]
    tok = load_tokenizer(tokenizer)
    if len(tok) > shape["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than {like}'s vocabulary of {shape['vocab_size']}")
    cfg = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config}[arch](**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write")
    ap.add_argument("--like", choices=sorted(PRESETS), default="smollm2-135m", help="whose shapes to use")
    ap.add_argument("--tokenizer", required=True, help="a .gguf file or a Hugging Face folder with a tokenizer")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the saved weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to initialize the weights (cuda is much faster for 8B)")
    a = ap.parse_args(argv)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    path = make_random_model(Path(a.out), a.like, Path(a.tokenizer), dtype, a.seed, a.device)
    print(f"wrote {path} (random weights shaped like {a.like}, {a.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
