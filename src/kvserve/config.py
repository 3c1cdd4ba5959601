"""Configuration dataclasses: the model's shape, the KV cache, the scheduler.

``ModelConfig`` is the one description of a Llama-family model that the loader fills
from a GGUF header or a Hugging Face ``config.json``; the rest of kvserve reads only it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SUPPORTED_ARCHITECTURES = {
    # Hugging Face `architectures[0]` / GGUF `general.architecture` -> family traits
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(ValueError):
    """The model's architecture (or one of its features) is not implemented by kvserve."""


class ModelConfigError(ValueError):
    """The model's configuration is malformed (a missing field, a value out of range)."""


@dataclass(slots=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: tokens in the embedding table.
        hidden_size, intermediate_size: model width and MLP width.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention heads (GQA when num_kv_heads < num_heads).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base; rope_scaling: Hugging Face ``rope_scaling`` dict or None
            (``llama3``, ``linear`` and ``dynamic``-free ``default`` are supported).
        max_position_embeddings: context length the model was trained for (tokens).
        tie_word_embeddings: the LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        bos_token_id, eos_token_ids: special tokens (EOS may be several).
        sliding_window: attention window (tokens) of Mistral-style models; kvserve caps
            ``max_model_len`` at it, where full attention is exact.
        name: a human-readable model name (used in logs and as the served name).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: Optional[int] = None
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; kvserve supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for trait, value in SUPPORTED_ARCHITECTURES[self.architecture].items():
            setattr(self, trait, value)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            UnsupportedModelError: for an architecture outside the Llama family.
            ModelConfigError: ``cfg`` is not a dict, lacks a required field or holds a bad value.
        """
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"config.json must hold a JSON object, got a {type(cfg).__name__}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelConfigError(f"config.json lacks {missing}")
        archs = cfg.get("architectures") or ([cfg["model_type"]] if cfg.get("model_type") else [])
        if not archs:
            raise UnsupportedModelError(
                f"config.json names no architecture (neither 'architectures' nor 'model_type'); kvserve "
                f"supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; kvserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ModelConfigError(f"model config: num_attention_heads must be a positive integer, got {num_heads!r}")
        if not cfg.get("head_dim") and (not isinstance(cfg["hidden_size"], int) or cfg["hidden_size"] % num_heads):
            raise ModelConfigError(f"model config: hidden_size ({cfg['hidden_size']!r}) must be a multiple of "
                                   f"num_attention_heads ({num_heads}) when head_dim is not given")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 style
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        sliding_window = None
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            sliding_window = int(cfg["sliding_window"])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding_window,
            name=name,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token: ``2 · num_layers · num_kv_heads · head_dim · dtype_bytes``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Number of weights (the LM head counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        n = L * per_layer + h
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        else:
            n += self.vocab_size * h  # the LM head is a matmul even when embeddings are excluded
        return n


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_gib: memory budget of the K and V pools together (GiB).
        num_blocks: if set, overrides the budget (tests use it for tiny pools).
        enable_prefix_caching: reuse the KV of earlier prompts through the radix cache.
    """

    block_size: int = 16
    kv_cache_memory_gib: float = 2.0
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output tokens).
        max_waiting: most requests queued before new ones are refused (0 = unbounded).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    max_waiting: int = 0
