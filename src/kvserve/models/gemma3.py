"""Gemma 3 (text) in plain PyTorch (Gemma Team, "Gemma 3 Technical Report", 2025).

A Llama-style decoder with these differences, each checked against transformers'
``models/gemma3/modeling_gemma3.py`` (the reference for numerics):

* embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype; tied LM head;
* RMSNorm as ``cast(x_norm · (1 + w))`` computed in float32 (Llama casts before multiplying);
* "sandwich" norms: each layer normalises the attention and MLP inputs *and* outputs
  (``input``, ``post_attention``, ``pre_feedforward``, ``post_feedforward``) before the
  residual adds;
* QK-norm (a per-head Gemma RMSNorm of q and k) before RoPE;
* softmax scale ``query_pre_attn_scalar ** -0.5``;
* GeGLU MLP with the tanh approximation of GELU (``gelu_pytorch_tanh``);
* local layers (``sliding_attention``) attend over the last ``sliding_window`` positions with
  RoPE base ``rope_local_theta`` (10000); global layers (``full_attention``, every 6th) attend
  over the whole context with ``rope_theta`` (1e6) and the config's RoPE scaling.

No logit softcapping (Gemma 3 has none; the config parser rejects it). Everything runs on
PyTorch ops (the fused C kernels of :mod:`kvserve.kernels.cpu_ops` compute Llama's norm and
SiLU, and the one-call C decode step is Llama-only); the linears are :class:`Linear` and the
attention is the engine's backend (its C decode kernel serves the global layers on CPU).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.layers.linear import Linear
from kvserve.models.llama import RotaryEmbedding, load_decoder_weights, rope_inv_freq


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``cast(x / sqrt(mean(x², -1) + eps) · (1 + weight))``, all in float32.

    Input and output ``[..., dim]`` in the model dtype; ``weight`` ``[dim]`` (zero-centred: a
    zero weight is the identity scale).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    """Self-attention of one layer: fused q/k/v projection, QK-norm, RoPE (the layer type's
    table), paged attention with the layer's window (None on global layers), output projection.

    ``forward(x [T, hidden], rope_inputs, kv_cache, meta) -> [T, hidden]`` in the model dtype.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype, device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer_idx)
        self.backend = backend
        self.qkv_proj: Optional[Linear] = None  # set by load_weights (fused q, k, v)
        self.o_proj: Optional[Linear] = None
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, rope_inputs, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        q, k = RotaryEmbedding.rotate(q, rope_inputs), RotaryEmbedding.rotate(k, rope_inputs)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3MLP(nn.Module):
    """GeGLU MLP (Shazeer 2020): ``down(gelu_tanh(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj: Optional[Linear] = None
        self.down_proj: Optional[Linear] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """``h + post_ffw(mlp(pre_ffw(h')))`` with ``h' = h + post_attn(attn(input_norm(h)))``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend, dtype, device) -> None:
        super().__init__()
        eps, H = cfg.rms_norm_eps, cfg.hidden_size
        self.is_local = cfg.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.self_attn = Gemma3Attention(cfg, layer_idx, backend, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype, device)

    def forward(self, h: torch.Tensor, rope_inputs, kv_cache, meta) -> torch.Tensor:
        """``h [T, hidden] -> [T, hidden]`` (model dtype)."""
        a = self.self_attn(self.input_layernorm(h), rope_inputs, kv_cache, meta)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text decoder over a paged KV cache (same interface as
    :class:`kvserve.models.llama.LlamaForCausalLM`).

    Args:
        cfg: a :class:`ModelConfig` with ``architecture == "Gemma3ForCausalLM"``.
        backend: attention implementation (see :mod:`kvserve.attention`); it must honour
            ``window`` (both kvserve backends do).
        dtype: compute and weight dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where weights live.
        max_positions: length of the precomputed RoPE tables (tokens).
        fused_cpu_ops: accepted for interface parity and ignored: Gemma runs per op
            (``self.fused_cpu_ops`` is False).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, max_positions: int, fused_cpu_ops: bool = True) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.attn_backend = backend
        self.fused_cpu_ops = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        # transformers: torch.tensor(sqrt(hidden)) (float32) cast to the weight dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.embedding_multiplier).to(dtype).to(device),
                             persistent=False)
        self.rotary_global = RotaryEmbedding(rope_inv_freq(cfg), max_positions, dtype, device, fused=False)
        self.rotary_local = RotaryEmbedding(rope_inv_freq(cfg, local=True), max_positions, dtype, device, fused=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, backend, dtype, device) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head: Optional[Linear] = None

    @torch.inference_mode()
    def load_weights(self, state: dict[str, torch.Tensor], quantization: Optional[str] = None) -> None:
        """Copy a Hugging Face-named float32 state dict in (:func:`load_decoder_weights`, plus the
        pre/post feed-forward norms).

        Raises:
            ModelLoadError: when a tensor is missing or has the wrong shape.
        """
        put = load_decoder_weights(self, state, quantization)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.pre_feedforward_layernorm.weight, p + "pre_feedforward_layernorm.weight")
            put(layer.post_feedforward_layernorm.weight, p + "post_feedforward_layernorm.weight")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch: the contract of :meth:`LlamaForCausalLM.forward`
        (``[T]`` ids and positions in, ``[S, vocab_size]`` logits in the model dtype out for
        the ``S`` rows of ``logits_indices``)."""
        h = self.embed_tokens(input_ids) * self.embed_scale
        rope = {False: self.rotary_global.prepare(positions), True: self.rotary_local.prepare(positions)}
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, rope[layer.is_local], kv, meta)
        return self.lm_head(self.norm(h[logits_indices]))
