"""A worker: one model replica's (or tensor-parallel shard's) weights, KV pools and model runner.

The engine core reaches it through an executor (:mod:`kvserve.executor`): the core decides
which tokens run and where their K/V goes (block tables, slot mapping); the worker owns the
tensors and runs the forward and the sampler.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.config import ModelConfig
from kvserve.core.kv_cache_manager import KVCacheSpec, allocate_kv_cache
from kvserve.core.scheduler import SchedulerOutput
from kvserve.worker.attention import default_backend
from kvserve.worker.loader import load_weights, release_freed_memory, torch_threads
from kvserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from kvserve.worker.models import model_class


class Worker:
    """The model, its KV pools and its :class:`ModelRunner` on one device.

    Args:
        dtype: weights and activations dtype.
        device: where the model and the pools live.
        rank: tensor-parallel rank (0: the only one, for now).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, rank: int = 0) -> None:
        self.dtype = dtype
        self.device = device
        self.rank = rank
        self.model = None
        self.kv_caches: Optional[list] = None
        self.runner: Optional[ModelRunner] = None

    def load_model(self, path, max_model_len: int, quantization: Optional[str]) -> ModelConfig:
        """Read the weights at ``path`` and build the model for contexts of ``max_model_len``.

        Returns:
            The model's config as read with the weights.

        Raises:
            ModelLoadError: a corrupt file; UnsupportedModelError: an unknown architecture.
        """
        with torch_threads(1):  # (on a busy 2-core machine two OpenMP threads made loading 4x slower)
            cfg, state = load_weights(path)
        backend = default_backend(self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.model = model_class(cfg.architecture)(cfg, backend, self.dtype, self.device, max_positions=max_model_len)
        with torch_threads(1):
            self.model.load_weights(state, quantization=quantization)
        del state
        release_freed_memory()
        self.model.eval()
        return cfg

    def initialize_kv_cache(self, cfg: ModelConfig, kv_spec: KVCacheSpec, kv_cache_dtype: torch.dtype) -> list:
        """Allocate the per-layer K/V pools of ``kv_spec`` (``[num_blocks, block_size,
        num_kv_heads, head_dim]`` each, in ``kv_cache_dtype``); returns them."""
        self.kv_caches = allocate_kv_cache(cfg, kv_spec, kv_cache_dtype, self.device)
        return self.kv_caches

    def init_model_runner(self, block_tables: dict[str, list[int]], block_size: int,
                          sliding_window: Optional[int]) -> None:
        """Build the model runner over the pools. ``block_tables`` is the KV manager's
        ``request_id → block ids`` map, read in this process (one-process executor)."""
        self.runner = ModelRunner(self.model, self.kv_caches, block_tables, block_size, self.device,
                                  sliding_window=sliding_window)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step's forward and sampling (:meth:`ModelRunner.execute`)."""
        return self.runner.execute(scheduler_output)
