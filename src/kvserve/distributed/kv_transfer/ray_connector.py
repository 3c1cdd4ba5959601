"""The ``"ray"`` KV connector: saved blocks in Ray's object store.

The prefill engine's process puts each worker's blocks into the object store
(``ray.put``: the process owns the object; a handle that travels to another process carries
the ``ObjectRef`` and Ray counts it as a borrower); the decode engine's worker fetches them
(``ray.get``: shared memory on one node, Ray's own transfer across nodes). Both processes must be
connected to the same Ray cluster (Ray Serve replicas are; elsewhere ``ray.init`` first).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from kvserve.distributed.kv_transfer.base import KVConnector, KVPayload


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


class RayKVConnector(KVConnector):
    """Saved blocks as objects in Ray's object store; a key is the tuple of per-rank
    ``ObjectRef`` s. A key is loaded once: this process remembers the keys it loaded or
    released (``has``), and releasing frees the objects."""

    name = "ray"

    def __init__(self) -> None:
        self._gone: set = set()  # hex ids of keys loaded in full or released here
        self._lock = threading.Lock()
        self.num_saved = 0
        self.num_loaded_blocks = 0

    @staticmethod
    def _id(key) -> str:
        return key[0].hex()

    def save(self, payloads: Sequence[KVPayload]) -> Any:
        ray = _ray()
        key = tuple(ray.put(p) for p in payloads)
        self.num_saved += 1
        return key

    def fetch(self, key: Any, rank: int, blocks: Sequence[int]) -> KVPayload:
        ray = _ray()
        with self._lock:
            if self._id(key) in self._gone:
                raise KeyError("KV transfer: these blocks were already loaded or released")
            if len(key) == 1:
                self._gone.add(self._id(key))
            self.num_loaded_blocks += len(blocks)
        payload = ray.get(key[rank])
        idx = torch.tensor(list(blocks), dtype=torch.long)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in payload]

    def has(self, key: Any) -> bool:
        with self._lock:
            return self._id(key) not in self._gone

    def release(self, key: Any) -> None:
        with self._lock:
            self._gone.add(self._id(key))
        try:
            from ray._private.internal_api import free

            free(list(key))
        except Exception:  # noqa: BLE001 - the objects go when their last reference does
            pass
