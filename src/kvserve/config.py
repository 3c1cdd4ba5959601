"""Configuration dataclasses: the model's shape, the KV cache, the scheduler.

``ModelConfig`` is the one description of a decoder (the Llama family and Gemma 3) that the
loader fills from a GGUF header or a Hugging Face ``config.json``; the rest of kvserve reads
only it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SUPPORTED_ARCHITECTURES = {
    # Hugging Face `architectures[0]` / GGUF `general.architecture` -> family traits
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    # Gemma 3 text (Gemma Team, "Gemma 3 Technical Report", 2025): see models/gemma3.py
    "Gemma3ForCausalLM": {"qk_norm": True, "norm_style": "gemma"},
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
#: ``hidden_act`` values kvserve implements (Hugging Face names).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: ``layer_types`` entries (Hugging Face names).
LAYER_TYPES = ("full_attention", "sliding_attention")


def json_object(value: Any, field: str, example: str) -> Mapping:
    """``value`` as a mapping: a dict (any ``Mapping``) as it is, a string parsed as JSON.

    Args:
        value: the option as given (CLI text, Python dict, HTTP field).
        field: the option's name for the messages (``"speculative_config"``).
        example: a valid value to show in the message (``'{"method": "ngram", ...}'``).

    Raises:
        ValueError: naming ``field``: invalid JSON text, or not an object.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} must be a JSON object, got invalid JSON {value!r} ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be an object (a dict or its JSON text) like {example}, got {value!r}")
    return value


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
        sliding_window: attention window (tokens). Without ``layer_types`` (Mistral) every
            layer has it (:attr:`uniform_window`: the KV manager frees the blocks before the
            window); with ``layer_types`` (Gemma 3) only the ``sliding_attention`` layers do.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (Gemma 3), or None.
        rope_local_theta: RoPE base of the sliding-window layers (Gemma 3's
            ``rope_local_base_freq``); None: they use ``rope_theta``. Global layers use
            ``rope_theta`` and ``rope_scaling``, local layers never scale.
        query_pre_attn_scalar: attention scale is ``query_pre_attn_scalar ** -0.5`` (Gemma);
            None: ``head_dim ** -0.5``.
        hidden_act: MLP gate activation, one of :data:`SUPPORTED_ACTIVATIONS`.
        norm_style: ``"llama"`` (``w · cast(x_norm)``) or ``"gemma"`` (``cast(x_norm · (1 + w))``
            in float32, and the sandwich norms around attention and MLP).
        embedding_multiplier: the embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``,
            rounded to the model dtype as Hugging Face does).
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
    layer_types: Optional[list[str]] = None
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    hidden_act: str = "silu"
    norm_style: str = "llama"
    embedding_multiplier: float = 1.0
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
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"model config: hidden activation {self.hidden_act!r} is not supported "
                                        f"(kvserve implements {list(SUPPORTED_ACTIVATIONS)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ModelConfigError(f"model config: layer_types must list {self.num_layers} entries from "
                                       f"{list(LAYER_TYPES)}, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not (
                    isinstance(self.sliding_window, int) and self.sliding_window >= 1):
                raise ModelConfigError(f"model config: sliding_window must be a positive integer when layer_types "
                                       f"has sliding_attention layers, got {self.sliding_window!r}")

    def layer_window(self, i: int) -> Optional[int]:
        """Attention window (tokens) of layer ``i`` as the model computes it, or None for full
        attention. Query position p sees keys in ``(p - window, p]`` (Hugging Face's
        ``sliding_window_overlay``: ``kv_idx > q_idx - window``). Without ``layer_types``
        (Mistral) every layer has ``sliding_window``."""
        if self.layer_types is None:
            return self.sliding_window
        if self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> Optional[int]:
        """The window (tokens) when every layer is windowed (Mistral v0.1: ``sliding_window``
        without ``layer_types``, or ``layer_types`` all ``sliding_attention``), else None. Only
        then can the KV blocks before the window be freed (Mistral 7B's rolling buffer, Jiang
        et al. 2023; vLLM's sliding-window KV manager)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """Softmax scale: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

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
        if arch == "Gemma3ForCausalLM" or cfg.get("model_type") == "gemma3_text":
            return cls._from_gemma3_dict(cfg, num_heads, eos_ids, name)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported for {arch} "
                                        "(kvserve implements silu)")
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

    @classmethod
    def _from_gemma3_dict(cls, cfg: dict[str, Any], num_heads: int, eos_ids: list[int], name: str) -> "ModelConfig":
        """Gemma 3 text (``model_type: gemma3_text``): both transformers 5's ``rope_parameters``
        per layer type and the older ``rope_theta``/``rope_local_base_freq``/``rope_scaling``,
        ``layer_types`` or ``sliding_window_pattern`` (every n-th layer global, default 6), as
        ``transformers.Gemma3TextConfig`` reads them.

        Raises:
            UnsupportedModelError: softcapping, bidirectional attention, an activation other
                than ``gelu_pytorch_tanh``, or scaled RoPE on the local layers; the message names the field.
        """
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                raise UnsupportedModelError(f"config.json: {key}={cfg[key]!r} is not supported (kvserve implements "
                                            f"Gemma 3 without softcapping: {key} must be null)")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("config.json: use_bidirectional_attention=true is not supported (causal only)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"config.json: hidden_activation {act!r} is not supported for Gemma 3 "
                                        "(kvserve implements gelu_pytorch_tanh)")
        n_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        theta, local_theta = cfg.get("rope_theta", 1_000_000.0), cfg.get("rope_local_base_freq", 10_000.0)
        scaling = cfg.get("rope_scaling")
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
            full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
            theta, local_theta = full.get("rope_theta", theta), local.get("rope_theta", local_theta)
            if full.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in full.items() if k != "rope_theta"}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"config.json: rope_parameters.sliding_attention.rope_type "
                                            f"{local['rope_type']!r} is not supported (default only)")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        return cls(
            architecture="Gemma3ForCausalLM",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=n_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id", 2),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window", 4096),
            layer_types=list(layer_types),
            rope_local_theta=float(local_theta),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            hidden_act=act,
            norm_style="gemma",
            embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
            name=name,
        )

    def heads_per_rank(self, tp_size: int = 1) -> tuple[int, int]:
        """``(query heads, KV heads)`` each of ``tp_size`` tensor-parallel ranks holds: the query
        heads split evenly, the KV heads split evenly or, with more ranks than KV heads, one
        replicated KV head per rank (:func:`kvserve.distributed.parallel_state.tp_head_counts`).

        Raises:
            ValueError: head counts ``tp_size`` cannot split (the message names
                ``tensor_parallel_size`` and the counts).
        """
        from kvserve.distributed.parallel_state import tp_head_counts

        h, k, _ = tp_head_counts(self.num_heads, self.num_kv_heads, tp_size)
        return h, k

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise unless the model splits over ``tp_size`` ranks (Megatron-style): the heads
        (:meth:`heads_per_rank`) and the MLP's ``intermediate_size`` (split evenly). The
        vocabulary always splits (it is padded).

        Raises:
            ValueError: naming ``tensor_parallel_size`` and the counts it does not divide.
        """
        self.heads_per_rank(tp_size)
        if self.intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's intermediate_size "
                             f"({self.intermediate_size})")

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1, block_size: int = 16) -> int:
        """KV cache bytes per token (on each of ``tp_size`` tensor-parallel ranks, whose pools hold
        their KV heads only: :meth:`heads_per_rank`): ``2 · num_layers · num_kv_heads · head_dim ·
        dtype_bytes`` for a pool of ``dtype`` (the model dtype), and for an 8-bit pool (``torch.int8``,
        ``torch.float8_e4m3fn``: :mod:`kvserve.worker.kv_quant`) ``2 · num_layers · num_kv_heads ·
        (head_dim + 4)``: one byte per value plus a float32 scale per token and KV head. For a 2-/4-bit
        pool (``torch.uint4``/``torch.uint2``: :mod:`kvserve.worker.kv_quant_lowbit`) the bytes of a
        full ``block_size`` block (codes, float16 scales and zeros) over ``block_size``, rounded up
        (the residual slots of partial blocks are counted apart: :func:`kv_quant_lowbit.residual_bytes`)."""
        from kvserve.worker.kv_quant import bytes_per_head_token, is_lowbit

        kv_heads = self.num_kv_heads if tp_size == 1 else self.heads_per_rank(tp_size)[1]
        if is_lowbit(dtype):
            from kvserve.worker import kv_quant_lowbit as lb

            b = lb.bits_of(dtype)
            per_block = sum(lb.block_bytes(block_size, self.head_dim, b, k) for k in (True, False))
            return -(-self.num_layers * kv_heads * per_block // block_size)
        return 2 * self.num_layers * kv_heads * bytes_per_head_token(self.head_dim, dtype)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Number of weights (the LM head counted once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.norm_style == "gemma":  # pre/post feed-forward norms (sandwich)
            per_layer += 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
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
        kv_cache_memory_gib: memory budget of the K and V pools together (GiB): the one given or
            the default the engine sized from the machine; None when ``num_blocks`` sets the pool.
        num_blocks: if set, overrides the budget (tests use it for tiny pools).
        enable_prefix_caching: reuse the KV of earlier prompts through the radix cache.
    """

    block_size: int = 16
    kv_cache_memory_gib: Optional[float] = 2.0
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output tokens).
        max_waiting: most requests waiting to start before new ones are refused (0 = unbounded;
            see :class:`kvserve.engine.args.EngineArgs`).
        max_num_seqs_per_user: the most sequences one user runs at once (None: no cap; see
            :mod:`kvserve.core.scheduler`).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    max_waiting: int = 0
    max_num_seqs_per_user: Optional[int] = None
