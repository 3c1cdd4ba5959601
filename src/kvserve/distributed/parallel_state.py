"""The tensor-parallel process group of this process (vLLM's ``parallel_state``, reduced to TP).

One process per rank. :func:`init_distributed` joins the ``torch.distributed`` group (gloo for
CPU tensors, NCCL for CUDA ones, picked from the device unless given); every rank of the world
is a tensor-parallel rank (there is no pipeline or data parallelism). Until it is called, or
after :func:`destroy_distributed`, :func:`get_tp_world_size` is 1 and :func:`get_tp_rank` 0:
the single-process path reads two module globals and never touches ``torch.distributed``.

Head counts per rank (:func:`tp_head_counts`) follow Megatron-LM (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism"): the
query heads are split evenly, and so are the KV heads; with more ranks than KV heads (GQA/MQA)
each rank holds one KV head, replicated on ``tp_size // num_kv_heads`` ranks, as vLLM's
``QKVParallelLinear`` does.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_WORLD_SIZE = 1
_TP_GROUP = None  # the torch.distributed group of the TP ranks (the world group), None when not initialized
_DEVICE: Optional[torch.device] = None


def default_backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for a CUDA device, else ``"gloo"``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(world_size: int, rank: int, init_method: str, backend: Optional[str] = None,
                     device: torch.device | str = "cpu", timeout_s: Optional[float] = None) -> torch.device:
    """Join the tensor-parallel group as ``rank`` of ``world_size`` (blocks until every rank has joined).

    Args:
        world_size: number of ranks (processes); 1 sets the state and starts no process group.
        rank: this process's rank, ``0 <= rank < world_size``.
        init_method: the rendezvous every rank is given, ``"tcp://127.0.0.1:<port>"`` or
            ``"file:///<path>"`` (see ``torch.distributed.init_process_group``).
        backend: ``"gloo"`` or ``"nccl"``; None: picked from ``device`` (:func:`default_backend_for`).
        device: the device this rank computes on. A CUDA device without an index becomes
            ``cuda:<rank % device_count>``; that device is made current.
        timeout_s: how long a collective may wait for the other ranks before it raises
            (None: torch's default, 10 min for NCCL, 30 min for gloo).

    Returns:
        The device this rank uses (``device`` with its CUDA index resolved).

    Raises:
        ValueError: ``world_size < 1``, ``rank`` out of range, or a process group that was
            initialized with another world size or rank.
    """
    global _TP_RANK, _TP_WORLD_SIZE, _TP_GROUP, _DEVICE
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: need world_size >= 1 and 0 <= rank < world_size, got "
                         f"world_size={world_size}, rank={rank}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ValueError(f"init_distributed: torch.distributed is already initialized as rank "
                                 f"{dist.get_rank()} of {dist.get_world_size()}, not {rank} of {world_size}")
        else:
            kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
            if device.type == "cuda":
                kwargs["device_id"] = device  # (NCCL: eager init, the communicator bound to this GPU)
            dist.init_process_group(backend or default_backend_for(device), init_method=init_method,
                                    world_size=world_size, rank=rank, **kwargs)
        _TP_GROUP = dist.group.WORLD
    else:
        _TP_GROUP = None
    _TP_RANK, _TP_WORLD_SIZE, _DEVICE = rank, world_size, device
    return device


def destroy_distributed() -> None:
    """Leave the process group (the one :func:`init_distributed` started or found) and reset to
    world size 1."""
    global _TP_RANK, _TP_WORLD_SIZE, _TP_GROUP, _DEVICE
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_WORLD_SIZE, _TP_GROUP, _DEVICE = 0, 1, None, None


def is_initialized() -> bool:
    """Whether this process is in a tensor-parallel group of more than one rank."""
    return _TP_GROUP is not None


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 when not initialized)."""
    return _TP_RANK


def get_tp_world_size() -> int:
    """Number of tensor-parallel ranks (1 when not initialized)."""
    return _TP_WORLD_SIZE


def get_tp_group():
    """The ``torch.distributed`` group of the TP ranks, None when not initialized."""
    return _TP_GROUP


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator // denominator``, which must be exact.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator`` (``what`` names them).
    """
    if denominator < 1 or numerator % denominator:
        raise ValueError(f"{what or 'value'} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def tp_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int, int]:
    """Heads on each rank: ``(query heads, KV heads, KV replicas)``.

    The ``num_heads`` query heads are split evenly. The KV heads are split evenly when
    ``tp_size <= num_kv_heads``; with more ranks than KV heads each rank holds one KV head,
    each KV head held by ``tp_size // num_kv_heads`` ranks (the replicas). Rank ``r`` holds the
    query heads ``[r·h, (r+1)·h)`` and the KV head(s) those query heads attend with: KV heads
    ``[r·k, (r+1)·k)`` when split, KV head ``r // replicas`` when replicated.

    Raises:
        ValueError: ``tp_size < 1``, ``num_heads`` not divisible by ``tp_size``, or
            ``num_kv_heads`` neither divisible by ``tp_size`` nor dividing it; the message names
            ``tensor_parallel_size`` and the head counts.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {num_heads} attention heads "
                         f"(num_kv_heads={num_kv_heads}): choose a tensor_parallel_size that divides {num_heads}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {num_kv_heads} KV heads "
                             f"(num_heads={num_heads}): it must divide num_kv_heads, or be a multiple of it")
        return num_heads // tp_size, num_kv_heads // tp_size, 1
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is neither a divisor nor a multiple of the model's "
                         f"{num_kv_heads} KV heads (num_heads={num_heads}): KV heads can only be split evenly or "
                         f"replicated evenly")
    return num_heads // tp_size, 1, tp_size // num_kv_heads
