"""Vocabulary-parallel embedding and LM head (Megatron-LM: Shoeybi et al. 2019, section 3,
"parallelize the input embedding weight matrix along the vocabulary dimension"; the inference
layout of vLLM's ``model_executor/layers/vocab_parallel_embedding.py``).

The vocabulary of ``V`` tokens is padded to ``V_p``, the next multiple of ``tp_size``, and rank
r holds rows ``[r·n, (r+1)·n)`` with ``n = V_p / tp_size`` (:func:`vocab_range`); the padding
rows are zero. The embedding looks up the tokens of its range (the others give zeros, masked
in one vectorized pass) and an all-reduce sums the ranks' rows: every token's row comes from
exactly one rank, so the sum is exact. The LM head computes the logits of its range, and the
ranks' slices are gathered (to every rank, or to one) and the padding columns dropped. A tied
LM head shares the embedding's shard (the two split the vocabulary alike).

A GGUF-quantized table (:class:`~kvserve.worker.layers.quant.GGUFWeight`, the loader's under
``quantization="gguf"``) is kept quantized at ``tp_size == 1`` on the CPU: the embedding
dequantizes only the rows it looks up, and the head (tied: the same packed table, no copy) runs
on the quantized kernel like any GGUF linear; otherwise it is dequantized at load.

At ``tp_size == 1`` there is no padding, the embedding is ``F.embedding`` and the head a plain
:class:`~kvserve.worker.layers.linear.Linear`: no collective runs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.communication_op import (tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce,
                                                  tensor_model_parallel_gather)
from kvserve.worker.layers.linear import Linear
from kvserve.worker.layers.parallel_linear import _convert, check_group, own, resolve_tp
from kvserve.worker.layers.quant import GGUFWeight, PackedWeight, embedding_rows, pack_gguf, q_kernels


def _keep_quantized(weight, tp_size: int, device) -> bool:
    return (isinstance(weight, GGUFWeight) and tp_size == 1 and torch.device(device or "cpu").type == "cpu"
            and q_kernels() is not None)


class VocabRange(NamedTuple):
    """One rank's rows of a vocabulary-parallel table.

    Attributes:
        start: first token id the rank holds.
        end: one past the last real token it holds (``start <= end <= start + per_partition``;
            ``end == start`` on a rank that holds only padding).
        per_partition: rows on every rank (``V_p / tp_size``).
        padded: ``V_p``, the vocabulary padded to a multiple of ``tp_size``.
    """

    start: int
    end: int
    per_partition: int
    padded: int


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> VocabRange:
    """The rows of rank ``tp_rank`` for a vocabulary of ``vocab_size`` tokens split ``tp_size`` ways."""
    n = -(-vocab_size // tp_size)
    start = tp_rank * n
    return VocabRange(start, min(max(vocab_size, start), start + n), n, n * tp_size)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings ``[num_embeddings, embedding_dim]`` split by rows (tokens) across ranks.

    ``forward(input_ids [...] int64) -> [..., embedding_dim]`` in the weight's dtype, the same on
    every rank.

    Args:
        num_embeddings: vocabulary size ``V``; embedding_dim: hidden size.
        dtype, device: of this rank's table ``weight [V_p / tp_size, embedding_dim]``, allocated
            here and filled by :meth:`weight_loader`.
        tp_rank, tp_size: this layer's rank and number of ranks (None: the process's).

    Attributes:
        vocab: this rank's :class:`VocabRange`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: Optional[torch.dtype] = None,
                 device=None, tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.vocab = vocab_range(self.num_embeddings, self.tp_rank, self.tp_size)
        # (left uninitialized: the loader always fills it, so a random init of vocab x hidden values is wasted)
        self.weight = nn.Parameter(torch.empty(self.vocab.per_partition, self.embedding_dim, dtype=dtype,
                                               device=device), requires_grad=False)
        self.params_dtype, self.params_device = dtype, device
        self.qpacked: Optional[PackedWeight] = None  # a GGUF-quantized table kept quantized

    @torch.no_grad()
    def weight_loader(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``weight [num_embeddings, embedding_dim]`` in (the
        padding rows are zeroed).

        Raises:
            ValueError: a tensor of the wrong shape.
        """
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"VocabParallelEmbedding: weight must be [{self.num_embeddings}, {self.embedding_dim}] "
                             f"(the full table), got {tuple(weight.shape)}")
        if _keep_quantized(weight, self.tp_size, self.params_device):
            self.qpacked = pack_gguf([weight])
            self.weight = None  # (the uninitialized table was never written: no memory)
            return
        if isinstance(weight, GGUFWeight):
            weight = weight.dequantize()
        r = self.vocab
        n = r.end - r.start
        self.weight[:n].copy_(weight[r.start:r.end])
        self.weight[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qpacked is not None:
            return embedding_rows(self.qpacked, input_ids, self.params_dtype or torch.float32)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        check_group(self.tp_size)
        r = self.vocab
        mine = (input_ids >= r.start) & (input_ids < r.end)
        out = F.embedding(torch.where(mine, input_ids - r.start, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"rows=[{self.vocab.start}, {self.vocab.end}) + {self.vocab.per_partition - self.vocab.end + self.vocab.start} "
                f"padding, tp_rank={self.tp_rank}, tp_size={self.tp_size}")


class ParallelLMHead(Linear):
    """The LM head ``logits = h W^T``, ``W [num_embeddings, embedding_dim]`` split by rows (vocabulary)
    like :class:`VocabParallelEmbedding`.

    ``forward(h [S, embedding_dim]) -> [S, num_embeddings]`` logits in ``h.dtype``: on every
    rank (``gather_dst=None``: all-gather, so every rank can sample), or on rank ``gather_dst``
    only (gather; None on the other ranks).

    Args:
        num_embeddings, embedding_dim: the full head's shape (vocabulary, hidden size).
        gather_dst: None, or the one rank that receives the logits.
        dtype, device: what the shard is converted to when loaded (None: the checkpoint's).
        backend: as for :class:`Linear` (the head is never quantized).
        tp_rank, tp_size: this layer's rank and number of ranks (None: the process's).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, gather_dst: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None, backend: str = "auto",
                 tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
        super().__init__(None, None, backend=backend)
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.vocab = vocab_range(self.num_embeddings, self.tp_rank, self.tp_size)
        self.gather_dst = gather_dst
        self.params_dtype, self.params_device = dtype, device

    def weight_loader(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the full ``weight [num_embeddings, embedding_dim]``, padded with
        zero rows to ``V_p / tp_size``.

        Raises:
            ValueError: a tensor of the wrong shape.
        """
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"ParallelLMHead: weight must be [{self.num_embeddings}, {self.embedding_dim}] (the "
                             f"full head), got {tuple(weight.shape)}")
        if _keep_quantized(weight, self.tp_size, self.params_device):
            self.set_gguf_weight([weight])
            return
        if isinstance(weight, GGUFWeight):
            weight = weight.dequantize()
        r = self.vocab
        w = _convert(weight[r.start:r.end], self.params_dtype, self.params_device)
        pad = r.per_partition - (r.end - r.start)
        if pad:
            w = torch.cat([w, w.new_zeros(pad, self.embedding_dim)])
        self.set_weight(own(w))

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s table (tied word embeddings): no copy.

        Raises:
            ValueError: an embedding split otherwise (another vocabulary, width or rank).
        """
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_rank, embedding.tp_size) != (
                self.num_embeddings, self.embedding_dim, self.tp_rank, self.tp_size):
            raise ValueError("ParallelLMHead.tie_weights: the embedding is split differently from the head")
        if embedding.qpacked is not None:
            self.set_gguf_weight([], packed=embedding.qpacked)
            return
        self.set_weight(embedding.weight.detach())

    def forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        logits = super().forward(x)
        if self.tp_size == 1:
            return logits
        check_group(self.tp_size)
        if self.gather_dst is None:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        else:
            logits = tensor_model_parallel_gather(logits, dst=self.gather_dst, dim=-1)
            if logits is None:
                return None
        if self.vocab.padded != self.num_embeddings:
            logits = logits[..., : self.num_embeddings].contiguous()
        return logits

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vocab={self.num_embeddings}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
