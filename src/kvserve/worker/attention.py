"""Paged attention: write new K/V into their slots, attend over each request's context.

The backend interface is small on purpose (:class:`AttentionBackend`): the model calls
``forward(q, k, v, k_cache, v_cache, meta)`` once per layer. The PyTorch backend here runs
anywhere (CPU or CUDA) on ``torch.nn.functional.scaled_dot_product_attention``; a GPU kernel
(FlashAttention, FlashInfer) can replace it behind the same interface.

Batch layout (built once per step by the model runner, shared by all layers): the step's
tokens are flattened into one batch of ``T`` tokens. Decode rows (one new token each) come
first and are attended together, padded to the longest context with a mask; each prefill
chunk (several new tokens of one request) is attended on its own, causally, over its
already-computed context plus the chunk.

8-bit KV caches (``kv_cache_dtype``, :mod:`kvserve.worker.kv_quant`): K/V are quantized as they are
written and every read dequantizes them (codes · scale, rounded to the model dtype); prefill
chunks then attend to their own K/V as read back from the cache, like later chunks would.
2-/4-bit KV caches (KIVI, :mod:`kvserve.worker.kv_quant_lowbit`): the layer's pools are
:class:`~kvserve.worker.kv_quant_lowbit.LowBitPool` s; rows go to their block's residual slot (model
dtype) and a block is quantized when the step fills it; reads take full blocks dequantized and
partial blocks from their residual slot (:func:`read_cache`), prefill chunks included.

GQA: K/V keep ``num_kv_heads`` heads; SDPA's ``enable_gqa`` maps each group of query heads
to its KV head, so repeated KV is never materialised.

Sliding windows (Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023; Gemma 3's local layers):
``forward(..., window=W)`` lets the query at position p see only the keys in ``(p - W, p]``,
and no path reads a key before that: the C decode kernel starts its block-table walk at the
window's first block (:func:`kvserve.kernels.cpu_ops.paged_attention_decode`), SDPA decode
gathers only the last ``W`` positions of each row (:func:`decode_window_context`), and SDPA
prefill only the context from ``num_past - W + 1`` on. So a model whose every layer is windowed
can have the blocks before the window freed (their table entries are then -1,
:data:`kvserve.core.kv_cache_manager.FREED_BLOCK`; :class:`kvserve.core.kv_cache_manager.KVCacheManager`), and a windowed
layer reads ``W`` tokens of K/V per decode row whatever the context length. Windowed prefill
runs on SDPA with a banded mask (built once per step, window and chunk, shared by the layers)
also where the C prefill kernels exist (AMX, AVX512-BF16): they have no window (they could
take one by the decode kernel's start-offset logic), and prefill is bound by compute, not by
reading the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvserve.worker import kv_quant
from kvserve.worker import kv_quant_lowbit
from kvserve.worker.kv_quant_lowbit import LowBitPool
from kvserve.kernels import cpu_ops


@dataclass
class PrefillSegment:
    """One request's chunk of new tokens in the flattened batch.

    Attributes:
        start, end: token range ``[start, end)`` of the chunk in the batch.
        num_past: tokens of this request already in the KV cache before the chunk.
        context_slots: ``[num_past + (end - start)]`` int64, the cache slot of every context
            token (None when ``num_past == 0``: the chunk's own K/V are used directly).
        causal_mask: ``[end - start, num_past + (end - start)]`` bool, True where attention
            is allowed (None when ``num_past == 0``).
    """

    start: int
    end: int
    num_past: int
    context_slots: Optional[torch.Tensor] = None
    causal_mask: Optional[torch.Tensor] = None


@dataclass
class KVProbe:
    """Query rows of one request whose attention probabilities feed its KV compression scores
    (:mod:`kvserve.worker.kv_compressor`: SnapKV's observation window, H2O's every query).

    Attributes:
        request_id: the request.
        rows: ``[m]`` int64 rows of the batch (query tokens).
        query_kv: ``[m]`` int64 KV index of each row's own token: row i attends to KV indices
            ``0 .. query_kv[i]`` (causal).
        context_slots: ``[c]`` int64 cache slots of KV indices ``0 .. c - 1`` (``c = max(query_kv) + 1``).
        num_dropped: the request's ``num_dropped_tokens`` (a KV index's position is index + it,
            for tokens after its last compaction).
        verify: a row of a verification (speculative decoding: the request's last token or a
            draft), whose scores count only if its token is accepted.
        num_cached: the request's KV tokens cached before this step (the KV index of its first
            row this step, probed or not).
    """

    request_id: str
    rows: torch.Tensor
    query_kv: torch.Tensor
    context_slots: torch.Tensor
    num_dropped: int = 0
    verify: bool = False
    num_cached: int = 0


#: Query rows per block when a probe's probabilities are computed (bounds the ``[KVH, g, m, c]``
#: float32 temporary of a long prompt).
PROBE_ROWS = 256


def record_kv_probes(q: torch.Tensor, k_cache: torch.Tensor, meta: "AttentionMetadata", scale: float,
                     k: Optional[torch.Tensor] = None) -> None:
    """For each probe of ``meta.kv_probes``, the column sums of its rows' attention probabilities,
    per KV head: ``softmax(q·kᵀ · scale)`` over the causal context, in float32, summed over the rows
    and over the query heads of each KV head's group → ``[num_kv_heads, c]``; appended (one list
    per layer, one tensor per probe) to ``meta.derived["kv_probe"]``. Called by every backend once
    per layer, after the step's K/V are written (so keys are read from the cache, 8-bit ones
    dequantized). On the CPU with bf16 models where the AVX512-BF16 kernels run, one C call per probe
    and layer (:func:`kvserve.kernels.cpu_ops.probe_colsum`: bf16 products, float32 softmax);
    elsewhere PyTorch in float32, ``PROBE_ROWS`` query rows at a time.

    2-/4-bit pools (:class:`~kvserve.worker.kv_quant_lowbit.LowBitPool`): the keys each query
    attended (:func:`prefill_lowbit`, the decode kernels): the query at KV index ``p`` sees the
    rows of its own block in the model dtype (this step's ``k``, or the block's residual slot for
    rows of earlier steps) unless ``p`` is the block's last slot, and every other key as
    :func:`read_cache` reads it (full blocks dequantized); the logits of both copies are computed
    and chosen per query and key.

    Args:
        q: ``[T, num_heads, head_dim]`` the layer's queries (after RoPE).
        k_cache: the layer's K pool.
        meta: the step's metadata.
        scale: the softmax scale.
        k: ``[T, num_kv_heads, head_dim]`` the step's keys (model dtype); needed for 2-/4-bit pools.

    Raises:
        ValueError: a 2-/4-bit pool without ``k``.
    """
    lowbit = isinstance(k_cache, LowBitPool)
    if lowbit and k is None:
        raise ValueError("record_kv_probes: k (the step's keys) is required with a 2-/4-bit K pool")
    out = []
    H = q.shape[1]
    read = _probe_keys(q, k_cache, meta, k, lowbit)
    for p in meta.kv_probes:
        c = p.context_slots.shape[0]
        ks, b0, kf = read[p.request_id]
        ks = ks[:c]  # [c, KVH, hd]
        if lowbit:
            kf = kf[: c - b0]  # [c - b0, KVH, hd] model-dtype rows from b0
        _, KVH, hd = ks.shape
        if q.is_cpu and cpu_ops.probe_colsum_supported(q.dtype, H, KVH, hd):
            out.append(_probe_colsum_c(q, ks, kf if lowbit else None, b0 if lowbit else 0,
                                       k_cache.block_size if lowbit else 0, p, scale))
            continue
        ks = ks.float()
        if lowbit:
            kf = kf.float()
        g = H // KVH
        sums = torch.zeros(KVH, c, dtype=torch.float32, device=q.device)
        cols = torch.arange(c, device=q.device)
        for r0 in range(0, p.rows.shape[0], PROBE_ROWS):
            rows, qkv = p.rows[r0 : r0 + PROBE_ROWS], p.query_kv[r0 : r0 + PROBE_ROWS]
            qs = q.index_select(0, rows).float().view(-1, KVH, g, hd)  # [m, KVH, g, hd]
            logits = torch.einsum("mkgd,ckd->kgmc", qs, ks) * scale
            if lowbit:
                bs = k_cache.block_size
                jf = cols[b0:].unsqueeze(0)  # [1, c - b0]
                own = (jf // bs == (qkv // bs).unsqueeze(1)) & (qkv % bs != bs - 1).unsqueeze(1)  # [m, c - b0]
                lf = torch.einsum("mkgd,ckd->kgmc", qs, kf) * scale
                logits[..., b0:] = torch.where(own.view(1, 1, *own.shape), lf, logits[..., b0:])
            logits.masked_fill_((cols.unsqueeze(0) > qkv.unsqueeze(1)).view(1, 1, -1, c), float("-inf"))
            sums += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
        out.append(sums)
    meta.derived.setdefault("kv_probe", []).append(out)


def _probe_keys(q: torch.Tensor, k_cache: torch.Tensor, meta: "AttentionMetadata", k: Optional[torch.Tensor],
                lowbit: bool) -> dict:
    """request id -> ``(ks, b0, kf)``: the keys its probes read, read once per request (a
    verification's rows are a probe each, their contexts prefixes of the longest): ``ks`` ``[c,
    KVH, hd]`` the context as read (8-bit keys dequantized; 2-/4-bit full blocks dequantized), and
    for 2-/4-bit pools ``kf`` the model-dtype keys from KV index ``b0``, the block of the request's
    first probed query (:func:`_probe_own_keys`; ``None``, 0 otherwise)."""
    groups: dict[str, list[KVProbe]] = {}
    for p in meta.kv_probes:
        groups.setdefault(p.request_id, []).append(p)
    read = {}
    for rid, ps in groups.items():
        longest = max(ps, key=lambda p: p.context_slots.shape[0])
        if not lowbit:
            read[rid] = (kv_quant.gather(k_cache, longest.context_slots, q.dtype), 0, None)
            continue
        merged = ps[0] if len(ps) == 1 else KVProbe(
            request_id=rid, rows=torch.cat([p.rows for p in ps]), query_kv=torch.cat([p.query_kv for p in ps]),
            context_slots=longest.context_slots, num_dropped=longest.num_dropped)
        read[rid] = (read_cache(k_cache, longest.context_slots, q.dtype, meta),
                     *_probe_own_keys(k, k_cache, meta, merged))
    return read


def _probe_colsum_c(q: torch.Tensor, ks: torch.Tensor, kf: Optional[torch.Tensor], b0: int, bs: int, p: KVProbe,
                    scale: float) -> torch.Tensor:
    """:func:`record_kv_probes` of one probe on the C kernel (:func:`kvserve.kernels.cpu_ops.probe_colsum`):
    ``ks`` the context as read (source D), ``kf`` (2-/4-bit pools) the model-dtype keys from KV
    index ``b0`` (source F, its own block's rows for a query not at a block's last slot, as
    :func:`prefill_lowbit` reads them). ``[KVH, c]`` float32."""
    c, KVH, hd = ks.shape
    qkv = p.query_kv
    end = qkv + 1
    if kf is None:
        kf = ks.new_empty((0, KVH, hd))
        ranges = torch.stack([end, torch.zeros_like(end), torch.zeros_like(end)], 1)
    else:
        start = qkv // bs * bs
        fp = qkv % bs != bs - 1  # its block's rows in the model dtype
        ranges = torch.stack([torch.where(fp, start, end), torch.where(fp, start - b0, 0),
                              torch.where(fp, end - b0, 0)], 1)
    return cpu_ops.probe_colsum(q.index_select(0, p.rows), ks.contiguous(), kf.contiguous(), ranges.contiguous(),
                                scale, c, b0)


def _probe_own_keys(k: torch.Tensor, k_cache: LowBitPool, meta: "AttentionMetadata",
                    p: KVProbe) -> tuple[int, torch.Tensor]:
    """``(b0, [c - b0, KVH, hd] model dtype)``: the model-dtype keys of KV indices ``b0 .. c - 1``,
    ``b0`` the first position of the block of the probe's first query: a row this step computed
    from ``k`` (found by its slot: the request's rows are consecutive in the batch), an earlier
    one from its block's residual slot (the step's raw residual map; a block partly written
    before the step has one)."""
    bs = k_cache.block_size
    c = p.context_slots.shape[0]
    b0 = int(p.query_kv.min()) // bs * bs
    slots = p.context_slots[b0:]
    br = p.rows[0] + torch.arange(b0, c, device=slots.device) - p.query_kv[0]  # batch row if computed now
    T = meta.slot_mapping.shape[0]
    now = (br >= 0) & (br < T)
    now &= meta.slot_mapping.index_select(0, br.clamp(0, T - 1)) == slots
    kf = kv_quant_lowbit.gather(k_cache, slots, meta.residual_map, k.dtype)  # earlier rows: their slot
    kf[now] = k.index_select(0, br[now])
    return b0, kf


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64; token i's K/V go to flat slot ``slot_mapping[i]``
            (``block_id · block_size + offset``).
        num_decode_tokens: the first ``num_decode_tokens`` tokens are decodes, one per request.
        decode_context_slots: ``[num_decode_tokens, max_context]`` int64 slots of each decode
            request's context (padding points at slot 0 and is masked).
        decode_mask: ``[num_decode_tokens, 1, 1, max_context]`` bool, True for real context.
        decode_block_tables: ``[num_decode_tokens, max_blocks]`` int64 block table of each
            decode request (padded with block 0).
        decode_context_lens: ``[num_decode_tokens]`` int64 context length of each decode
            request, including its new token.
        decode_max_context_len: ``max(decode_context_lens)``.
        prefills: the prefill chunks, in batch order after the decodes.
        prefill_block_tables: ``[P, max_blocks]`` int64 block table of each prefill chunk's
            request (padded with block 0); built when the backend reads block tables.
        prefill_chunks: ``[P, 3]`` int64 (first row in the batch, tokens, ``num_past``) per chunk;
            built with ``prefill_block_tables``.
        derived: per-step values the backends build lazily and share across layers (window
            masks, gathered decode slots); keyed by the backend.
        kv_probes: query rows whose attention probabilities feed KV compression scores
            (:class:`KVProbe`, :func:`record_kv_probes`); empty for most steps.
        residual_map: 2-/4-bit pools: ``[num_blocks]`` int64, the KV manager's ``block → residual
            slot`` (-1: none; :class:`kvserve.core.kv_cache_manager.ResidualSlots`); None otherwise.

    A backend says which decode inputs it reads (:attr:`AttentionBackend.uses_context_slots`);
    the model runner builds only those.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_context_slots: Optional[torch.Tensor] = None
    decode_mask: Optional[torch.Tensor] = None
    decode_block_tables: Optional[torch.Tensor] = None
    decode_context_lens: Optional[torch.Tensor] = None
    decode_max_context_len: int = 0
    prefills: list[PrefillSegment] = field(default_factory=list)
    prefill_block_tables: Optional[torch.Tensor] = None
    prefill_chunks: Optional[torch.Tensor] = None
    derived: dict = field(default_factory=dict)
    kv_probes: list[KVProbe] = field(default_factory=list)
    residual_map: Optional[torch.Tensor] = None


class AttentionBackend:
    """Interface of an attention implementation over the paged KV cache.

    Attributes:
        uses_context_slots: True if decode reads ``decode_context_slots``/``decode_mask``
            (gathered slots); False if it reads ``decode_block_tables``/``decode_context_lens``.
    """

    uses_context_slots: bool = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` in the cache and attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (model dtype).
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model
                dtype, or 8-bit pools (``torch.int8``/``torch.float8_e4m3fn``, ``head_dim + 4``
                last: :mod:`kvserve.worker.kv_quant`), which the backend quantizes into and reads
                dequantized (both backends do).
            meta: the step's :class:`AttentionMetadata`.
            scale: softmax scale (usually ``head_dim ** -0.5``).
            window: sliding window in tokens (the query at position p sees keys in
                ``(p - window, p]``), or None for full causal attention.

        Returns:
            ``[T, num_heads, head_dim]`` attention output.
        """
        raise NotImplementedError


#: SDPA kernels the PyTorch backend may use on CUDA: all but cuDNN's. PyTorch 2.11 sends a
#: masked bf16 SDPA on an H200 to cuDNN, which builds a new cuDNN graph for every new context
#: length, i.e. at every decode step (measured: single-stream decode of SmolLM2's shapes at
#: 14 tokens/s in bf16 against 35 in float32, which does not use cuDNN).
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class TorchSDPABackend(AttentionBackend):
    """Pure-PyTorch paged attention on ``F.scaled_dot_product_attention`` (CPU and CUDA; on CUDA
    restricted to :data:`CUDA_SDPA_BACKENDS`)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        if q.is_cuda:
            with sdpa_kernel(list(CUDA_SDPA_BACKENDS)):
                return self._forward(q, k, v, k_cache, v_cache, meta, scale, window)
        return self._forward(q, k, v, k_cache, v_cache, meta, scale, window)

    def _forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.residual_map)
        out = torch.empty_like(q)
        if meta.num_decode_tokens:
            self.decode(q, k_cache, v_cache, meta, scale, out, window)
        self.prefill(q, k, v, k_cache, v_cache, meta, scale, out, window)
        if meta.kv_probes:
            if isinstance(k_cache, LowBitPool):
                record_kv_probes(q, k_cache, meta, scale, k=k)
            else:
                record_kv_probes(q, k_cache, meta, scale)
        return out

    @staticmethod
    def decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
               window: Optional[int] = None) -> None:
        """SDPA of the decode rows over their gathered context, written into ``out[:num_decode_tokens]``.

        Reads ``decode_context_slots``/``decode_mask``, or builds them from the block tables
        (:func:`decode_context`) when the model runner built only those. 8-bit pools are
        dequantized to ``q.dtype`` as they are gathered.
        """
        nd = meta.num_decode_tokens
        if window is not None and meta.decode_block_tables is not None:
            slots, mask = decode_window_context(meta, k_cache.shape[1], window)
        else:
            slots, mask = decode_context(meta, k_cache.shape[1])
            if window is not None:
                mask = decode_window_mask(meta, mask, window)
        # [D, L, KVH, hd] -> [D, KVH, L, hd]; index_select is much cheaper than
        # advanced indexing for these small gathers.
        kc = read_cache(k_cache, slots, q.dtype, meta).transpose(1, 2)
        vc = read_cache(v_cache, slots, q.dtype, meta).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [D, H, 1, hd]
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)

    @staticmethod
    def prefill(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                window: Optional[int] = None) -> None:
        """Causal SDPA for each prefill chunk of ``meta``, written into ``out`` (K/V already cached).

        A chunk without cached context attends to its own ``k``/``v`` as computed; with an
        8-bit pool it reads them back from the cache instead (dequantized), so that a prompt
        sees the same K/V whether it is prefilled in one chunk or several. With ``window``, a
        chunk whose context spans more than the window gets a banded mask
        (:func:`prefill_window_mask`) and gathers only the context its first token's window
        starts at (positions from ``num_past - window + 1``: earlier blocks may be freed).
        """
        if isinstance(k_cache, LowBitPool):
            for seg in meta.prefills:
                out[seg.start : seg.end] = prefill_lowbit(q, k, v, k_cache, v_cache, meta, seg, scale, window)
            return
        quantized = kv_quant.is_quantized(k_cache)
        for i, seg in enumerate(meta.prefills):
            qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            windowed = window is not None and seg.num_past + (seg.end - seg.start) > window
            lo = max(0, seg.num_past - window + 1) if windowed else 0  # first context position any query sees
            if seg.num_past == 0 and not quantized:
                ks = k[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
                vs = v[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            else:
                slots = seg.context_slots[lo:] if seg.num_past else meta.slot_mapping[seg.start : seg.end]
                ks = read_cache(k_cache, slots, q.dtype, meta).transpose(0, 1).unsqueeze(0)
                vs = read_cache(v_cache, slots, q.dtype, meta).transpose(0, 1).unsqueeze(0)
            if windowed:
                mask = prefill_window_mask(meta, i, window, q.device)[:, lo:]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            elif seg.num_past == 0:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=seg.causal_mask, scale=scale, enable_gqa=True
                )
            out[seg.start : seg.end] = o.squeeze(0).transpose(0, 1)


def read_map(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """The step's residual map for readers (:func:`kvserve.worker.kv_quant_lowbit.read_map`: the
    blocks the step fills read quantized), built once per step."""
    key = ("lowbit_read_map",)
    if key not in meta.derived:
        meta.derived[key] = kv_quant_lowbit.read_map(meta.residual_map, meta.slot_mapping, block_size)
    return meta.derived[key]


def read_cache(cache, slots: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata) -> torch.Tensor:
    """K or V of ``slots`` ``[...]`` → ``[..., num_kv_heads, head_dim]`` in ``dtype``: gathered as
    stored, 8-bit rows dequantized (:func:`kvserve.worker.kv_quant.gather`), or 2-/4-bit blocks
    dequantized / read from their residual slot (:func:`kvserve.worker.kv_quant_lowbit.gather`)."""
    if isinstance(cache, LowBitPool):
        return kv_quant_lowbit.gather(cache, slots, read_map(meta, cache.block_size), dtype)
    return kv_quant.gather(cache, slots, dtype)


def prefill_lowbit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: LowBitPool, v_cache: LowBitPool,
                   meta: AttentionMetadata, seg: PrefillSegment, scale: float,
                   window: Optional[int] = None, kernel: bool = False) -> torch.Tensor:
    """Causal attention of one prefill chunk (or of a speculative verification's rows that fill a
    block: :mod:`kvserve.worker.model_runner`) over 2-/4-bit pools (K/V already written), with the
    keys each query would see had it been decoded alone, so that a token's K/V never depend on
    how its prompt was chunked: the query at position ``p`` sees the blocks before its own
    dequantized, and its own block's rows ``<= p`` in the model dtype (the residual), except when
    ``p`` is the block's last slot (the step that computes ``p`` fills and quantizes the block:
    then dequantized, as :func:`kvserve.worker.kv_quant_lowbit.read_map` makes a decode step see it).

    Keys: the context ``[0, num_past + n)`` as :func:`read_cache` reads it (full blocks dequantized,
    the trailing partial block from its residual slot), then the model-dtype rows of the blocks the
    chunk touches (the first block's earlier rows from its residual slot, the chunk's own ``k``/``v``);
    a boolean mask picks, per query, which copy of each key it sees. With ``window``, the query at
    ``p`` sees keys ``(p - window, p]`` only, and the context is read from the first block the
    chunk's first query sees (earlier blocks may be freed).

    With ``kernel`` (the C backend), no window and :func:`kvserve.kernels.cpu_ops.prefill_ranges_supported`,
    the attention runs in one call of :func:`kvserve.kernels.cpu_ops.prefill_ranges`, which takes
    per query the range of each copy it sees (context keys before its own block, or up to itself;
    then its own block's model-dtype rows) instead of SDPA over both copies with a mask: causal
    work only (SmolLM2's shapes, a 2,048-token chunk after 0 / 2,048 / 6,144 tokens, the
    2-core machine under load: 2.5-3.4x faster than SDPA, 6.7x at 0 once the context is
    dequantized in C). Same keys, the bf16 prefill kernel's rounding.

    Returns:
        ``[n, num_heads, head_dim]`` (``n = seg.end - seg.start``).
    """
    bs = k_cache.block_size
    n, past = seg.end - seg.start, seg.num_past
    L = past + n
    dev = q.device
    lo = max(0, past - window + 1) // bs * bs if window is not None else 0  # first context position read
    slots = seg.context_slots[lo:] if past else meta.slot_mapping[seg.start : seg.end]
    kq = read_cache(k_cache, slots, q.dtype, meta)  # [L - lo, KVH, hd]
    vq = read_cache(v_cache, slots, q.dtype, meta)
    b0 = past // bs * bs  # first position of the chunk's first block
    if past > b0:  # its earlier rows: the residual slot (the raw map: the block may fill now)
        own = slots[b0 - lo : past - lo]
        kf = torch.cat([kv_quant_lowbit.gather(k_cache, own, meta.residual_map, q.dtype), k[seg.start : seg.end]])
        vf = torch.cat([kv_quant_lowbit.gather(v_cache, own, meta.residual_map, q.dtype), v[seg.start : seg.end]])
    else:
        kf, vf = k[seg.start : seg.end], v[seg.start : seg.end]
    p = torch.arange(past, L, device=dev).unsqueeze(1)  # [n, 1] query positions
    if kernel and window is None and cpu_ops.prefill_ranges_supported(q.dtype, q.shape[1], k.shape[1], q.shape[2]):
        # one kernel call: the query at p sees the context before its own block, then that
        # block's rows up to p in the model dtype; at the block's last slot the context up to p
        # (its block dequantized). A trailing partial block's rows are the same values in both
        # copies: taking them from the model-dtype copy too makes a row's arithmetic independent
        # of where its chunk ends (bit for bit, for block sizes that divide 64 in multiples of 16)
        start = p // bs * bs
        fp = p % bs != bs - 1
        ranges = torch.cat([torch.where(fp, start, p + 1), torch.where(fp, start - b0, 0),
                            torch.where(fp, p + 1 - b0, 0)], 1)
        return cpu_ops.prefill_ranges(q[seg.start : seg.end], kq.contiguous(), vq.contiguous(), kf.contiguous(),
                                      vf.contiguous(), ranges, scale)
    # the query's own block is sealed by the step computing it (its last slot) or, for the chunk's
    # trailing block, only if the chunk ends at a block boundary: read_cache gives that block's
    # rows from the residual otherwise, which is what the query should see anyway
    own_full = (p % bs == bs - 1) | ((p // bs) < (L - 1) // bs) | (L % bs == 0)
    fp_own = (p % bs != bs - 1) & own_full  # sees its own block in the model dtype, not as read_cache gives it
    j = torch.arange(lo, L, device=dev).unsqueeze(0)  # [1, L - lo]
    jf = torch.arange(b0, L, device=dev).unsqueeze(0)  # [1, L - b0]
    mask_q = (j <= p) & ~((j // bs == p // bs) & fp_own)
    mask_f = (jf <= p) & (jf // bs == p // bs) & fp_own
    if window is not None:
        mask_q &= j > p - window
        mask_f &= jf > p - window
    mask = torch.cat([mask_q, mask_f], 1).unsqueeze(0).unsqueeze(0)  # [1, 1, n, (L - lo) + (L - b0)]
    ks = torch.cat([kq, kf]).transpose(0, 1).unsqueeze(0)
    vs = torch.cat([vq, vf]).transpose(0, 1).unsqueeze(0)
    qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, residual_map: Optional[torch.Tensor] = None) -> None:
    """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]`` (non-negative
    flat slots) in PyTorch ops: copied as they are, or quantized into an 8-bit pool
    (:func:`kvserve.worker.kv_quant.write`), or into 2-/4-bit pools through their residual slots
    (``residual_map``, :func:`kvserve.worker.kv_quant_lowbit.write`)."""
    if isinstance(k_cache, LowBitPool):
        kv_quant_lowbit.write(k_cache, k, slot_mapping, residual_map)
        kv_quant_lowbit.write(v_cache, v, slot_mapping, residual_map)
        return
    if kv_quant.is_quantized(k_cache):
        kv_quant.write(k_cache, k, slot_mapping)
        kv_quant.write(v_cache, v, slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_context(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(decode_context_slots [D, L] int64, decode_mask [D, 1, 1, L] bool)`` of the step: the
    runner's, or (once per step) built from ``decode_block_tables``/``decode_context_lens``.
    """
    if meta.decode_context_slots is not None:
        return meta.decode_context_slots, meta.decode_mask
    key = ("decode_context",)
    if key not in meta.derived:
        bt, ctx_len = meta.decode_block_tables, meta.decode_context_lens
        D, L = bt.shape[0], meta.decode_max_context_len
        bs = block_size
        grid = torch.arange(L, dtype=torch.long, device=bt.device)
        slots = bt.gather(1, (grid // bs).expand(D, -1)) * bs + grid % bs
        valid = grid.unsqueeze(0) < ctx_len.unsqueeze(1)
        meta.derived[key] = (torch.where(valid, slots, 0), valid.view(D, 1, 1, L))
    return meta.derived[key]


def decode_window_context(meta: AttentionMetadata, block_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [D, Wm] int64, mask [D, 1, 1, Wm] bool)`` of the decode rows' windows, built once
    per step and window from ``decode_block_tables``/``decode_context_lens``: row d (context
    ``c_d`` tokens) gets positions ``max(c_d - window, 0) + i`` for ``i < Wm = min(window,
    decode_max_context_len)``, valid where below ``c_d``. No table entry before a row's window is
    read (those blocks may be freed, entry -1); invalid positions point at slot 0 and are masked.
    """
    key = ("decode_window_context", window)
    if key not in meta.derived:
        bt, ctx_len = meta.decode_block_tables, meta.decode_context_lens
        D, Wm = bt.shape[0], min(window, meta.decode_max_context_len)
        pos = (ctx_len - window).clamp(min=0).unsqueeze(1) + torch.arange(Wm, dtype=torch.long, device=bt.device)
        valid = pos < ctx_len.unsqueeze(1)
        pos = torch.where(valid, pos, 0)
        slots = bt.gather(1, pos // block_size) * block_size + pos % block_size
        meta.derived[key] = (torch.where(valid, slots, 0), valid.view(D, 1, 1, Wm))
    return meta.derived[key]


def decode_window_mask(meta: AttentionMetadata, mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask [D, 1, 1, L]`` narrowed to the last ``window`` context positions of each row (the
    new token is at ``context_len - 1``; it sees positions ``>= context_len - window``)."""
    key = ("decode_window", window)
    if key not in meta.derived:
        grid = torch.arange(mask.shape[-1], device=mask.device)
        ctx_len = mask.sum(-1, keepdim=True)  # [D, 1, 1, 1]
        meta.derived[key] = mask & (grid >= ctx_len - window)
    return meta.derived[key]


def prefill_window_mask(meta: AttentionMetadata, index: int, window: int, device) -> torch.Tensor:
    """``[n, num_past + n]`` bool mask of prefill chunk ``index``: causal and within the window
    (query position p sees key positions j with ``p - window < j <= p``; Hugging Face's
    ``sliding_window_overlay``)."""
    key = ("prefill_window", window, index)
    if key not in meta.derived:
        seg = meta.prefills[index]
        n = seg.end - seg.start
        ctx = torch.arange(seg.num_past + n, device=device).unsqueeze(0)
        qpos = torch.arange(seg.num_past, seg.num_past + n, device=device).unsqueeze(1)
        meta.derived[key] = (ctx <= qpos) & (ctx > qpos - window)
    return meta.derived[key]


class CPUPagedAttentionBackend(TorchSDPABackend):
    """CPU backend: the KV write and decode attention run on the fused C kernels of
    :mod:`kvserve.kernels.cpu_ops` (reading K/V through the block tables, no gather, GQA
    without repeating KV; windowed layers read only their window). Prefill chunks run on the C prefill kernel where it applies
    (:func:`kvserve.kernels.cpu_ops.prefill_supported`, bf16 without a window): on AMX tiles
    on AMX CPUs (:func:`kvserve.kernels.cpu_ops.amx_prefill_supported`; ~2x SDPA on SmolLM2's
    prompts in its first version, 1.3x that since), else on AVX512-BF16 dot products
    (:func:`kvserve.kernels.cpu_ops.avx512bf16_prefill_supported`, e.g. AMD Zen 4), and on SDPA as in
    :class:`TorchSDPABackend` otherwise.

    Requires float32/bfloat16 CPU tensors and :func:`kvserve.kernels.cpu_ops.available`.
    """

    uses_context_slots = False

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        if isinstance(k_cache, LowBitPool):
            return self._forward_lowbit(q, k, v, k_cache, v_cache, meta, scale, window)
        cpu_ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        nd = meta.num_decode_tokens
        num_kv_heads, head_dim = k_cache.shape[2], kv_quant.head_dim_of(k_cache)
        if nd:
            cpu_ops.paged_attention_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, scale, out=out[:nd],
                                           max_context_len=meta.decode_max_context_len, window=window)
        if meta.prefills:
            if window is None and meta.prefill_chunks is not None and cpu_ops.prefill_supported(
                    q.dtype, q.shape[1], num_kv_heads, head_dim, k_cache.shape[1]):
                cpu_ops.paged_attention_prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_chunks,
                                                scale, out)
            else:
                self.prefill(q, k, v, k_cache, v_cache, meta, scale, out, window)
        if meta.kv_probes:
            if isinstance(k_cache, LowBitPool):
                record_kv_probes(q, k_cache, meta, scale, k=k)
            else:
                record_kv_probes(q, k_cache, meta, scale)
        return out


    def _forward_lowbit(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
        """2-/4-bit pools: the write in PyTorch, decode rows on the C kernel
        (:func:`kvserve.kernels.cpu_ops.paged_attention_decode_pools`) where it is built, else on
        SDPA; prefill chunks read in PyTorch and attend on :func:`kvserve.kernels.cpu_ops.prefill_ranges`
        where it runs (:func:`prefill_lowbit`), else on SDPA."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.residual_map)
        out = torch.empty(q.shape, dtype=q.dtype)
        nd = meta.num_decode_tokens
        if nd:
            if meta.decode_block_tables is not None and cpu_ops.lowbit_available():
                cpu_ops.paged_attention_decode_pools(
                    q[:nd], k_cache, v_cache, read_map(meta, k_cache.block_size), meta.decode_block_tables,
                    meta.decode_context_lens, scale, out=out[:nd], window=window)
            else:
                self.decode(q, k_cache, v_cache, meta, scale, out, window)
        for seg in meta.prefills:
            out[seg.start : seg.end] = prefill_lowbit(q, k, v, k_cache, v_cache, meta, seg, scale, window, kernel=True)
        if meta.kv_probes:  # (the C kernel returns no probabilities: PyTorch, record_kv_probes)
            record_kv_probes(q, k_cache, meta, scale, k=k)
        return out


def default_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> AttentionBackend:
    """The fastest backend that runs here: :class:`CPUPagedAttentionBackend` on CPU in float32 or
    bfloat16 when the kernels are available and support the shape (``head_dim`` <= 256, at most
    64 query heads per KV head), else :class:`TorchSDPABackend`."""
    if (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.supports_attention_shape(num_heads, num_kv_heads, head_dim) and cpu_ops.available()):
        return CPUPagedAttentionBackend()
    return TorchSDPABackend()
