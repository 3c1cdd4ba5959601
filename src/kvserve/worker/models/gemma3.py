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

No logit softcapping (Gemma 3 has none; the config parser rejects it).

On CPU in float32/bfloat16, when :mod:`kvserve.kernels.cpu_ops` builds (``fused_cpu_ops``),
the non-matmul ops run on its fused C kernels, which round where the PyTorch ops do:

* ``gemma_add_rms_norm_``: each sandwich step ``h += post_norm(out)`` together with the norm
  that follows it (``pre_feedforward``, the next layer's ``input``, or the final norm), the
  residual stream ``h`` updated in place;
* ``gemma_qk_norm_rope_``: QK-norm and RoPE (the layer type's table) in place on the fused
  QKV output;
* ``gelu_tanh_and_mul``: the GeGLU activation.

Otherwise (CUDA, other dtypes, no kernels) every op is PyTorch's, as written in the modules'
``forward``. The one-call C decode step is Llama-only; the linears are :class:`Linear` and the
attention is the engine's backend (on CPU its C decode kernel serves every layer, reading only
the last ``sliding_window`` positions on the local layers). Every KV block is kept: the global
layers read the whole context (per-layer-group block tables, vLLM's hybrid allocator, which
could free the local layers' old blocks, are not implemented).

Tensor parallelism splits the model as :mod:`kvserve.worker.models.llama` does (heads,
intermediate units and vocabulary; the norms, QK-norms included, are per head or per hidden
unit and replicated).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.worker.attention import AttentionBackend, AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.kernels import cpu_ops
from kvserve.worker.layers.parallel_linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                                   resolve_tp)
from kvserve.worker.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.worker.models.llama import RotaryEmbedding, load_decoder_weights, rope_inv_freq


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

    ``forward(x [T, hidden], rope_inputs, kv_cache, meta) -> [T, hidden]`` in the model dtype;
    ``rope_inputs`` is ``rotary.prepare(positions)``.

    Args:
        rotary: the layer type's :class:`RotaryEmbedding`; when it is fused, QK-norm and RoPE
            run in place on the QKV output (:func:`cpu_ops.gemma_qk_norm_rope_`).
        tp_size: tensor-parallel ranks: the layer holds this rank's heads
            (:meth:`ModelConfig.heads_per_rank`), its output projection all-reduces.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, rotary: RotaryEmbedding,
                 dtype, device, tp_size: int = 1) -> None:
        super().__init__()
        self.rotary = [rotary]  # shared with the other layers of its type; a list keeps it out of children
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = cfg.heads_per_rank(tp_size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer_idx)
        self.backend = backend
        self.qkv_proj: Optional[QKVParallelLinear] = None  # set by load_weights (fused q, k, v)
        self.o_proj: Optional[RowParallelLinear] = None
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, rope_inputs, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        rot = self.rotary[0]
        qkv = self.qkv_proj(x)
        if rot.fused:  # rope_inputs: the positions
            cpu_ops.gemma_qk_norm_rope_(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                                        self.k_norm.weight, self.eps, rope_inputs, rot.cos_table, rot.sin_table)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(T, self.num_heads, self.head_dim), k.reshape(T, self.num_kv_heads, self.head_dim)
        if not rot.fused:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.rotate(q, rope_inputs), RotaryEmbedding.rotate(k, rope_inputs)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3MLP(nn.Module):
    """GeGLU MLP (Shazeer 2020): ``down(gelu_tanh(gate(x)) * up(x))`` with gate/up fused
    (``fused``: the activation on :func:`cpu_ops.gelu_tanh_and_mul`), over this rank's
    ``intermediate_size / tp_size`` hidden units."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.fused = fused
        self.intermediate_size = cfg.intermediate_size // tp_size
        self.gate_up_proj: Optional[MergedColumnParallelLinear] = None
        self.down_proj: Optional[RowParallelLinear] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(cpu_ops.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """``h + post_ffw(mlp(pre_ffw(h')))`` with ``h' = h + post_attn(attn(input_norm(h)))``.

    ``forward`` runs it on PyTorch ops; ``forward_fused`` on the fused CPU kernels, carrying the
    residual stream in place and each norm's output to the next step.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend, rotary: RotaryEmbedding, dtype, device,
                 fused: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        eps, H = cfg.rms_norm_eps, cfg.hidden_size
        self.eps = eps
        self.is_local = cfg.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.self_attn = Gemma3Attention(cfg, layer_idx, backend, rotary, dtype, device, tp_size)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype, device)
        self.mlp = Gemma3MLP(cfg, fused, tp_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps, dtype, device)

    def forward(self, h: torch.Tensor, rope_inputs, kv_cache, meta) -> torch.Tensor:
        """``h [T, hidden] -> [T, hidden]`` (model dtype)."""
        a = self.self_attn(self.input_layernorm(h), rope_inputs, kv_cache, meta)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)

    def forward_fused(self, h: torch.Tensor, x: torch.Tensor, rope_inputs, kv_cache, meta,
                      next_norm: torch.Tensor) -> torch.Tensor:
        """The layer on the fused CPU kernels (what :meth:`forward` computes, rounded alike).

        Args:
            h: ``[T, hidden]`` contiguous residual stream (model dtype), updated in place to the
                layer's output.
            x: ``[T, hidden]`` this layer's ``input_layernorm(h)``.
            next_norm: ``[hidden]`` weight of the norm that follows the layer (the next
                layer's ``input_layernorm`` or the model's final norm).

        Returns:
            ``[T, hidden]``: that norm applied to the updated ``h``.
        """
        a = self.self_attn(x, rope_inputs, kv_cache, meta)
        x = cpu_ops.gemma_add_rms_norm_(a, self.post_attention_layernorm.weight, h, self.eps,
                                        self.pre_feedforward_layernorm.weight)
        m = self.mlp(x)
        return cpu_ops.gemma_add_rms_norm_(m, self.post_feedforward_layernorm.weight, h, self.eps, next_norm)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text decoder over a paged KV cache (same interface as
    :class:`kvserve.worker.models.llama.LlamaForCausalLM`).

    Args:
        cfg: a :class:`ModelConfig` with ``architecture == "Gemma3ForCausalLM"``.
        backend: attention implementation (see :mod:`kvserve.worker.attention`); it must honour
            ``window`` (both kvserve backends do).
        dtype: compute and weight dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where weights live.
        max_positions: length of the precomputed RoPE tables (tokens).
        fused_cpu_ops: on CPU in float32/bfloat16, run the norms (with the residual adds),
            QK-norm + RoPE and GeGLU on the fused kernels of :mod:`kvserve.kernels.cpu_ops`
            when they are available (``self.fused_cpu_ops`` says whether they are used).
        tp_rank, tp_size, logits_dst: tensor parallelism, as for
            :class:`~kvserve.worker.models.llama.LlamaForCausalLM`.

    Raises:
        ValueError: a model ``tp_size`` does not split (:meth:`ModelConfig.check_tensor_parallel`).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, max_positions: int, fused_cpu_ops: bool = True,
                 tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                 logits_dst: Optional[int] = None) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        cfg.check_tensor_parallel(self.tp_size)
        self.logits_dst = logits_dst
        self.attn_backend = backend
        fused = fused_cpu_ops and torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
            and cpu_ops.available()
        self.fused_cpu_ops = fused
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device,
                                                   tp_rank=self.tp_rank, tp_size=self.tp_size)
        # transformers: torch.tensor(sqrt(hidden)) (float32) cast to the weight dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.embedding_multiplier).to(dtype).to(device),
                             persistent=False)
        self.rotary_global = RotaryEmbedding(rope_inv_freq(cfg), max_positions, dtype, device, fused)
        self.rotary_local = RotaryEmbedding(rope_inv_freq(cfg, local=True), max_positions, dtype, device, fused)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, backend, self.rotary_local if cfg.layer_window(i) is not None
                               else self.rotary_global, dtype, device, fused, self.tp_size)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head: Optional[ParallelLMHead] = None

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
        the ``S`` rows of ``logits_indices``; None on a rank other than ``logits_dst``)."""
        h = self.embed_tokens(input_ids) * self.embed_scale
        rope = {False: self.rotary_global.prepare(positions), True: self.rotary_local.prepare(positions)}
        if self.fused_cpu_ops:
            x = cpu_ops.gemma_rms_norm(h, self.layers[0].input_layernorm.weight, self.cfg.rms_norm_eps)
            norms = [layer.input_layernorm.weight for layer in self.layers[1:]] + [self.norm.weight]
            for layer, kv, next_norm in zip(self.layers, kv_caches, norms):
                x = layer.forward_fused(h, x, rope[layer.is_local], kv, meta, next_norm)
            return self.lm_head(x[logits_indices])
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, rope[layer.is_local], kv, meta)
        return self.lm_head(self.norm(h[logits_indices]))
