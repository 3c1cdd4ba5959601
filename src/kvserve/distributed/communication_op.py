"""The collectives of tensor parallelism, over the group of :mod:`kvserve.distributed.parallel_state`.

Megatron-LM (Shoeybi et al. 2019) needs two in a forward pass: an all-reduce that sums the
partial outputs of a row-parallel linear (and of the vocabulary-parallel embedding), and a
gather of the vocabulary-parallel logits. Each function here is a no-op (its input returned as
it is) at world size 1, so the single-process path never reaches ``torch.distributed``.

Dtypes: anything the backend reduces; gloo (CPU) and NCCL (CUDA) both take float32, bfloat16
and float16. Tensors must be on the rank's device (CPU for gloo, its GPU for NCCL).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from kvserve.distributed.parallel_state import get_tp_group, get_tp_rank, get_tp_world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place.

    Args:
        x: any shape and dtype, the same on every rank (e.g. a row-parallel linear's partial
            output ``[T, hidden]`` in the model dtype); contiguous.

    Returns:
        ``x`` itself, now holding the sum (every rank gets the same values).
    """
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on every rank.

    Args:
        x: ``[..., n, ...]``, the same shape and dtype on every rank.
        dim: the dimension to concatenate (the last by default).

    Returns:
        ``[..., world_size·n, ...]``, a new tensor (``x`` itself at world size 1).
    """
    ws = get_tp_world_size()
    if ws == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(parts, x, group=get_tp_group())
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on rank ``dst`` only.

    Args:
        x: ``[..., n, ...]``, the same shape and dtype on every rank.
        dst: the rank that receives the result.
        dim: the dimension to concatenate.

    Returns:
        ``[..., world_size·n, ...]`` on rank ``dst``; None on the other ranks (``x`` itself at
        world size 1).
    """
    ws = get_tp_world_size()
    if ws == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ws)] if get_tp_rank() == dst else None
    dist.gather(x, parts, dst=dst, group=get_tp_group())
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (pickled; for small control data such as a step's
    schedule, not for tensors on the hot path).

    Args:
        obj: any picklable object on rank ``src``; ignored on the other ranks.
        src: the sending rank.

    Returns:
        The object (a copy on the other ranks; ``obj`` itself at world size 1 and on ``src``).
    """
    if get_tp_world_size() == 1:
        return obj
    box = [obj if get_tp_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=get_tp_group())
    return obj if get_tp_rank() == src else box[0]
