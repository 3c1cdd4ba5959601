"""The Llama family in plain PyTorch: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm).

Reads like the paper (Touvron et al. 2023, "LLaMA"): RMSNorm → attention with RoPE (Su et al.
2021) → residual → RMSNorm → SwiGLU MLP → residual. Differences from a textbook model are
only for serving: the batch is a flat list of tokens from many requests (no padding), K/V go
to a paged cache through the attention backend, q/k/v and gate/up projections are fused into
one matmul each, and logits are computed only for the positions that need them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.layers.linear import Linear


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face does.

    ``y = weight · (x / sqrt(mean(x², -1) + eps))``; input and output ``[..., dim]`` in the
    model dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32, with the config's scaling.

    Supports no scaling, ``linear`` (positions divided by ``factor``) and ``llama3``
    (Meta's frequency-dependent interpolation used by Llama 3.1+).

    Raises:
        ValueError: for any other ``rope_type``.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype, device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        self.qkv_proj: Optional[Linear] = None  # set by load_weights (fused q, k, v)
        self.o_proj: Optional[Linear] = None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self.backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj: Optional[Linear] = None
        self.down_proj: Optional[Linear] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a paged KV cache.

    Args:
        cfg: the model's :class:`ModelConfig`.
        backend: attention implementation (see :mod:`kvserve.attention`).
        dtype: compute and weight dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where weights live.
        max_positions: length of the precomputed RoPE table (tokens).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head: Optional[Linear] = None
        inv_freq = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().to(dtype).to(device), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(dtype).to(device), persistent=False)

    @torch.inference_mode()
    def load_weights(self, state: dict[str, torch.Tensor], quantization: Optional[str] = None) -> None:
        """Copy a Hugging Face-named float32 state dict in, fusing q/k/v and gate/up.

        Raises:
            ModelLoadError: when a tensor is missing or has the wrong shape.
        """
        from kvserve.loader import ModelLoadError, iter_layer_names

        missing = [n for n in iter_layer_names(self.cfg) if n not in state]
        if missing:
            raise ModelLoadError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        dt, dev = self.dtype, self.device

        def lin(w, b=None):
            return Linear(w.to(dev, dt), None if b is None else b.to(dev, dt), quantization=quantization)

        def put(param: torch.Tensor, name: str):
            t = state[name]
            if tuple(t.shape) != tuple(param.shape):
                raise ModelLoadError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(t.shape)}")
            param.copy_(t)

        put(self.embed_tokens.weight, "model.embed_tokens.weight")
        put(self.norm.weight, "model.norm.weight")
        head = state["model.embed_tokens.weight"] if self.cfg.tie_word_embeddings else state["lm_head.weight"]
        self.lm_head = Linear(head.to(dev, dt), None)  # the LM head is never quantized
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_layernorm.weight, p + "input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
            a = layer.self_attn
            ws = [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            expect = [a.q_size, a.kv_size, a.kv_size]
            for n, w, e in zip("qkv", ws, expect):
                if tuple(w.shape) != (e, self.cfg.hidden_size):
                    raise ModelLoadError(f"{p}self_attn.{n}_proj.weight: expected {(e, self.cfg.hidden_size)}, got {tuple(w.shape)}")
            bias = torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]) if self.cfg.attention_bias else None
            a.qkv_proj = lin(torch.cat(ws), bias)
            a.o_proj = lin(state[p + "self_attn.o_proj.weight"])
            if self.cfg.qk_norm:
                put(a.q_norm.weight, p + "self_attn.q_norm.weight")
                put(a.k_norm.weight, p + "self_attn.k_norm.weight")
            m = layer.mlp
            m.gate_up_proj = lin(torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
            m.down_proj = lin(state[p + "mlp.down_proj.weight"])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: ``[T]`` int64 token ids of every scheduled token of every request.
            positions: ``[T]`` int64 absolute position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: attention metadata for the step.
            logits_indices: ``[S]`` int64 batch positions whose logits are needed.

        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        h = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin_table[positions].unsqueeze(1)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv, meta)
        h = self.norm(h[logits_indices])
        return self.lm_head(h).float()
