"""Tensor-parallel linear layers (Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3; the inference
layout of vLLM's ``model_executor/layers/linear.py``).

A transformer block needs one all-reduce per sublayer: the first linear of attention (fused
QKV) and of the MLP (fused gate/up) is **column-parallel** (rank r holds rows ``[r·n, (r+1)·n)``
of ``W [out, in]`` and computes that slice of the outputs from the whole input, with no
communication), and the second (attention output, MLP down) is **row-parallel** (rank r holds
columns ``[r·k, (r+1)·k)`` of ``W``, multiplies the slice of the input it already has, and an
all-reduce sums the ``tp_size`` partial outputs). Attention heads and the MLP's hidden units
are independent, so nothing in between communicates.

Every layer here is a :class:`~kvserve.worker.layers.linear.Linear` over its shard (so each
rank runs the same kernels: gemv, AMX, oneDNN, int8) built without a weight; its
``weight_loader`` takes the FULL checkpoint tensor(s), keeps this rank's rows or columns (a
copy: the checkpoint tensor can be freed), and quantizes/packs the shard. At ``tp_size == 1``
the shard is the whole tensor, the layer is a plain ``Linear`` and no collective runs.

Weight-only int8 (``quantization="int8"``) quantizes the shard: per-output-channel scales, so
a column-parallel shard has exactly the scales of the full weight, and a row-parallel shard
has the scales of its own columns (each rank's partial sum is dequantized with them before
the all-reduce: still exact arithmetic on each shard, slightly different numbers from int8
at ``tp_size == 1``).

GGUF-quantized weights (``quantization="gguf"``, :class:`~kvserve.worker.layers.quant.GGUFWeight`
checkpoint tensors) are sharded as they are stored: a column-parallel shard is whole rows (any
split works); a row-parallel shard must cut whole quantization blocks (``input_size / tp_size``
a multiple of 32, or 256 for the K-quants), else that layer is dequantized at load (logged).
Off the CPU, or without the quantized kernel, every such layer is dequantized at load.

The ranks: ``tp_rank``/``tp_size`` given to a layer, or those of
:mod:`kvserve.distributed.parallel_state`. A layer with ``tp_size > 1`` runs its collectives
on that module's group, which must then have the same size.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from kvserve.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from kvserve.distributed.parallel_state import divide, get_tp_rank, get_tp_world_size, tp_head_counts
from kvserve.worker.layers.linear import Linear
from kvserve.worker.layers.quant import GGUFWeight, q_kernels

logger = logging.getLogger(__name__)


def resolve_tp(tp_rank: Optional[int], tp_size: Optional[int]) -> tuple[int, int]:
    """``(tp_rank, tp_size)``: the ones given, else this process's (:mod:`kvserve.distributed.parallel_state`).

    Raises:
        ValueError: ``tp_size < 1`` or ``tp_rank`` outside ``[0, tp_size)``.
    """
    size = get_tp_world_size() if tp_size is None else int(tp_size)
    rank = (get_tp_rank() if tp_size is None else 0) if tp_rank is None else int(tp_rank)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel: need tensor_parallel_size >= 1 and 0 <= rank < tensor_parallel_size, "
                         f"got rank {rank} of {size}")
    return rank, size


def check_group(tp_size: int) -> None:
    """Raise unless this process's TP group has ``tp_size`` ranks (a sharded layer's forward needs it).

    Raises:
        RuntimeError: no group of that size (:func:`kvserve.distributed.init_distributed` not called).
    """
    if get_tp_world_size() != tp_size:
        raise RuntimeError(f"a layer sharded for tensor_parallel_size={tp_size} runs in a process whose "
                           f"tensor-parallel group has {get_tp_world_size()} rank(s): call "
                           f"kvserve.distributed.init_distributed first")


def own(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and with storage of its own: a copy when it views part of a larger tensor
    (a shard narrowed from a checkpoint tensor), so that keeping it does not keep the whole."""
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    return t


def _convert(t: torch.Tensor, dtype: Optional[torch.dtype], device) -> torch.Tensor:
    if isinstance(t, GGUFWeight):
        t = t.dequantize()
    return t.to(device=t.device if device is None else device, dtype=t.dtype if dtype is None else dtype)


def keep_gguf(layer: Linear, weights: Sequence) -> bool:
    """Whether ``layer`` keeps ``weights`` GGUF-quantized: it asked for ``"gguf"``, every part is a
    :class:`GGUFWeight`, its device is the CPU and the quantized kernel runs here."""
    return (layer.quantization in ("gguf", "gguf_int8") and all(isinstance(w, GGUFWeight) for w in weights)
            and torch.device(layer.params_device or "cpu").type == "cpu" and q_kernels() is not None)


class ColumnParallelLinear(Linear):
    """``Y = X W^T + b`` with ``W [output_size, input_size]`` split by rows (output features).

    Rank r holds ``W[r·n : (r+1)·n]`` and ``b[r·n : (r+1)·n]`` with ``n = output_size / tp_size``;
    ``forward(x [..., input_size]) -> [..., n]`` (this rank's slice of the outputs), or with
    ``gather_output`` ``[..., output_size]`` on every rank (all-gather), in ``x.dtype``.

    Args:
        input_size, output_size: the full layer's shape.
        bias: whether the layer has a bias.
        gather_output: all-gather the outputs (else each rank keeps its slice, for a following
            row-parallel layer).
        dtype, device: what the shard is converted to when loaded (None: the checkpoint's).
        quantization, backend: as for :class:`Linear` (applied to the shard).
        tp_rank, tp_size: this layer's rank and number of ranks (None: the process's).

    Raises:
        ValueError: ``output_size`` not divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, gather_output: bool = False,
                 dtype: Optional[torch.dtype] = None, device=None, quantization: Optional[str] = None,
                 backend: str = "auto", tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
        self._init_common(input_size, output_size, bias, gather_output, dtype, device, quantization, backend,
                          tp_rank, tp_size)
        self._set_output_parts([self.output_size], [divide(self.output_size, self.tp_size, "output_size")])

    def _init_common(self, input_size, output_size, bias, gather_output, dtype, device, quantization, backend,
                     tp_rank, tp_size) -> None:
        Linear.__init__(self, None, None, quantization=quantization, backend=backend)
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.input_size, self.output_size = int(input_size), int(output_size)
        self.has_bias, self.gather_output = bias, gather_output
        self.params_dtype, self.params_device = dtype, device

    def _set_output_parts(self, full: list[int], local: list[int]) -> None:
        """The output is the concatenation of parts (q/k/v, gate/up): ``full`` sizes in the
        checkpoint, ``local`` sizes on this rank."""
        self.output_sizes, self.local_output_sizes = list(full), list(local)
        self.output_size_per_partition = sum(local)

    def part_offset(self, i: int) -> int:
        """First row of part ``i`` that this rank holds, in the part's full tensor."""
        return self.tp_rank * self.local_output_sizes[i]

    def weight_loader(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Keep this rank's rows of the full ``weight [output_size, input_size]`` (and of ``bias
        [output_size]``).

        Raises:
            ValueError: a tensor of the wrong shape, a missing or unexpected bias.
        """
        self._load_parts([weight], None if bias is None else [bias])

    def _load_parts(self, weights: Sequence[torch.Tensor], biases: Optional[Sequence[torch.Tensor]]) -> None:
        if len(weights) != len(self.output_sizes):
            raise ValueError(f"{type(self).__name__}: expected {len(self.output_sizes)} weight(s), got {len(weights)}")
        if (biases is not None) != self.has_bias or (biases is not None and len(biases) != len(weights)):
            raise ValueError(f"{type(self).__name__}: the layer has {'a' if self.has_bias else 'no'} bias, "
                             f"got {'none' if biases is None else len(biases)}")
        for i, (w, n) in enumerate(zip(weights, self.output_sizes)):
            if tuple(w.shape) != (n, self.input_size):
                raise ValueError(f"{type(self).__name__}: weight {i} must be [{n}, {self.input_size}] (the full "
                                 f"tensor), got {tuple(w.shape)}")
            if biases is not None and tuple(biases[i].shape) != (n,):
                raise ValueError(f"{type(self).__name__}: bias {i} must be [{n}], got {tuple(biases[i].shape)}")

        def rows(parts: Sequence) -> list:
            return [t.narrow_rows(self.part_offset(i), self.local_output_sizes[i]) if isinstance(t, GGUFWeight)
                    else t.narrow(0, self.part_offset(i), self.local_output_sizes[i]) for i, t in enumerate(parts)]

        def shard(parts: Sequence[torch.Tensor]) -> torch.Tensor:
            r = [_convert(t, self.params_dtype, self.params_device) for t in rows(parts)]
            return own(r[0] if len(r) == 1 else torch.cat(r))

        if keep_gguf(self, weights):
            self.set_gguf_weight(rows(weights), None if biases is None else shard(biases))
            return
        self.set_weight(shard(weights), None if biases is None else shard(biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.gather_output and self.tp_size > 1:
            check_group(self.tp_size)
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp_rank={self.tp_rank}, tp_size={self.tp_size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears of one input fused into one matmul (the MLP's gate and
    up projections): ``W = cat(W_0, W_1, ...)`` by rows, and each rank holds
    ``cat(shard(W_0), shard(W_1), ...)``, so that its output splits into its slices of each.

    ``forward(x [..., input_size]) -> [..., sum(output_sizes) / tp_size]``.

    Args:
        output_sizes: each part's full output size (each divisible by ``tp_size``).
        (the rest as :class:`ColumnParallelLinear`)
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, *,
                 gather_output: bool = False, dtype: Optional[torch.dtype] = None, device=None,
                 quantization: Optional[str] = None, backend: str = "auto", tp_rank: Optional[int] = None,
                 tp_size: Optional[int] = None) -> None:
        self._init_common(input_size, sum(output_sizes), bias, gather_output, dtype, device, quantization, backend,
                          tp_rank, tp_size)
        self._set_output_parts(list(output_sizes), [divide(n, self.tp_size, "output size") for n in output_sizes])

    def weight_loader(self, weights: Sequence[torch.Tensor], biases: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Keep this rank's rows of each full part ``weights[i] [output_sizes[i], input_size]``
        (and ``biases[i] [output_sizes[i]]``), concatenated in part order.

        Raises:
            ValueError: a tensor of the wrong shape or count.
        """
        self._load_parts(weights, biases)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection, split by attention heads.

    Rank r holds the rows of its query heads ``[r·h, (r+1)·h)`` (``h = num_heads / tp_size``) and
    of its KV heads: ``[r·k, (r+1)·k)`` with ``k = num_kv_heads / tp_size`` when ``tp_size <=
    num_kv_heads``, else the one KV head ``r // (tp_size / num_kv_heads)``, replicated on that
    many ranks (vLLM's ``num_kv_head_replicas``; see
    :func:`kvserve.distributed.parallel_state.tp_head_counts`). Each rank's query heads attend with
    the KV heads it holds, as in the full model.

    ``forward(x [..., hidden_size]) -> [..., (h + 2k)·head_dim]``: q, then k, then v of this rank.

    Attributes:
        num_heads, num_kv_heads: heads on this rank (``h``, ``k``).
        num_kv_head_replicas: ranks holding each KV head (1 when they are split).

    Raises:
        ValueError: head counts that ``tp_size`` does not split (the message names
            ``tensor_parallel_size`` and the counts).
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, *, gather_output: bool = False, dtype: Optional[torch.dtype] = None,
                 device=None, quantization: Optional[str] = None, backend: str = "auto",
                 tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
        full = [total_num_heads * head_dim, total_num_kv_heads * head_dim, total_num_kv_heads * head_dim]
        self._init_common(hidden_size, sum(full), bias, gather_output, dtype, device, quantization, backend,
                          tp_rank, tp_size)
        h, k, replicas = tp_head_counts(total_num_heads, total_num_kv_heads, self.tp_size)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = h, k, replicas
        if gather_output and replicas > 1:
            raise ValueError("QKVParallelLinear: gather_output with replicated KV heads would repeat them")
        self._set_output_parts(full, [h * head_dim, k * head_dim, k * head_dim])

    def part_offset(self, i: int) -> int:
        if i == 0:
            return self.tp_rank * self.num_heads * self.head_dim
        return (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads * self.head_dim

    def weight_loader(self, weights: Sequence[torch.Tensor], biases: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Keep this rank's heads of the full ``(q [num_heads·head_dim, hidden], k, v
        [num_kv_heads·head_dim, hidden])`` (and their biases).

        Raises:
            ValueError: a tensor of the wrong shape or count.
        """
        self._load_parts(weights, biases)


class RowParallelLinear(Linear):
    """``Y = X W^T + b`` with ``W [output_size, input_size]`` split by columns (input features).

    Rank r holds ``W[:, r·k : (r+1)·k]`` (``k = input_size / tp_size``) and multiplies its slice of
    the input; the partial outputs are summed by an all-reduce. The bias is added once, by rank 0
    (in its matmul, before the sum).

    ``forward(x [..., k]) -> [..., output_size]`` (``x [..., input_size]`` when not
    ``input_is_parallel``: the layer takes its slice), the same on every rank after the
    all-reduce, in ``x.dtype``.

    Args:
        input_is_parallel: ``x`` is already this rank's slice (the output of a column-parallel
            layer, or of the attention over this rank's heads).
        reduce_results: all-reduce the partial outputs (else each rank returns its partial sum).
        (the rest as :class:`ColumnParallelLinear`)

    Raises:
        ValueError: ``input_size`` not divisible by ``tp_size``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, input_is_parallel: bool = True,
                 reduce_results: bool = True, dtype: Optional[torch.dtype] = None, device=None,
                 quantization: Optional[str] = None, backend: str = "auto", tp_rank: Optional[int] = None,
                 tp_size: Optional[int] = None) -> None:
        super().__init__(None, None, quantization=quantization, backend=backend)
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.input_size, self.output_size = int(input_size), int(output_size)
        self.has_bias, self.input_is_parallel, self.reduce_results = bias, input_is_parallel, reduce_results
        self.params_dtype, self.params_device = dtype, device
        self.input_size_per_partition = divide(self.input_size, self.tp_size, "input_size")

    def weight_loader(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Keep this rank's columns of the full ``weight [output_size, input_size]`` (and ``bias
        [output_size]`` on rank 0).

        Raises:
            ValueError: a tensor of the wrong shape, a missing or unexpected bias.
        """
        if tuple(weight.shape) != (self.output_size, self.input_size):
            raise ValueError(f"RowParallelLinear: weight must be [{self.output_size}, {self.input_size}] (the full "
                             f"tensor), got {tuple(weight.shape)}")
        if (bias is not None) != self.has_bias:
            raise ValueError(f"RowParallelLinear: the layer has {'a' if self.has_bias else 'no'} bias")
        if bias is not None and tuple(bias.shape) != (self.output_size,):
            raise ValueError(f"RowParallelLinear: bias must be [{self.output_size}], got {tuple(bias.shape)}")
        k = self.input_size_per_partition
        b = None if bias is None or self.tp_rank > 0 else own(_convert(bias, self.params_dtype, self.params_device))
        if keep_gguf(self, [weight]):
            if k % weight.block_size == 0:
                self.set_gguf_weight([weight.narrow_cols(self.tp_rank * k, k)], b)
                return
            logger.info("RowParallelLinear: a shard of %d columns cuts %s's blocks of %d values: this layer is "
                        "dequantized", k, weight.qtype, weight.block_size)
        if isinstance(weight, GGUFWeight):
            weight = weight.dequantize()
        w = own(_convert(weight.narrow(1, self.tp_rank * k, k), self.params_dtype, self.params_device))
        self.set_weight(w, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        check_group(self.tp_size)
        if not self.input_is_parallel:
            k = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * k, k)
        y = super().forward(x)
        return tensor_model_parallel_all_reduce(y.contiguous()) if self.reduce_results else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp_rank={self.tp_rank}, tp_size={self.tp_size}"
