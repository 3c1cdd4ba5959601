"""The ``"ray"`` KV connector: saved blocks in Ray's object store, one object per block.

The prefill engine's process puts each block of each worker's shard into the object store as an
object of its own (``ray.put`` of one contiguous tensor ``[2 · num_layers, block_size,
num_kv_heads, row]``: per layer K then V, copied out so that an object never pickles the storage
of a larger tensor it is a view of; for the 2-/4-bit caches a tuple of the packed K and V blocks,
which differ in size), plus one small object that stands for the whole save. The
process owns the objects; a handle that travels to another process carries the ``ObjectRef`` s
(:class:`RayKVKey`) and Ray counts that process as a borrower. The decode engine's worker gets
only the blocks its prefix cache lacks (``ray.get`` of those blocks' refs: shared memory on one
node, Ray's own transfer across nodes), so a decode engine on another node pulls no block it
already holds.

Every ``ray.get`` waits at most :func:`~kvserve.distributed.kv_transfer.base.kv_transfer_timeout_s`
(30 s, ``$KVSERVE_KV_TRANSFER_TIMEOUT_S``); a fetch that fails (the owner died: Ray's
``OwnerDiedError`` / ``ObjectLostError``; the timeout) raises
:class:`~kvserve.distributed.kv_transfer.base.KVTransferError`, and the decode engine recomputes
that request's prompt. :meth:`RayKVConnector.has` checks that the owner still answers by getting
the small object (no block moves). Ray frees the objects when the last reference to them goes
(the owner's handle, and every borrower's); this Ray has no call to free them sooner.

Both processes must be connected to the same Ray cluster (Ray Serve replicas are; elsewhere
``ray.init`` first).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

import torch

from kvserve.distributed.kv_transfer.base import (KVConnector, KVPayload, KVTransferError, kv_transfer_timeout_s,
                                                  payload_bytes)


def _ray():
    """The ``ray`` module, connected.

    Raises:
        ValueError: naming ``kv_connector``: this process is not connected to a Ray cluster.
    """
    import ray

    if not ray.is_initialized():
        raise ValueError("kv_connector 'ray': this process is not connected to a Ray cluster (ray.init() first, "
                         "or run the engine in a Ray actor / Ray Serve replica)")
    return ray


class RayKVKey(NamedTuple):
    """The key of one saved request in Ray's object store (a handle's ``key``).

    Attributes:
        meta: an ``ObjectRef`` of a small object (the block count of each rank): getting it
            checks that the owner still answers, without moving a block.
        blocks: per rank, a tuple of one ``ObjectRef`` per block (in the payload's order), each a
            tensor ``[2 · num_layers, block_size, num_kv_heads, row]`` (layer ``l``'s K at
            ``2l``, its V at ``2l + 1``).
    """

    meta: Any
    blocks: tuple


def _pack_block(payload: KVPayload, b: int):
    """Block ``b`` of one worker's payload as one new contiguous tensor ``[2 · num_layers,
    block_size, num_kv_heads, row]`` (a copy: a view would pickle its whole storage); for the
    2-/4-bit caches, whose packed K and V blocks differ in size (uint8 ``[num_kv_heads,
    block_bytes]``, :mod:`kvserve.worker.kv_quant_lowbit`), a tuple of ``2 · num_layers`` copies."""
    parts = [t[b] for pair in payload for t in pair]
    if all(p.shape == parts[0].shape and p.dtype == parts[0].dtype for p in parts):
        return torch.stack(parts)
    return tuple(p.clone() for p in parts)


def _unpack_blocks(blocks: Sequence) -> KVPayload:
    """Per-block objects (:func:`_pack_block`) back to a payload: per layer ``(K, V)``, each
    ``[len(blocks), block_size, num_kv_heads, row]`` (contiguous views of one stacked tensor), or
    for 2-/4-bit blocks ``[len(blocks), num_kv_heads, block_bytes]`` each."""
    if not isinstance(blocks[0], torch.Tensor):
        parts = [torch.stack([blk[j] for blk in blocks]) for j in range(len(blocks[0]))]
        return [(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    x = torch.stack(list(blocks), dim=1)  # [2 · num_layers, n, block_size, heads, row]
    return [(x[i], x[i + 1]) for i in range(0, x.shape[0], 2)]


class RayKVConnector(KVConnector):
    """Saved blocks as objects in Ray's object store, one per block and rank; a key is a
    :class:`RayKVKey`. A key is loaded once: this process remembers the keys it loaded or
    released (``has``); releasing only forgets the key here (Ray frees the objects with their
    last reference)."""

    name = "ray"

    def __init__(self) -> None:
        super().__init__()
        kv_transfer_timeout_s()  # (a bad $KVSERVE_KV_TRANSFER_TIMEOUT_S is named when the connector starts)
        self._gone: set = set()  # hex ids of keys loaded in full or released here
        self._lock = threading.Lock()

    @staticmethod
    def _id(key: RayKVKey) -> str:
        return key.meta.hex()

    def save(self, payloads: Sequence[KVPayload]) -> RayKVKey:
        ray = _ray()
        blocks = tuple(tuple(ray.put(_pack_block(p, b)) for b in range(p[0][0].shape[0])) for p in payloads)
        key = RayKVKey(ray.put(tuple(len(r) for r in blocks)), blocks)
        with self._lock:
            self.num_saved += 1
            self.num_saved_bytes += sum(payload_bytes(p) for p in payloads)
        return key

    def fetch(self, key: RayKVKey, rank: int, blocks: Sequence[int]) -> KVPayload:
        ray = _ray()
        with self._lock:
            if self._id(key) in self._gone:
                self.num_failed += 1
                raise KVTransferError("KV transfer: these blocks were already loaded or released")
            if len(key.blocks) == 1:
                self._gone.add(self._id(key))
        timeout = kv_transfer_timeout_s()
        try:
            refs = [key.blocks[rank][b] for b in blocks]
            payload = _unpack_blocks(ray.get(refs, timeout=timeout))
        except Exception as e:  # noqa: BLE001 - OwnerDiedError, ObjectLostError, GetTimeoutError, ...
            with self._lock:
                self.num_failed += 1
            first_line = (str(e).splitlines() or [""])[0]
            raise KVTransferError(f"KV transfer: fetching {len(blocks)} block(s) from Ray's object store failed "
                                  f"(timeout {timeout:g} s): {type(e).__name__}: {first_line}") from e
        with self._lock:
            self.num_loaded_blocks += len(blocks)
            self.num_loaded_bytes += payload_bytes(payload)
        return payload

    def has(self, key: RayKVKey) -> bool:
        with self._lock:
            if self._id(key) in self._gone:
                return False
        try:
            _ray().get(key.meta, timeout=kv_transfer_timeout_s())
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - the owner died (its objects with it), or did not answer in time
            return False
        return True

    def release(self, key: RayKVKey) -> None:
        with self._lock:
            self._gone.add(self._id(key))
