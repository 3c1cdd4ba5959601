"""A worker: one model replica's (or tensor-parallel shard's) weights, KV pools and model runner.

The engine core reaches it through an executor (:mod:`kvserve.executor`): the core decides
which tokens run and where their K/V goes (block tables, slot mapping); the worker owns the
tensors and runs the forward and the sampler.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): an executor starts one process per rank
and builds a ``Worker(dtype, device, rank, world_size, distributed_init_method)`` in each; the
constructor joins the ranks' ``torch.distributed`` group (gloo on CPU, NCCL on CUDA:
:func:`kvserve.distributed.init_distributed`). Every rank then gets the same calls in the same
order (``load_model``, ``initialize_kv_cache``, ``init_model_runner``, ``execute_model`` with
the same scheduler output each step), since the forward's collectives pair them up. Each rank
keeps only its shard of the weights and a KV pool of its own KV heads (the block ids are the
same on every rank); every rank gets the whole logits and samples, and the executor returns
rank 0's output.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from kvserve.config import ModelConfig
from kvserve.core.kv_cache_manager import KVCacheSpec, allocate_kv_cache
from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed import parallel_state
from kvserve.worker.attention import default_backend
from kvserve.worker.loader import load_weights, release_freed_memory, torch_threads
from kvserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from kvserve.worker.models import model_class


class Worker:
    """The model (or this rank's shard of it), its KV pools and its :class:`ModelRunner` on one device.

    Args:
        dtype: weights and activations dtype.
        device: where the model and the pools live (with several ranks on CUDA, a device without
            an index becomes ``cuda:<rank % device count>``).
        rank: tensor-parallel rank, ``0 <= rank < world_size``.
        world_size: tensor-parallel ranks (processes); 1 (default): no process group, the model whole.
        distributed_init_method: the rendezvous of the ranks' group (``"tcp://host:port"`` or
            ``"file:///path"``), needed when ``world_size > 1``; the constructor blocks until
            every rank has joined.
        distributed_timeout_s: how long a collective may wait for the other ranks before it
            raises (None: torch's default).

    With several ranks on the CPU, torch's intra-op threads are ``max(1, cores // world_size)``
    (the cores this process may run on, shared by the ranks: none oversubscribed).

    Raises:
        ValueError: a bad rank or world size, or no ``distributed_init_method`` for several ranks.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, rank: int = 0, world_size: int = 1,
                 distributed_init_method: Optional[str] = None,
                 distributed_timeout_s: Optional[float] = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Worker: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.rank = rank
        self.world_size = world_size
        self.model = None
        self.kv_caches: Optional[list] = None
        self.runner: Optional[ModelRunner] = None
        if world_size > 1:
            if not distributed_init_method:
                raise ValueError("Worker: world_size > 1 needs a distributed_init_method (tcp://... or file://...)")
            if self.device.type == "cpu":
                torch.set_num_threads(max(1, available_cores() // world_size))
            self.device = parallel_state.init_distributed(world_size, rank, distributed_init_method,
                                                          device=self.device, timeout_s=distributed_timeout_s)

    def load_model(self, path, max_model_len: int, quantization: Optional[str]) -> ModelConfig:
        """Read the weights at ``path`` and build the model for contexts of ``max_model_len``.

        Every rank reads the whole checkpoint and keeps its shard (the rest is freed before
        this returns).

        Returns:
            The model's config as read with the weights.

        Raises:
            ModelLoadError: a corrupt file; UnsupportedModelError: an unknown architecture;
            ValueError: a model that ``world_size`` ranks cannot split.
        """
        with torch_threads(1):  # (on a busy 2-core machine two OpenMP threads made loading 4x slower)
            cfg, state = load_weights(path)
        cfg.check_tensor_parallel(self.world_size)
        num_heads, num_kv_heads = cfg.heads_per_rank(self.world_size)  # this rank's
        backend = default_backend(self.device, self.dtype, num_heads, num_kv_heads, cfg.head_dim)
        self.model = model_class(cfg.architecture)(cfg, backend, self.dtype, self.device, max_positions=max_model_len,
                                                   tp_rank=self.rank, tp_size=self.world_size)
        with torch_threads(1):
            self.model.load_weights(state, quantization=quantization)
        del state
        release_freed_memory()
        self.model.eval()
        return cfg

    def initialize_kv_cache(self, cfg: ModelConfig, kv_spec: KVCacheSpec, kv_cache_dtype: torch.dtype) -> list:
        """Allocate the per-layer K/V pools of ``kv_spec`` (``[num_blocks, block_size,
        num_kv_heads, head_dim]`` each, ``num_kv_heads`` this rank's, in ``kv_cache_dtype``); returns them.

        Raises:
            ValueError: ``kv_spec`` planned for another number of ranks
                (:func:`kvserve.core.kv_cache_manager.plan_kv_cache`'s ``tp_size``), or a pool
                larger than the memory available.
        """
        if kv_spec.tp_size != self.world_size:
            raise ValueError(f"Worker: the KV cache was planned for tensor_parallel_size={kv_spec.tp_size}, this "
                             f"worker is one of {self.world_size} ranks")
        self.kv_caches = allocate_kv_cache(cfg, kv_spec, kv_cache_dtype, self.device)
        return self.kv_caches

    def init_model_runner(self, block_tables: dict[str, list[int]], block_size: int,
                          sliding_window: Optional[int]) -> None:
        """Build the model runner over the pools. ``block_tables`` is the KV manager's
        ``request_id → block ids`` map, read in this process (one-process executor)."""
        self.runner = ModelRunner(self.model, self.kv_caches, block_tables, block_size, self.device,
                                  sliding_window=sliding_window)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step's forward and sampling (:meth:`ModelRunner.execute`). With several ranks,
        every rank must run the same step (the forward's collectives pair the ranks up)."""
        return self.runner.execute(scheduler_output)

    def shutdown(self) -> None:
        """Leave the tensor-parallel group (:func:`kvserve.distributed.destroy_distributed`)."""
        if self.world_size > 1:
            parallel_state.destroy_distributed()


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
