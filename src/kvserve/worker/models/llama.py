"""The Llama family in plain PyTorch: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm).

Reads like the paper (Touvron et al. 2023, "LLaMA"): RMSNorm → attention with RoPE (Su et al.
2021) → residual → RMSNorm → SwiGLU MLP → residual. Differences from a textbook model are
only for serving: the batch is a flat list of tokens from many requests (no padding), K/V go
to a paged cache through the attention backend, q/k/v and gate/up projections are fused into
one matmul each, and logits are computed only for the positions that need them.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): with ``tp_size`` ranks each holds its
share of every layer (:mod:`kvserve.worker.layers.parallel_linear`,
:mod:`kvserve.worker.layers.vocab_parallel_embedding`): its query and KV heads (KV heads
replicated when there are fewer than ranks) in a column-parallel fused QKV, its slice of the
MLP's hidden units in a column-parallel fused gate/up, row-parallel output and down projections
(an all-reduce each), and its slice of the vocabulary in the embedding and the LM head. Attention
and its KV pool cover this rank's heads only. At ``tp_size == 1`` every layer is the whole layer
and nothing communicates.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.worker.kv_quant_lowbit import LowBitPool
from kvserve.worker.attention import AttentionBackend, AttentionMetadata, CPUPagedAttentionBackend
from kvserve.config import ModelConfig
from kvserve.kernels import cpu_ops
from kvserve.worker.layers import linear
from kvserve.worker.layers.linear import cpu_kernels
from kvserve.worker.layers.parallel_linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                                   resolve_tp)
from kvserve.worker.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.worker.layers.quant import GGUFWeight, dense_descriptor, gemv_descriptor, q_kernels


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face does.

    ``y = weight · (x / sqrt(mean(x², -1) + eps))``; input and output ``[..., dim]`` in the
    model dtype. With ``residual`` (vLLM's fused add + norm) it returns ``(norm(x + residual),
    x + residual)``; the fused CPU kernel updates ``residual`` in place.

    Args:
        fused: use the fused CPU kernel (:func:`kvserve.kernels.cpu_ops.rms_norm`) (any input
            without ``residual``, 2-D input with it).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.fused and (x.dim() == 2 or residual is None):
            if x.dim() != 2:  # e.g. per-head q/k norm over [T, heads, head_dim]
                return cpu_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            out = cpu_ops.rms_norm(x, self.weight, self.eps, residual=residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32, with the config's scaling.

    Supports no scaling, ``linear`` (positions divided by ``factor``) and ``llama3``
    (Meta's frequency-dependent interpolation used by Llama 3.1+). ``local``: the
    sliding-window layers' RoPE (Gemma 3: base ``rope_local_theta``, never scaled).

    Raises:
        ValueError: for any other ``rope_type``.
    """
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = None if local else cfg.rope_scaling
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


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021) in Hugging Face's ``rotate_half`` layout, shared by all layers.

    ``prepare(positions)`` runs once per step; ``forward(qkv, rope_inputs)`` rotates the q and k
    heads of a fused QKV output: in place with the fused CPU kernel, else as
    ``x·cos + rotate_half(x)·sin`` on new tensors.

    Args:
        inv_freq: ``[head_dim / 2]`` float32 inverse frequencies (see :func:`rope_inv_freq`).
        max_positions: rows of the cos/sin tables (tokens).
        fused: use :func:`kvserve.kernels.cpu_ops.rope_`.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype, device, fused: bool) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().to(dtype).to(device), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(dtype).to(device), persistent=False)
        self.head_dim = emb.shape[-1]
        self.fused = fused

    def prepare(self, positions: torch.Tensor):
        """Per-step inputs: ``positions [T]`` (fused) or the gathered ``(cos, sin)``, ``[T, 1, head_dim]``."""
        if self.fused:
            return positions
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def forward(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, rope_inputs):
        """Rotate q and k of ``qkv [T, (num_heads + 2·num_kv_heads)·head_dim]``.

        Returns:
            ``(q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [T, num_kv_heads, head_dim])``
            (views into ``qkv`` when fused).
        """
        T, hd = qkv.shape[0], self.head_dim
        q_size, kv_size = num_heads * hd, num_kv_heads * hd
        if self.fused:
            cpu_ops.rope_(qkv, num_heads + num_kv_heads, hd, rope_inputs, self.cos_table, self.sin_table)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = q.view(T, num_heads, hd), k.view(T, num_kv_heads, hd), v.view(T, num_kv_heads, hd)
        if not self.fused:
            q, k = self.rotate(q, rope_inputs), self.rotate(k, rope_inputs)
        return q, k, v

    @staticmethod
    def rotate(x: torch.Tensor, rope_inputs) -> torch.Tensor:
        """``x·cos + rotate_half(x)·sin`` for ``x [T, heads, head_dim]`` and unfused ``rope_inputs``
        (Hugging Face's ``apply_rotary_pos_emb``); a new tensor."""
        cos, sin = rope_inputs
        return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Self-attention of one layer over this rank's heads (all of them at ``tp_size == 1``):
    ``forward(x [T, hidden], rope_inputs, kv_cache, meta) -> [T, hidden]`` (model dtype), the
    output projection's all-reduce included.

    Attributes:
        num_heads, num_kv_heads: this rank's query and KV heads (:meth:`ModelConfig.heads_per_rank`).
        q_size, kv_size: their widths (``heads · head_dim``) in the fused QKV output.
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding, dtype, device,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.heads_per_rank(tp_size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.uniform_window  # Mistral: every layer attends over (p - window, p]
        self.backend = backend
        self.rotary = [rotary]  # shared by all layers; a list keeps it out of this module's children
        self.qkv_proj: Optional[QKVParallelLinear] = None  # set by load_weights (fused q, k, v)
        self.o_proj: Optional[RowParallelLinear] = None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, rotary.fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, rotary.fused) if cfg.qk_norm else None

    def forward(self, x, rope_inputs, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            qk = qkv[:, : self.q_size + self.kv_size]
            q = self.q_norm(qk[:, : self.q_size].reshape(T, self.num_heads, self.head_dim))
            k = self.k_norm(qk[:, self.q_size :].reshape(T, self.num_kv_heads, self.head_dim))
            qk.copy_(torch.cat([q.reshape(T, -1), k.reshape(T, -1)], dim=-1))
        q, k, v = self.rotary[0](qkv, self.num_heads, self.num_kv_heads, rope_inputs)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window)  # [T, H, hd]
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))`` with gate/up fused, over this
    rank's ``intermediate_size / tp_size`` hidden units (the down projection's all-reduce sums the ranks')."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size // tp_size
        self.gate_up_proj: Optional[MergedColumnParallelLinear] = None
        self.down_proj: Optional[RowParallelLinear] = None
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(cpu_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried separately (vLLM style) so that
    each residual add fuses into the following RMSNorm."""

    def __init__(self, cfg: ModelConfig, backend, rotary, dtype, device, fused: bool, tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.self_attn = LlamaAttention(cfg, backend, rotary, dtype, device, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.mlp = LlamaMLP(cfg, fused, tp_size)

    def forward(self, h, residual, rope_inputs, kv_cache, meta):
        """``(h, residual) -> (h', residual')`` with the layer's output ``= h' + residual'``."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope_inputs, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a paged KV cache.

    Args:
        cfg: the model's :class:`ModelConfig`.
        backend: attention implementation (see :mod:`kvserve.worker.attention`), built for this
            rank's heads (:meth:`ModelConfig.heads_per_rank`).
        dtype: compute and weight dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where weights live.
        max_positions: length of the precomputed RoPE table (tokens).
        fused_cpu_ops: on CPU in float32/bfloat16, run RMSNorm (+ residual add), RoPE and
            SiLU-and-mul on the fused kernels of :mod:`kvserve.kernels.cpu_ops` when they are
            available (``self.fused_cpu_ops`` says whether they are used).
        tp_rank, tp_size: the tensor-parallel rank this model is the shard of, and the number of
            ranks (None: this process's, :mod:`kvserve.distributed.parallel_state`; 1 when it has
            no group). With ``tp_size > 1`` the forward runs collectives on the process's group.
        logits_dst: None: every rank gets the logits (all-gather); a rank: only that one does
            (gather; the others' forward returns None).

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
        self.rotary_emb = RotaryEmbedding(rope_inv_freq(cfg), max_positions, dtype, device, fused)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, self.rotary_emb, dtype, device, fused,
                                                      self.tp_size)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.lm_head: Optional[ParallelLMHead] = None
        self._decode_step: Optional[cpu_ops.DecodeStep] = None  # built on first use, per KV pool
        self._decode_step_caches = None

    @torch.inference_mode()
    def load_weights(self, state: dict[str, torch.Tensor], quantization: Optional[str] = None) -> None:
        """Copy a Hugging Face-named float32 state dict in, fusing q/k/v and gate/up
        (:func:`load_decoder_weights`).

        Raises:
            ModelLoadError: when a tensor is missing or has the wrong shape.
        """
        self._decode_step, self._decode_step_caches = None, None
        load_decoder_weights(self, state, quantization)

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
            ``[S, vocab_size]`` logits in the model dtype (the sampler upcasts what it needs to
            float32; a greedy step reads bf16 logits as they are); None on a rank other than
            ``logits_dst`` when that is set.
        """
        h = self.embed_tokens(input_ids)
        T = h.shape[0]
        if (not meta.prefills and 0 < T == meta.num_decode_tokens == logits_indices.shape[0]
                and meta.decode_block_tables is not None and not meta.kv_probes):
            # Decode-only step where every token samples (logits_indices is then 0..T-1); not when
            # a KV compression records attention probabilities (the layers' path computes them).
            step = self._get_decode_step(kv_caches, T)
            if step is not None:
                return step(h, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                            meta.decode_max_context_len)
        residual = None
        rope_inputs = self.rotary_emb.prepare(positions)
        for layer, kv in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, rope_inputs, kv, meta)
        h, _ = self.norm(h[logits_indices], residual[logits_indices])
        return self.lm_head(h)

    def _get_decode_step(self, kv_caches, num_tokens: int) -> Optional[cpu_ops.DecodeStep]:
        """The one-call C decode step, when it computes exactly what the modules would: fused CPU
        ops and C attention, and every linear layer on the gemv kernel (or, above its limit, the
        tile kernel: AMX or AVX512-BF16) for ``num_tokens`` rows."""
        if not self.fused_cpu_ops or not isinstance(self.attn_backend, CPUPagedAttentionBackend) or self.tp_size > 1:
            return None  # (the C step has no collectives: tensor parallelism runs the modules)
        if isinstance(kv_caches[0][0], LowBitPool):
            return None  # (2-/4-bit pools: the layers' path writes them in PyTorch; kv_quant_lowbit)
        if self._decode_step_caches is not kv_caches:  # first use, new KV pool or new weights
            self._decode_step, self._decode_step_caches = None, kv_caches
            lins = [self.lm_head] + [m for layer in self.layers for m in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            k = cpu_kernels()
            head = self.lm_head
            float_head = (head.qpacked is None and not head.is_quantized and head.weight is not None
                          and head.weight.is_cpu and k is not None)  # (e.g. int4: linears quantized, head not)
            quantized = all(lin.qpacked is not None for lin in lins[1:])
            if float_head and quantized and linear.Linear._gemv_limit(head.requested_backend, head.weight):
                # The quantized step runs a float head on the gemv kernel (a dense descriptor) for
                # every batch it takes; the head's module path then does too, so that both give
                # the same logits, rather than the head's own gemv limit (small, or 0 where the
                # tile kernel takes it) capping the step.
                head._gemv_max_m = max(head._gemv_max_m, min(lin._gemv_max_m for lin in lins[1:]))
            gemv_max = min(lin._gemv_max_m for lin in lins)
            if quantized and (head.qpacked is not None or float_head) and gemv_max:
                self._decode_step = self._gguf_decode_step(lins, kv_caches, gemv_max)
                return self._decode_step if num_tokens <= gemv_max else None
            if k is None or any(lin.is_quantized for lin in lins):
                return None
            # Above the gemv limit (0 on CPUs without AMX: from one token) the linears run on the
            # tile kernel (when every one of them has its packed weight), as Linear.forward would
            # for up to TILE_MAX_M_BF16 tokens.
            use_tiles = all(lin._tiles is not None for lin in lins)
            if gemv_max == 0 and not use_tiles:
                return None
            gemv = k.bf16 if self.dtype == torch.bfloat16 else k.f32
            layers = []
            for layer, (kc, vc) in zip(self.layers, kv_caches):
                a, m = layer.self_attn, layer.mlp
                layers.append(dict(
                    ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                    qkv_w=a.qkv_proj.weight, qkv_b=a.qkv_proj.bias, o_w=a.o_proj.weight,
                    q_norm=None if a.q_norm is None else a.q_norm.weight,
                    k_norm=None if a.k_norm is None else a.k_norm.weight,
                    gu_w=m.gate_up_proj.weight, down_w=m.down_proj.weight, k_cache=kc, v_cache=vc,
                    qkv_p=a.qkv_proj._tiles, o_p=a.o_proj._tiles, gu_p=m.gate_up_proj._tiles,
                    down_p=m.down_proj._tiles))
            self._decode_step = cpu_ops.DecodeStep(
                layers, self.norm.weight, self.lm_head.weight, self.rotary_emb.cos_table, self.rotary_emb.sin_table,
                gemv, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.rms_norm_eps,
                max_tokens=linear.TILE_MAX_M_BF16 if use_tiles else gemv_max, gemv_max_tokens=gemv_max,
                amx=k.tile_linear if use_tiles else None, lm_head_packed=self.lm_head._tiles,
                window=self.cfg.uniform_window)
        step = self._decode_step
        return step if step is not None and num_tokens <= step.max_tokens else None

    def _gguf_decode_step(self, lins, kv_caches, gemv_max: int) -> cpu_ops.DecodeStep:
        """The C decode step over GGUF-quantized (or int4) linears: each weight is a
        ``kv_qweight_t`` descriptor and ``kv_q_gemv`` the gemv (the kernel ``Linear`` calls for
        these batches); a float LM head is a dense descriptor over the gemv kernel
        (:func:`~kvserve.worker.layers.quant.dense_descriptor`), as ``Linear`` runs it for up to
        ``gemv_max`` tokens."""
        k = cpu_kernels()
        desc = {id(lin): gemv_descriptor(lin.qpacked, lin.bias_f32, self.dtype, lin.int8_activations)
                if lin.qpacked is not None else
                dense_descriptor(lin.weight, lin.bias, k.bf16 if self.dtype == torch.bfloat16 else k.f32)
                for lin in lins}
        layers = []
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            a, m = layer.self_attn, layer.mlp
            layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv_w=desc[id(a.qkv_proj)], qkv_b=None, o_w=desc[id(a.o_proj)],
                q_norm=None if a.q_norm is None else a.q_norm.weight,
                k_norm=None if a.k_norm is None else a.k_norm.weight,
                gu_w=desc[id(m.gate_up_proj)], down_w=desc[id(m.down_proj)], k_cache=kc, v_cache=vc))
        step = cpu_ops.DecodeStep(
            layers, self.norm.weight, desc[id(self.lm_head)], self.rotary_emb.cos_table, self.rotary_emb.sin_table,
            q_kernels().gemv, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.rms_norm_eps,
            max_tokens=gemv_max, window=self.cfg.uniform_window,
            shapes=(self.dtype, self.lm_head.out_features, self.cfg.intermediate_size // self.tp_size),
            gemv_rows=q_kernels().gemv_rows)
        step._keep_desc = (desc, lins)  # (the descriptors point into the layers' packed weights)
        return step


@torch.inference_mode()
def load_decoder_weights(model: nn.Module, state: dict[str, torch.Tensor], quantization: Optional[str] = None):
    """Load the weights every Llama-style decoder shares: embeddings, final norm, LM head (tied
    or not), and per layer the input and post-attention norms, q/k/v fused into ``qkv_proj``
    (with biases when ``attention_bias``), ``o_proj``, q/k norms (``qk_norm``), gate/up fused
    into ``gate_up_proj`` and ``down_proj``. Each tensor-parallel layer keeps this rank's shard
    of the full checkpoint tensors (its ``weight_loader``); the norms are replicated.

    Args:
        model: has ``cfg``, ``dtype``, ``device``, ``tp_rank``, ``tp_size``, ``logits_dst``,
            ``embed_tokens`` (a :class:`VocabParallelEmbedding`), ``norm``, ``lm_head`` and
            ``layers`` (each with ``input_layernorm``, ``post_attention_layernorm``,
            ``self_attn`` and ``mlp`` as in :class:`LlamaDecoderLayer`).
        state: Hugging Face names -> float32 tensors (the whole model's).

    Returns:
        ``put(param, name)``: copies ``state[name]`` into ``param`` after a shape check, for
        the tensors a model has beyond these.

    Raises:
        ModelLoadError: a tensor is missing (:func:`kvserve.worker.loader.iter_layer_names`), has the
            wrong shape, or belongs to a layer beyond ``num_layers``.
    """
    from kvserve.worker.loader import ModelLoadError, iter_layer_names

    cfg = model.cfg
    missing = [n for n in iter_layer_names(cfg) if n not in state]
    if missing:
        raise ModelLoadError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
    dt, dev = model.dtype, model.device
    tp = dict(dtype=dt, device=dev, tp_rank=model.tp_rank, tp_size=model.tp_size)

    def check(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = state[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{name}: expected shape {tuple(shape)} (from the model config), got "
                                 f"{tuple(t.shape)}")
        return t

    def put(param: torch.Tensor, name: str):
        t = check(name, param.shape)
        param.copy_(t.dequantize() if isinstance(t, GGUFWeight) else t)

    beyond = sorted(n for n in state if n.startswith("model.layers.")
                    and n.split(".")[2].isdigit() and int(n.split(".")[2]) >= cfg.num_layers)
    if beyond:
        raise ModelLoadError(f"the weights have layers beyond the config's num_hidden_layers="
                             f"{cfg.num_layers} (e.g. {beyond[0]!r})")
    H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, KV = cfg.num_heads * hd, cfg.num_kv_heads * hd

    model.embed_tokens.weight_loader(check("model.embed_tokens.weight", (V, H)))
    put(model.norm.weight, "model.norm.weight")
    # the LM head is int8-quantized never, GGUF-quantized when its (or the tied embedding's) tensor is
    head = ParallelLMHead(V, H, gather_dst=model.logits_dst, **tp)
    if quantization in ("gguf", "gguf_int8"):
        head.quantization = quantization  # (which GGUF kernel, for a head kept quantized)
    if cfg.tie_word_embeddings:
        head.tie_weights(model.embed_tokens)  # the same values: one copy (vocab x hidden) for both
    else:
        head.weight_loader(check("lm_head.weight", (V, H)))
    model.lm_head = head
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_layernorm.weight, p + "input_layernorm.weight")
        put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        a = layer.self_attn
        expect = [Q, KV, KV]
        ws = [check(p + f"self_attn.{n}_proj.weight", (e, H)) for n, e in zip("qkv", expect)]
        bias = ([check(p + f"self_attn.{n}_proj.bias", (e,)) for n, e in zip("qkv", expect)]
                if cfg.attention_bias else None)
        a.qkv_proj = QKVParallelLinear(H, hd, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
                                       quantization=quantization, **tp)
        a.qkv_proj.weight_loader(ws, bias)
        a.o_proj = RowParallelLinear(Q, H, quantization=quantization, **tp)
        a.o_proj.weight_loader(check(p + "self_attn.o_proj.weight", (H, Q)))
        if cfg.qk_norm:
            put(a.q_norm.weight, p + "self_attn.q_norm.weight")
            put(a.k_norm.weight, p + "self_attn.k_norm.weight")
        m = layer.mlp
        m.gate_up_proj = MergedColumnParallelLinear(H, [I, I], quantization=quantization, **tp)
        m.gate_up_proj.weight_loader([check(p + "mlp.gate_proj.weight", (I, H)), check(p + "mlp.up_proj.weight", (I, H))])
        m.down_proj = RowParallelLinear(I, H, quantization=quantization, **tp)
        m.down_proj.weight_loader(check(p + "mlp.down_proj.weight", (H, I)))
    return put
