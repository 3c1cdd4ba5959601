"""A worker: one model replica's (or tensor-parallel shard's) weights, KV pools and model runner.

The engine core reaches it through an executor (:mod:`kvserve.executor`): the core decides
which tokens run and where their K/V goes (block tables, slot mapping, and the block copies and
swaps it records: :mod:`kvserve.core.kv_ops`); the worker owns the tensors (the KV pools and the
swap space's host pool), applies each step's block ops to them and runs the forward and the
sampler.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): an executor starts one process per rank
and builds a ``Worker(dtype, device, rank, world_size, distributed_init_method)`` in each; the
constructor joins the ranks' ``torch.distributed`` group (gloo on CPU, NCCL on CUDA:
:func:`kvserve.distributed.init_distributed`). Every rank gets the same calls in the same order
(``load_model``, ``initialize_kv_cache``, ...), since the forward's collectives pair them up.
Each rank keeps only its shard of the weights and a KV pool of its own KV heads (the block ids
are the same on every rank). Each step the driver (rank 0) runs :meth:`Worker.execute_model`:
it builds the batch tensors, hands them to the executor to send to the other ranks, which run
:meth:`Worker.execute_forward` on them; the logits are gathered to the driver
(``logits_dst=0``), which alone samples.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from kvserve.config import ModelConfig
from kvserve.core.kv_cache_manager import KVCacheSpec, allocate_kv_cache
from kvserve.core.kv_ops import KVCacheOps, KVCacheOpsError
from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed import parallel_state
from kvserve.worker.attention import default_backend
from kvserve.worker.kv_block_mover import KVBlockMover
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
        logits_dst: with several ranks, the one rank the logits are gathered to (the others get
            None and sample nothing); None: every rank gets them.

    With several ranks on the CPU, torch's intra-op threads are ``max(1, cores // world_size)``
    (the cores this process may run on, shared by the ranks: none oversubscribed), in the thread
    that builds the worker and in any thread that runs its steps: torch's thread count is
    per thread (OpenMP's), and the driver's worker is built on a thread of its own
    (:class:`~kvserve.executor.multiproc_executor.MultiprocExecutor`) and steps on the engine's.

    Raises:
        ValueError: a bad rank or world size, or no ``distributed_init_method`` for several ranks.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, rank: int = 0, world_size: int = 1,
                 distributed_init_method: Optional[str] = None,
                 distributed_timeout_s: Optional[float] = None, logits_dst: Optional[int] = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Worker: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.rank = rank
        self.world_size = world_size
        self.logits_dst = logits_dst
        self.model = None
        self.kv_caches: Optional[list] = None
        self.kv_mover: Optional[KVBlockMover] = None
        self.runner: Optional[ModelRunner] = None
        self._rank_residual_map: Optional[torch.Tensor] = None  # (ranks > 0, 2-/4-bit pools: execute_forward)
        self.num_threads: Optional[int] = None  # torch threads of this rank's steps (None: as they are)
        self._in_group = False  # (joined the ranks' process group, and not left it)
        if world_size > 1:
            if not distributed_init_method:
                raise ValueError("Worker: world_size > 1 needs a distributed_init_method (tcp://... or file://...)")
            if self.device.type == "cpu":
                self.num_threads = max(1, available_cores() // world_size)
                torch.set_num_threads(self.num_threads)
            self.device = parallel_state.init_distributed(world_size, rank, distributed_init_method,
                                                          device=self.device, timeout_s=distributed_timeout_s)
            self._in_group = True

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
            cfg, state = load_weights(path, progress=None if self.rank == 0 else False,  # (one bar: rank 0's)
                                      keep_quantized=quantization in ("gguf", "gguf_int8") and self.device.type == "cpu")
        cfg.check_tensor_parallel(self.world_size)
        num_heads, num_kv_heads = cfg.heads_per_rank(self.world_size)  # this rank's
        backend = default_backend(self.device, self.dtype, num_heads, num_kv_heads, cfg.head_dim)
        self.model = model_class(cfg.architecture)(cfg, backend, self.dtype, self.device, max_positions=max_model_len,
                                                   tp_rank=self.rank, tp_size=self.world_size,
                                                   logits_dst=self.logits_dst)
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
        self.kv_caches = allocate_kv_cache(cfg, kv_spec, kv_cache_dtype, self.device, model_dtype=self.dtype)
        self.kv_mover = KVBlockMover(self.kv_caches, self.rank)
        return self.kv_caches

    def initialize_swap_space(self, num_blocks: int, num_residual: int = 0) -> bool:
        """Allocate the swap space's host pool of ``num_blocks`` blocks beside the KV pools
        (:meth:`KVBlockMover.allocate_host`: per layer ``(K, V)``, each ``[num_blocks,
        block_size, num_kv_heads, row]`` in the pools' dtype, on the CPU; 2-/4-bit pools: packed
        blocks and ``num_residual`` host residual slots); returns whether it is pinned (a CUDA device).

        Raises:
            ValueError: naming ``swap_space``: the pool is larger than the memory available, or
                its allocation failed.
        """
        self.kv_mover.allocate_host(num_blocks, num_residual)
        return self.kv_mover.pin

    def initialize_kv_offload(self, directory: str, layout) -> None:
        """Start this rank's side of the prefix cache's disk tier: a
        :class:`~kvserve.distributed.kv_transfer.disk_connector.DiskKVConnector` over ``directory``
        for ``layout`` (rank 0's :class:`~kvserve.distributed.kv_transfer.disk_connector.BlockFileLayout`;
        this rank's is derived), which ``offload`` ops write to and disk loads read from."""
        from kvserve.distributed.kv_transfer.disk_connector import DiskKVConnector

        self.close_kv_offload()
        self.kv_mover.disk = DiskKVConnector(directory, layout.for_rank(self.rank))

    def flush_kv_offload(self) -> None:
        """Wait until the disk tier's queued writes and deletions are done (no-op without one)."""
        disk = self.kv_mover.disk if self.kv_mover is not None else None
        if disk is not None:
            disk.flush()

    def kv_offload_report(self) -> Optional[dict]:
        """What became of the disk tier's writes since the last call (:meth:`DiskKVConnector.take_report`);
        None without a disk tier."""
        disk = self.kv_mover.disk if self.kv_mover is not None else None
        return disk.take_report() if disk is not None else None

    def close_kv_offload(self) -> Optional[dict]:
        """Write what the disk tier's writer has queued and stop it; returns its last report
        (:meth:`kv_offload_report`), None without a disk tier."""
        disk = self.kv_mover.disk if self.kv_mover is not None else None
        if disk is None:
            return None
        disk.close()
        self.kv_mover.disk = None
        return disk.take_report()

    @property
    def host_caches(self) -> Optional[list]:
        """The swap space's host pool (None without one)."""
        return self.kv_mover.host_caches if self.kv_mover is not None else None

    def save_kv_blocks(self, blocks: list[int]) -> list:
        """The K/V of ``blocks`` of this worker's pools, copied to the CPU, for a KV connector
        (:meth:`KVBlockMover.save`: per layer ``(K, V)``, each ``[len(blocks), block_size,
        num_kv_heads, row]``)."""
        return self.kv_mover.save(blocks)

    def apply_kv_ops(self, ops: KVCacheOps) -> None:
        """Apply block copies and swaps recorded by the engine core to this worker's pools, in
        order (:meth:`KVBlockMover.apply`).

        Raises:
            KVCacheOpsError: applying failed (the pools no longer match the core's books).
        """
        try:
            self.kv_mover.apply(ops)
        except Exception as e:
            raise KVCacheOpsError(f"applying {len(ops)} KV block moves failed: {type(e).__name__}: {e}") from e

    def load_kv_blocks(self, ops: KVCacheOps) -> Optional[str]:
        """Apply block moves whose last batch loads blocks another engine saved (the engine
        core's loader, :meth:`KVCacheManager.admit`: the moves recorded before the load, then
        the load), now rather than with the next step.

        Returns:
            None, or the message of the :class:`~kvserve.distributed.kv_transfer.KVTransferError`
            that made the load fail: the moves before it were applied and the load wrote nothing
            (a message, not an exception: an executor whose driver raises stops its ranks, and a
            failed load is one request's, which the core recomputes).

        Raises:
            KVCacheOpsError: applying another move failed (the pools no longer match the core's books).
        """
        from kvserve.distributed.kv_transfer import KVTransferError

        self._pin_threads()
        try:
            self.kv_mover.apply(ops)
        except KVTransferError as e:
            return str(e)
        except Exception as e:
            raise KVCacheOpsError(f"applying {len(ops)} KV block moves failed: {type(e).__name__}: {e}") from e
        return None

    def init_model_runner(self, block_tables: dict[str, list[int]], block_size: int,
                          sliding_window: Optional[int], residual_map: Optional[torch.Tensor] = None) -> None:
        """Build the model runner over the pools. ``block_tables`` is the KV manager's
        ``request_id → block ids`` map, read in this process (one-process executor), as is
        ``residual_map`` (2-/4-bit pools: the KV manager's ``block → residual slot``,
        :class:`kvserve.core.kv_cache_manager.ResidualSlots`)."""
        self.runner = ModelRunner(self.model, self.kv_caches, block_tables, block_size, self.device,
                                  sliding_window=sliding_window)
        self.runner.residual_map = residual_map
        self.kv_mover.residual_map = residual_map
        self.runner.compressor = self.kv_mover.compressor

    def execute_model(self, scheduler_output: SchedulerOutput,
                      broadcast: Optional[Callable[[KVCacheOps, tuple], None]] = None) -> ModelRunnerOutput:
        """One step: its block ops (``scheduler_output.kv_ops``: :meth:`apply_kv_ops`), then its
        forward and sampling (:meth:`ModelRunner.execute`).

        Args:
            scheduler_output: the step.
            broadcast: with several ranks, the executor's ``broadcast(kv_ops, inputs)``, called
                once the batch tensors are built and before the forward: it sends the other ranks
                what they need for :meth:`execute_forward`.

        Raises:
            KVCacheOpsError: applying the ops failed (nothing ran).
        """
        self._pin_threads()
        if scheduler_output.kv_ops:
            self.apply_kv_ops(scheduler_output.kv_ops)
        if broadcast is None:
            return self.runner.execute(scheduler_output)
        ops = scheduler_output.kv_ops
        return self.runner.execute(scheduler_output, lambda batch: broadcast(ops, _rank_inputs(batch)))

    @torch.inference_mode()
    def execute_forward(self, kv_ops: KVCacheOps, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                        logits_indices: torch.Tensor, residual: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None
                        ) -> None:
        """A rank other than the driver's part of a step: the step's block ops, then the
        forward over the driver's batch tensors (``input_ids`` / ``positions`` ``[T]`` int64,
        the :class:`~kvserve.worker.attention.AttentionMetadata`, ``logits_indices`` ``[S]``
        int64); the logits go to the driver.

        ``residual`` (2-/4-bit pools): the KV manager's residual map as of this step, sparse
        (``blocks``, ``slots``: ``[N]`` int64 each, the blocks that hold a residual slot, and
        the pool's ``num_blocks``): the rank's copy of the map is rebuilt from it before the
        block ops (a block copy reads it) and the forward (:func:`_rank_inputs` sends it; the
        driver reads the KV manager's map itself).

        Raises:
            KVCacheOpsError: applying the ops failed.
        """
        self._pin_threads()
        if residual is not None:
            self._set_residual_map(*residual)
            meta.residual_map = self.kv_mover.residual_map
        if kv_ops:
            self.apply_kv_ops(kv_ops)
        meta = _to_device(meta, self.device)
        self.model(input_ids.to(self.device), positions.to(self.device), self.kv_caches, meta,
                   logits_indices.to(self.device))
        if meta.kv_probes:  # (this rank's KV heads' compression scores)
            self.kv_mover.compressor.accumulate(meta)

    def _set_residual_map(self, blocks: torch.Tensor, slots: torch.Tensor, num_blocks: int) -> None:
        """This rank's ``block → residual slot`` map (``[num_blocks]`` int64, -1: none) set to
        the driver's: ``slots`` at ``blocks``, -1 elsewhere. A map of the rank's own: the one
        ``init_model_runner`` got may share its memory with the driver's (a tensor sent over a
        ``multiprocessing`` pipe goes through shared memory), which must not be written here."""
        rmap = self._rank_residual_map
        if rmap is None or rmap.numel() != num_blocks:
            rmap = self._rank_residual_map = torch.empty(num_blocks, dtype=torch.long, device=self.device)
        rmap.fill_(-1)
        rmap.index_copy_(0, blocks.to(self.device), slots.to(self.device))
        self.kv_mover.residual_map = rmap

    def _pin_threads(self) -> None:
        """This thread's torch threads to the rank's share of the cores (a no-op at one rank)."""
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def shutdown(self) -> None:
        """Leave the tensor-parallel group (:func:`kvserve.distributed.destroy_distributed`);
        idempotent: once left, a later call leaves nothing (not another engine's group). The disk
        tier's queued writes are written first."""
        self.close_kv_offload()
        if self._in_group:
            self._in_group = False
            parallel_state.destroy_distributed()


def _rank_inputs(batch) -> tuple:
    """What the other ranks get of a step's batch for :meth:`Worker.execute_forward`: its
    tensors and metadata; with 2-/4-bit pools the residual map goes sparse, as ``(blocks,
    slots, num_blocks)`` of the blocks holding a slot (a few per running sequence, not one
    entry per block of the pool), beside metadata without it."""
    meta = batch.meta
    rmap = meta.residual_map
    if rmap is None:
        return batch.input_ids, batch.positions, meta, batch.logits_indices
    blocks = torch.nonzero(rmap >= 0).flatten()
    sent = dataclasses.replace(meta, residual_map=None)
    return batch.input_ids, batch.positions, sent, batch.logits_indices, (blocks.cpu(), rmap[blocks].cpu(), rmap.numel())


def _to_device(obj, device: torch.device):
    """``obj`` (attention metadata: a dataclass of tensors, lists of them) with its tensors on
    ``device`` (in place; nothing moves on the device they are already on)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            setattr(obj, name, _to_device(getattr(obj, name), device))
    return obj


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
