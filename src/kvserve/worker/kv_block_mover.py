"""A worker's side of the KV block operations: its host (swap) pool and the moves between its
pools (:class:`KVBlockMover`).

The engine core records block copies and swaps (:mod:`kvserve.core.kv_ops`); each worker
applies them to the pools it holds (with tensor parallelism, its shard of every layer: its KV
heads), in the order recorded, before the step's forward. The host pool of the swap space lives
here too, one per worker (each rank its own shard); the core only counts its blocks
(:class:`kvserve.core.kv_swap.KVSwapSpace`).

The host pool has the device pool's row format: per layer one K and one V tensor
``[num_host_blocks, block_size, num_kv_heads, row]`` of the device pools' dtype (``row`` is
``head_dim``, or ``head_dim + 4`` for the 8-bit caches, whose rows carry their float32 scale:
:mod:`kvserve.worker.kv_quant`), so a block moves as raw bytes. On CUDA it is pinned CPU memory
and the copies are ``non_blocking``; on CPU it is one more tensor in RAM. With 2-/4-bit pools
(:class:`~kvserve.worker.kv_quant_lowbit.LowBitPool`) the host pool is LowBitPools too: the packed
blocks ``[num_host_blocks, num_kv_heads, block_bytes]`` uint8 and a host residual area
``[num_host_residual, block_size, num_kv_heads, head_dim]`` of the model dtype, into which a
swapped sequence's partial last block (its rows in a device residual slot) moves with it; the
swap ops name the slots (:attr:`kvserve.core.kv_ops.BlockMoves.source`).

Each batch of moves (:class:`kvserve.core.kv_ops.BlockMoves`) is one ``index_select`` and one
``index_copy_`` per layer and K/V: swaps index whole blocks, copies index the token slots of the
pools seen as ``[num_blocks · block_size, num_kv_heads, row]`` (a copy may move a block's first
slots only).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from kvserve.core.kv_ops import COMPACT, COPY, FORGET, LOAD, OFFLOAD, SWAP_IN, SWAP_OUT, KVCacheOps
from kvserve.worker.kv_compressor import KVCompressor
from kvserve.worker.kv_quant_lowbit import LowBitPool, copy_prefix

GiB = 1 << 30

KVPools = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the moves index it: a float8 pool as its bytes (``uint8``, the same storage: torch
    has no ``index_copy_`` for float8 on the CPU, and a move copies bytes anyway), others as is."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


#: per kind of block move, the fields holding block ids and the pool they index (loads' ``src`` and
#: offloads' ``dst`` index a payload and a key list, not a pool)
_BLOCK_ID_POOLS = {COPY: (("src", "device"), ("dst", "device")), SWAP_OUT: (("src", "device"), ("dst", "host")),
                   SWAP_IN: (("src", "host"), ("dst", "device")), LOAD: (("dst", "device"),),
                   OFFLOAD: (("src", "device"),)}


def _store(c) -> torch.Tensor:
    """The tensor a pool's blocks are stored in, indexed by block on dim 0: a 2-/4-bit pool's
    packed ``data`` (uint8 ``[num_blocks, num_kv_heads, block_bytes]``), other pools themselves."""
    return c.data if isinstance(c, LowBitPool) else c


class KVBlockMover:
    """Applies :class:`~kvserve.core.kv_ops.KVCacheOps` to one worker's pools.

    Args:
        kv_caches: the device pools, per layer ``(K, V)``, each ``[num_blocks, block_size,
            num_kv_heads, row]`` (any dtype, 8-bit rows with their scales included; contiguous).
        rank: the worker's tensor-parallel rank (which shard of a KV connector's payload it loads).

    Attributes:
        host_caches: the host pool (:meth:`allocate_host`), per layer ``(K, V)``, each
            ``[num_host_blocks, block_size, num_kv_heads, row]`` of the device pools' dtype on
            the CPU; None without a swap space.
        pin: the host pool is pinned memory (a CUDA device).
        block_bytes: bytes of one block, all layers, K and V (2-/4-bit pools: packed).
        residual_bytes: bytes of one residual slot, all layers, K and V (2-/4-bit pools; else 0).
        disk: the disk tier's connector of this rank
            (:class:`~kvserve.distributed.kv_transfer.disk_connector.DiskKVConnector`), which
            ``offload`` ops write to and loads of the ``"disk"`` connector read from; None without one.
    """

    def __init__(self, kv_caches: KVPools, rank: int = 0) -> None:
        self.kv_caches = kv_caches
        self.rank = rank
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.block_size = k0.shape[1]
        self.pin = self.device.type == "cuda"
        if isinstance(k0, LowBitPool):  # (packed K and V blocks differ in size; a residual slot apart)
            self.block_bytes = sum(math.prod(c.data.shape[1:]) for pair in kv_caches for c in pair)
            self.residual_bytes = sum(math.prod(c.residual.shape[1:]) * c.residual.element_size()
                                      for pair in kv_caches for c in pair)
        else:
            self.block_bytes = math.prod(k0.shape[1:]) * k0.element_size() * 2 * len(kv_caches)
            self.residual_bytes = 0
        self.host_caches: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.disk = None
        self.compressor = KVCompressor(kv_caches)  # KV compression: scores and compactions
        #: 2-/4-bit pools: the KV manager's ``block → residual slot`` map (set with the model runner)
        self.residual_map: Optional[torch.Tensor] = None

    def allocate_host(self, num_blocks: int, num_residual: int = 0) -> None:
        """Allocate the host pool of ``num_blocks`` blocks (zero-filled; pinned on CUDA); for
        2-/4-bit pools with ``num_residual`` host residual slots (0: a swap of a partial block
        has nowhere to go; the core then recomputes such victims).

        Raises:
            ValueError: ``num_blocks`` below 1 or ``num_residual`` below 0, or the host pool
                (``num_blocks · block_bytes + num_residual · residual_bytes``) is larger than the
                memory available (``MemAvailable``), or cannot be allocated; the message names
                ``swap_space``.
        """
        from kvserve.core.kv_cache_manager import available_memory

        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        if num_residual < 0:
            raise ValueError(f"num_residual must be ≥ 0, got {num_residual}")
        lowbit = isinstance(self.kv_caches[0][0], LowBitPool)
        need = num_blocks * self.block_bytes + (num_residual * self.residual_bytes if lowbit else 0)
        have = available_memory(torch.device("cpu"))
        if have is not None and need > have:
            raise ValueError(f"swap_space: the host pool needs {need / GiB:.2f} GiB ({num_blocks} blocks), but only "
                             f"{have / GiB:.2f} GiB of host memory is available; lower swap_space (--swap-space)")

        def zeros(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=self.pin)

        try:
            if lowbit:
                self.host_caches = [
                    tuple(LowBitPool(zeros((num_blocks, *c.data.shape[1:]), torch.uint8),
                                     zeros((num_residual, *c.residual.shape[1:]), c.residual.dtype),
                                     c.bits, c.is_key, c.block_size, c.head_dim) for c in pair)
                    for pair in self.kv_caches
                ]
            else:
                self.host_caches = [tuple(zeros((num_blocks, *c.shape[1:]), c.dtype) for c in pair)
                                    for pair in self.kv_caches]
        except (RuntimeError, MemoryError) as e:
            raise ValueError(f"swap_space: could not allocate the host pool of {need / GiB:.2f} GiB ({e}); lower "
                             f"swap_space (--swap-space)") from e

    # ------------------------------------------------------------------ moves
    def apply(self, ops: KVCacheOps) -> None:
        """Apply every batch of ``ops``, in order (:mod:`kvserve.core.kv_ops`).

        Raises:
            ValueError: an unknown kind, or a swap without a host pool.
            IndexError: a block id out of range of its pool; checked on the host for every batch
                before any is applied (on CUDA an out-of-range ``index_copy_`` would only be a
                device-side assert at some later call, leaving the CUDA context unusable).
            KVTransferError: a load's fetch failed (:meth:`_load`); the batches before it were
                applied, the load and those after it were not.
        """
        self._check_block_ids(ops)
        for b in ops.batches:
            if not b.src and b.kind != OFFLOAD:
                continue
            if b.kind == COPY:
                self._copy(b.src, b.dst, b.num_tokens)
            elif b.kind in (SWAP_OUT, SWAP_IN):
                if self.host_caches is None:
                    raise ValueError(f"{b.kind} of {len(b.src)} blocks, but this worker has no host pool")
                (self._swap_out if b.kind == SWAP_OUT else self._swap_in)(b.src, b.dst)
                if b.source is not None:
                    self._swap_residual(b.kind == SWAP_OUT, *b.source)
            elif b.kind == LOAD:
                self._load(b.source, b.src, b.dst)
            elif b.kind == OFFLOAD:
                self._offload(b.src, b.dst, *b.source)
            elif b.kind == COMPACT:
                self.compressor.compact(b.source)
            elif b.kind == FORGET:
                self.compressor.forget(b.source)
            else:
                raise ValueError(f"unknown KV op kind {b.kind!r}")

    def _check_block_ids(self, ops: KVCacheOps) -> None:
        """Raise IndexError for a block id of ``ops`` outside its pool (device or host)."""
        size = {"device": _store(self.kv_caches[0][0]).shape[0] if self.kv_caches else 0,
                "host": _store(self.host_caches[0][0]).shape[0] if self.host_caches else 0}
        for b in ops.batches:
            for field, pool in _BLOCK_ID_POOLS.get(b.kind, ()):
                ids, n = getattr(b, field), size[pool]
                if ids and (min(ids) < 0 or max(ids) >= n):
                    bad = next(i for i in ids if not 0 <= i < n)
                    raise IndexError(f"{b.kind}: {field} block {bad} is out of range of the {pool} pool "
                                     f"of {n} blocks")

    def save(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K/V of device blocks ``blocks``, copied out: per layer ``(K, V)``, each
        ``[len(blocks), block_size, num_kv_heads, row]`` in the pools' dtype (2-/4-bit pools: the
        packed blocks, uint8 ``[len(blocks), num_kv_heads, block_bytes]``), on the CPU (a KV
        connector's payload, :mod:`kvserve.distributed.kv_transfer`)."""
        flat = self.save_blocks(blocks)
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(self.kv_caches))]

    def save_blocks(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """The K/V of device blocks ``blocks`` copied out to the CPU (one gather per pool, the only
        copy): ``2 · num_layers`` tensors ``[len(blocks), block_size, num_kv_heads, row]``, layer
        ``l``'s K at ``2l`` and V at ``2l + 1`` (the parts of the disk tier's files,
        :meth:`DiskKVConnector.put`). From 2-/4-bit pools, the quantized blocks as stored: uint8
        ``[len(blocks), num_kv_heads, block_bytes]`` (:class:`~kvserve.worker.kv_quant_lowbit.LowBitPool`
        ``data``; a block's residual rows are not part of it: only full blocks are saved)."""
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        return [_store(c).index_select(0, idx).to("cpu") for pair in self.kv_caches for c in pair]

    def _offload(self, device_blocks: list[int], key_index: list[int], keys: tuple, drop: tuple) -> None:
        """Copy device blocks out and queue their files to the disk tier's writer, then queue the
        deletion of the files ``drop`` (:mod:`kvserve.core.kv_offload`).

        Raises:
            ValueError: this worker has no disk tier.
        """
        if self.disk is None:
            raise ValueError(f"offload of {len(device_blocks)} blocks, but this worker has no disk tier")
        if device_blocks:
            self.disk.put([keys[i] for i in key_index], self.save_blocks(device_blocks))
        if drop:
            self.disk.delete(drop)

    def _load(self, handle, payload_blocks: list[int], device_blocks: list[int]) -> None:
        """Write blocks ``payload_blocks`` of a KV connector's saved payload (``handle``: its
        :class:`~kvserve.distributed.kv_transfer.KVTransferHandle`) into device blocks; only those
        blocks are fetched (:meth:`KVConnector.fetch`). Into 2-/4-bit pools the payload's blocks
        are packed ones (uint8 ``[n, num_kv_heads, block_bytes]``, full blocks: the destination
        blocks have no residual slot) written into the pools' ``data``.

        Raises:
            KVTransferError: the fetch failed (the blocks are gone, their owner died, the fetch
                timed out, no such connector here), or the payload does not fit the pools;
                nothing was written then.
        """
        from kvserve.distributed.kv_transfer import KVTransferError, get_connector

        try:
            conn = self.disk if handle.connector == "disk" and self.disk is not None else get_connector(handle.connector)
            payload = conn.fetch(handle.key, self.rank, payload_blocks)
        except KVTransferError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a process not connected to Ray: the request recomputes
            raise KVTransferError(f"KV transfer: {type(e).__name__}: {e}") from e
        n = len(device_blocks)
        if len(payload) != len(self.kv_caches) or any(
                t.shape != (n, *_store(c).shape[1:]) or t.dtype != _store(c).dtype
                for dev, saved in zip(self.kv_caches, payload) for c, t in zip(dev, saved)):
            first = f", {tuple(payload[0][0].shape)} {payload[0][0].dtype}" if payload else ""
            k0 = _store(self.kv_caches[0][0])
            raise KVTransferError(f"KV transfer: a payload of {len(payload)} layers{first} does not fit {n} blocks of "
                                  f"pools of {len(self.kv_caches)} layers, {tuple(k0.shape[1:])} {k0.dtype}")
        dst = torch.tensor(device_blocks, dtype=torch.long, device=self.device)
        for dev, saved in zip(self.kv_caches, payload):
            for c, t in zip(dev, saved):
                _raw(_store(c)).index_copy_(0, dst, _raw(t).to(self.device))

    def _copy(self, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
        """Copy slots ``0 .. num_tokens[i] - 1`` of device block ``src[i]`` into ``dst[i]``, all at
        once: one gather and one scatter of token rows per layer and K/V. Into 2-/4-bit pools the
        rows are dequantized (or read from the source's residual slot) into the destination's
        residual slot (:func:`kvserve.worker.kv_quant_lowbit.copy_prefix`)."""
        if isinstance(self.kv_caches[0][0], LowBitPool):
            for pair in self.kv_caches:
                for c in pair:
                    copy_prefix(c, src, dst, num_tokens, self.residual_map)
            return
        bs = self.block_size
        src_slots = [s * bs + j for s, n in zip(src, num_tokens) for j in range(n)]
        dst_slots = [d * bs + j for d, n in zip(dst, num_tokens) for j in range(n)]
        src_i = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst_i = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        for pair in self.kv_caches:
            for c in pair:
                # [num_blocks · block_size, heads, row]: a view (raises if it cannot be one)
                rows = _raw(c).view(-1, *c.shape[2:])
                rows.index_copy_(0, dst_i, rows.index_select(0, src_i))

    def _swap_residual(self, out: bool, src: list[int], dst: list[int]) -> None:
        """2-/4-bit pools: copy residual slots ``src`` into ``dst`` (device → host slots for a
        swap-out, host → device for a swap-in), every layer, K and V: a swapped sequence's partial
        last block, whose rows live in a model-dtype residual slot, not in the packed blocks."""
        sdev, ddev = (self.device, torch.device("cpu")) if out else (torch.device("cpu"), self.device)
        s = torch.tensor(src, dtype=torch.long, device=sdev)
        d = torch.tensor(dst, dtype=torch.long, device=ddev)
        for dev, host in zip(self.kv_caches, self.host_caches):
            for c, h in zip(dev, host):
                a, b = (c, h) if out else (h, c)
                b.residual.index_copy_(0, d, a.residual.index_select(0, s).to(ddev))

    def _swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Copy whole device blocks into host blocks (on CUDA: gathered into pinned staging
        buffers asynchronously, one wait, then the host scatter); 2-/4-bit pools: their packed
        blocks (the residual slots: :meth:`_swap_residual`)."""
        n = len(device_blocks)
        src = torch.tensor(device_blocks, dtype=torch.long, device=self.device)
        dst = torch.tensor(host_blocks, dtype=torch.long)
        pairs = [(_raw(_store(c)), _raw(_store(h)))
                 for dev, host in zip(self.kv_caches, self.host_caches) for c, h in zip(dev, host)]
        if self.pin:
            staged = []
            for c, _ in pairs:
                buf = torch.empty((n, *c.shape[1:]), dtype=c.dtype, pin_memory=True)
                buf.copy_(c.index_select(0, src), non_blocking=True)
                staged.append(buf)
            torch.cuda.current_stream(self.device).synchronize()
            for (_, h), buf in zip(pairs, staged):
                h.index_copy_(0, dst, buf)
        else:
            for c, h in pairs:
                h.index_copy_(0, dst, c.index_select(0, src))

    def _swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy whole host blocks into device blocks (on CUDA: gathered into pinned memory and
        copied asynchronously; PyTorch's caching host allocator keeps the buffer until the copy
        is done)."""
        n = len(host_blocks)
        src = torch.tensor(host_blocks, dtype=torch.long)
        dst = torch.tensor(device_blocks, dtype=torch.long, device=self.device)
        for dev, host in zip(self.kv_caches, self.host_caches):
            for c, h in zip(dev, host):
                c, h = _raw(_store(c)), _raw(_store(h))
                if self.pin:
                    buf = torch.empty((n, *h.shape[1:]), dtype=h.dtype, pin_memory=True)
                    rows = torch.index_select(h, 0, src, out=buf).to(self.device, non_blocking=True)
                else:
                    rows = h.index_select(0, src)
                c.index_copy_(0, dst, rows)
