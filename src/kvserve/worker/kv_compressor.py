"""A worker's side of KV compression (:mod:`kvserve.core.kv_compression`): the attention scores it
keeps per compressed request, and the compactions it applies to its pools.

Scores: for a request under SnapKV or H2O, the model runner marks the query rows whose attention
counts (:class:`~kvserve.worker.attention.KVProbe`: SnapKV's observation window, every H2O query);
each layer's attention adds, per KV head, the column sums of those rows' softmax probabilities
(summed over the group's query heads; :func:`~kvserve.worker.attention.record_kv_probes`), and
:meth:`KVCompressor.accumulate` adds them to the request's ``scores [num_layers, num_kv_heads, n]``
float32 (``n``: its KV length). ``positions [num_layers, num_kv_heads, n]`` int64 keeps each KV
slot's original token position (for inspection and tests: the attention never needs it, keys are
cached after RoPE).

Compaction (:meth:`KVCompressor.compact`, a :class:`~kvserve.core.kv_ops.Compaction`): the kept
KV indices, the same everywhere (StreamingLLM) or per layer and head from the scores
(:func:`~kvserve.core.kv_compression.snapkv_keep`, :func:`~kvserve.core.kv_compression.h2o_keep`),
are gathered from the old slots, then scattered into the first slots of the new table (one gather
and one scatter per layer and K/V; every read happens before a write, so old and new blocks may be
the same); the scores and positions are gathered alike.

2-/4-bit pools (:mod:`kvserve.worker.kv_quant_lowbit`, KIVI): rows cannot move inside packed
blocks, so a compaction is defined on values: per layer, K/V and KV head, each kept token's row
is read as the attention read it (its block dequantized if full, its model-dtype row from the
residual slot if it sat in the sequence's partial last block), rounded to the model dtype; the
kept rows become KV indices ``0 .. k - 1`` of the new table, every new full block is quantized
from its ``block_size`` rows as a filling step would quantize it, and the ``k % block_size`` rows
of a partial last block go into that block's residual slot in the model dtype (the slots travel
in the op: :attr:`~kvserve.core.kv_ops.Compaction.src_residual` and ``dst_residual``). All reads
of a pool happen before its writes. The probes' scores over such pools are the probabilities of
the keys each query attended (:func:`kvserve.worker.attention.record_kv_probes`). A kept token's
key is thus requantized once per compaction it survives (over its new block's tokens: it may move
by up to half that block's scale each time); a value row, whose groups are per token, usually
quantizes back to itself. The result depends only on the request's tokens and selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvserve.core.kv_compression import h2o_keep, snapkv_keep
from kvserve.core.kv_ops import Compaction
from kvserve.worker import kv_quant_lowbit as lb
from kvserve.worker.kv_quant_lowbit import LowBitPool


@dataclass
class ScoreState:
    """One request's scores (see the module docstring)."""

    scores: torch.Tensor  # [L, KVH, n] float32
    positions: torch.Tensor  # [L, KVH, n] int64


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


class KVCompressor:
    """The scores and compactions of one worker.

    Args:
        kv_caches: the worker's pools, per layer ``(K, V)``, each ``[num_blocks, block_size,
            num_kv_heads, row]``.
    """

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0][0].shape[1]
        self.num_kv_heads = kv_caches[0][0].shape[2]
        self.device = kv_caches[0][0].device
        self.states: dict[str, ScoreState] = {}
        self.last_keep: dict[str, torch.Tensor] = {}  # request id -> its last compaction's kept indices [L, KVH, k]
        # request id -> its last verification's rows' (KV index, num_dropped, [L, KVH, c] sums), not yet counted
        self.pending: dict[str, list[tuple[int, int, torch.Tensor]]] = {}

    # ------------------------------------------------------------------ scores
    def accumulate(self, meta) -> None:
        """Add the step's recorded column sums (``meta.derived["kv_probe"]``: per layer, per
        probe ``[KVH, c]``) to each probed request's scores, growing them to its KV length.

        Speculative decoding: a verification's rows (probes marked ``verify``, one row each) are
        kept aside, and counted once the request's KV length shows which were accepted
        (:meth:`settle`: at its next probe, which carries that length, ``num_cached``, or at its
        next compaction): a rejected draft's query never counts, as if the accepted tokens had
        been decoded one at a time."""
        probes = getattr(meta, "kv_probes", None)
        rec = meta.derived.pop("kv_probe", None)
        if not probes or not rec or len(rec) != len(self.kv_caches):
            return
        settled = set()
        for i, p in enumerate(probes):
            if p.request_id not in settled:  # (the step's first probe of the request)
                settled.add(p.request_id)
                self.settle(p.request_id, p.num_cached)
            add = torch.stack([layer[i] for layer in rec])  # [L, KVH, c]
            if p.verify:
                self.pending.setdefault(p.request_id, []).append((int(p.query_kv[-1]), p.num_dropped, add))
            else:
                self._add(p.request_id, add, p.num_dropped)

    def settle(self, request_id: str, num_kv_tokens: int) -> None:
        """Count the request's set-aside verification rows whose KV index is below
        ``num_kv_tokens`` (accepted: their tokens are cached), drop the others (rejected drafts)."""
        for kv_index, num_dropped, add in self.pending.pop(request_id, ()):
            if kv_index < num_kv_tokens:
                self._add(request_id, add, num_dropped)

    def _add(self, request_id: str, add: torch.Tensor, num_dropped: int) -> None:
        c = add.shape[-1]
        st = self.states.get(request_id)
        n = 0 if st is None else st.scores.shape[-1]
        if c > n:
            L, H = add.shape[0], add.shape[1]
            grow = torch.zeros(L, H, c - n, dtype=torch.float32, device=add.device)
            pos = (torch.arange(n, c, dtype=torch.long, device=add.device) + num_dropped).expand(L, H, c - n)
            if st is None:
                st = self.states[request_id] = ScoreState(grow, pos.clone())
            else:
                st.scores = torch.cat([st.scores, grow], -1)
                st.positions = torch.cat([st.positions, pos], -1)
        st.scores[..., :c] += add

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.last_keep.pop(request_id, None)
        self.pending.pop(request_id, None)

    # ------------------------------------------------------------------ compaction
    def select(self, c: Compaction) -> torch.Tensor:
        """``[L, KVH, dst_len]`` int64 kept old KV indices of ``c`` (ascending per layer and head)."""
        L, H = len(self.kv_caches), self.num_kv_heads
        if c.keep is not None:
            return torch.tensor(c.keep, dtype=torch.long, device=self.device).expand(L, H, c.dst_len)
        st = self.states.get(c.request_id)
        scores = torch.zeros(L, H, c.src_len, device=self.device)
        if st is not None:  # (its last tokens' scores: none yet if no query looked at them)
            m = min(st.scores.shape[-1], c.src_len)
            scores[..., :m] = st.scores[..., :m]
        p = c.params
        if c.method == "snapkv":
            return snapkv_keep(scores, c.dst_len, p["observation_window"], p["kernel_size"])
        if c.method == "h2o":
            return h2o_keep(scores, c.dst_len, p["recent"])
        raise ValueError(f"kv_compression.method {c.method!r} has no per-head selection")

    def compact(self, c: Compaction) -> None:
        """Apply ``c`` to the pools and to the request's scores (its verification rows settled
        first: ``c.src_len`` is its KV length)."""
        self.settle(c.request_id, c.src_len)
        bs = self.block_size
        keep = self.select(c)  # [L, KVH, k]
        src_tab = torch.tensor(c.src_table, dtype=torch.long, device=self.device)
        dst_tab = torch.tensor(c.dst_table, dtype=torch.long, device=self.device)
        j = torch.arange(c.dst_len, dtype=torch.long, device=self.device)
        dst_slots = dst_tab[j // bs] * bs + j % bs  # [k]
        src_slots = src_tab[keep // bs] * bs + keep % bs  # [L, KVH, k]
        heads = torch.arange(self.num_kv_heads, device=self.device).unsqueeze(1)  # [KVH, 1]
        uniform = c.keep is not None
        if isinstance(self.kv_caches[0][0], LowBitPool):
            self._compact_lowbit(c, src_tab, dst_tab, src_slots)
        else:
            self._compact_rows(src_slots, dst_slots, heads, uniform)
        st = self.states.get(c.request_id)
        if st is not None:
            m = st.scores.shape[-1]
            if m < c.src_len:  # (tokens no probe has seen yet: no score, position unknown)
                L, H = st.scores.shape[:2]
                st.scores = torch.cat([st.scores, st.scores.new_zeros(L, H, c.src_len - m)], -1)
                st.positions = torch.cat([st.positions, st.positions.new_full((L, H, c.src_len - m), -1)], -1)
            st.scores = st.scores[..., : c.src_len].gather(-1, keep)
            st.positions = st.positions[..., : c.src_len].gather(-1, keep)
        self.last_keep[c.request_id] = keep

    def _compact_lowbit(self, c: Compaction, src_tab: torch.Tensor, dst_tab: torch.Tensor,
                        src_slots: torch.Tensor) -> None:
        """2-/4-bit pools (module docstring): for K, then V, of all layers at once, the kept rows
        read as the queries read them, then requantized into the new full blocks and the partial
        last one's residual slot (:func:`~kvserve.worker.kv_quant_lowbit.gather_heads`,
        :func:`~kvserve.worker.kv_quant_lowbit.store_compacted`); the residual slots are the op's
        (:attr:`Compaction.src_residual`, :attr:`Compaction.dst_residual`)."""
        num_blocks = self.kv_caches[0][0].shape[0]
        rmap = torch.full((num_blocks,), -1, dtype=torch.long, device=self.device)
        if c.src_residual:
            rs = torch.tensor(c.src_residual, dtype=torch.long, device=self.device)
            has = (rs >= 0) & (src_tab >= 0)
            rmap[src_tab[has]] = rs[has]
        for kv in (0, 1):  # K, then V: all layers at once
            pools = [pair[kv] for pair in self.kv_caches]
            kept = lb.gather_heads(pools, src_slots, rmap)  # [L, k, KVH, hd], every read before a write
            lb.store_compacted(pools, kept, dst_tab, c.dst_residual)

    def _compact_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, heads: torch.Tensor,
                      uniform: bool) -> None:
        """Whole-row pools (model dtype, 8-bit): one gather and one scatter per layer and K/V."""
        for layer, pair in enumerate(self.kv_caches):
            for cache in pair:
                rows = _raw(cache).view(-1, *cache.shape[2:])  # [slots, KVH, row]
                if uniform:
                    kept = rows.index_select(0, src_slots[0, 0])
                else:
                    kept = rows[src_slots[layer], heads].transpose(0, 1)  # [k, KVH, row]
                rows.index_copy_(0, dst_slots, kept.contiguous())

    def kept_positions(self, request_id: str) -> Optional[torch.Tensor]:
        """``[L, KVH, n]`` original positions of the request's KV slots (None without scores)."""
        st = self.states.get(request_id)
        return None if st is None else st.positions
