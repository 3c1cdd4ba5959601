"""Write a GGUF model out as a Hugging Face folder (config.json + model.safetensors + tokenizer).

Peers that cannot read kvserve's default GGUF (vLLM's CPU backend takes a Hugging Face folder)
get the same weights this way: transformers dequantizes the GGUF (SmolLM2-135M-Instruct's is
Q4_1) and the folder holds those Q4_1-rounded values in ``--dtype`` (default bfloat16), which
is what kvserve runs when it loads the GGUF in bfloat16. So every system of the benchmarks
computes with the same numbers.

Usage (with kvserve's Python, which has ``gguf`` and ``transformers``):
    python benchmarks/peers/gguf_to_hf.py OUT_DIR [--gguf FILE] [--dtype bfloat16|float32|float16]

Idempotent: an OUT_DIR that already holds config.json, model.safetensors and tokenizer.json is
left as it is (``--force`` rewrites it). Exits 2 with a message naming the field on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
NEEDED = ("config.json", "model.safetensors", "tokenizer.json")


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize ``gguf`` with transformers and save it under ``out`` in ``dtype``.

    Raises:
        FileNotFoundError: ``gguf`` is not a file.
        ValueError: ``dtype`` is not one of bfloat16, float16, float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf: no such file: {gguf}")
    tdt = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    try:  # transformers >= 5.2x keeps GGUF blocks packed unless told to unpack them
        from transformers import GgufConfig

        extra = {"quantization_config": GgufConfig(gguf_file=gguf.name, dequantize=True)}
    except ImportError:  # older releases always dequantize
        extra = {}
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=tdt, **extra)
    # A GGUF-loaded model refuses save_pretrained (its quantizer is not serializable): copy the
    # dequantized weights into a plain model of the same config and save that.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=tdt)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # tied embeddings have no lm_head
        raise RuntimeError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF file (default: kvserve's default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the saved weights")
    ap.add_argument("--force", action="store_true", help="rewrite OUT even if it is complete")
    a = ap.parse_args(argv)
    if not a.force and all((a.out / f).is_file() for f in NEEDED):
        print(f"{a.out}: already converted (config.json, model.safetensors, tokenizer.json), left as is")
        return 0
    if a.gguf is None:
        from kvserve.worker.default_model import default_model_path

        a.gguf = default_model_path()
    try:
        convert(a.gguf, a.out, a.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = ", ".join(f"{p.name} ({p.stat().st_size / 1e6:.1f} MB)" for p in sorted(a.out.iterdir()) if p.is_file())
    print(f"{a.gguf.name} -> {a.out} ({a.dtype}): {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
