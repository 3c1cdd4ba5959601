"""The ``"local"`` KV connector: saved blocks kept in this process's memory.

For engines that share a process (tests, a single-process deployment), and the reference the
other connectors are checked against. The blocks are kept until the decode engine has loaded
them (each worker's shard is dropped once fetched: a key is loaded once) or
:meth:`LocalKVConnector.release` is called; ``max_bytes`` bounds what is kept (the oldest saves
go first). A fetch copies out only the blocks asked for (those the decode engine's prefix cache
lacks).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from kvserve.distributed.kv_transfer.base import KVConnector, KVPayload, KVTransferError, payload_bytes


class LocalKVConnector(KVConnector):
    """Saved blocks in a dict of this process.

    Args:
        max_bytes: most bytes kept; saving more drops the oldest saves (a decode engine that
            loads a dropped one gets a :class:`KVTransferError`, and recomputes that request's
            prompt; one that arrives after the drop is refused).
    """

    name = "local"

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self._store: OrderedDict[int, list] = OrderedDict()  # key -> per rank payload (None once fetched)
        self._bytes: dict[int, int] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """Bytes kept now."""
        return sum(self._bytes.values())

    def save(self, payloads: Sequence[KVPayload]) -> Any:
        nbytes = sum(payload_bytes(p) for p in payloads)
        with self._lock:
            key = next(self._keys)
            self._store[key] = list(payloads)
            self._bytes[key] = nbytes
            while self.num_bytes > self.max_bytes and len(self._store) > 1:
                old, _ = self._store.popitem(last=False)
                self._bytes.pop(old, None)
            self.num_saved += 1
            self.num_saved_bytes += nbytes
        return key

    def fetch(self, key: Any, rank: int, blocks: Sequence[int]) -> KVPayload:
        with self._lock:
            per_rank = self._store.get(key)
            if per_rank is None or per_rank[rank] is None:
                self.num_failed += 1
                raise KVTransferError(f"KV transfer {key!r}: no saved blocks (loaded already, released or dropped, "
                                      f"or saved in another process)")
            payload = per_rank[rank]
            per_rank[rank] = None  # (a handle is loaded once)
            if all(p is None for p in per_rank):
                del self._store[key]
                self._bytes.pop(key, None)
        if list(blocks) != list(range(payload[0][0].shape[0])):
            idx = torch.tensor(list(blocks), dtype=torch.long)
            payload = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in payload]
        with self._lock:
            self.num_loaded_blocks += len(blocks)
            self.num_loaded_bytes += payload_bytes(payload)
        return payload

    def has(self, key: Any) -> bool:
        with self._lock:
            return key in self._store

    def release(self, key: Any) -> None:
        with self._lock:
            self._store.pop(key, None)
            self._bytes.pop(key, None)
