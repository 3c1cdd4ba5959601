"""The KV connector interface (:class:`KVConnector`), its handle (:class:`KVTransferHandle`), and
the error a failed load raises (:class:`KVTransferError`)."""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch

#: One worker's saved blocks: per layer ``(K, V)``, each ``[num_blocks, block_size, num_kv_heads,
#: row]`` in the pools' dtype, on the CPU (``row``: ``head_dim``, or ``head_dim + 4`` for 8-bit
#: pools, whose rows carry their scale).
KVPayload = list[tuple[torch.Tensor, torch.Tensor]]


#: Seconds a connector waits for saved blocks (a fetch, an existence check) before it gives up
#: with a :class:`KVTransferError`: the default of :func:`kv_transfer_timeout_s`.
KV_TRANSFER_TIMEOUT_S = 30.0

#: The environment variable that overrides :data:`KV_TRANSFER_TIMEOUT_S` (seconds, > 0).
KV_TRANSFER_TIMEOUT_ENV = "KVSERVE_KV_TRANSFER_TIMEOUT_S"


class KVTransferError(RuntimeError):
    """Saved blocks could not be fetched: released or dropped, their owner (the prefill engine's
    process) died, or the fetch ran past :func:`kv_transfer_timeout_s`. One request's fault, not
    the engine's: the decode engine recomputes that request's prompt instead
    (:meth:`kvserve.core.kv_cache_manager.KVCacheManager.admit`)."""


def kv_transfer_timeout_s() -> float:
    """Seconds a fetch may wait: ``$KVSERVE_KV_TRANSFER_TIMEOUT_S`` if set, else
    :data:`KV_TRANSFER_TIMEOUT_S` (read at each call).

    Raises:
        ValueError: naming the variable: not a number of seconds > 0.
    """
    raw = os.environ.get(KV_TRANSFER_TIMEOUT_ENV, "").strip()
    if not raw:
        return KV_TRANSFER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{KV_TRANSFER_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def payload_bytes(payload: KVPayload) -> int:
    """Bytes of the tensors of one worker's payload."""
    return sum(t.numel() * t.element_size() for pair in payload for t in pair)


def token_digest(token_ids: Sequence[int]) -> str:
    """A short digest of token ids (a handle names the prompt it holds the K/V of)."""
    return hashlib.blake2b(repr(list(token_ids)).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class KVTransferHandle:
    """What a prefill engine hands back for one request, and a decode engine takes in: small
    and picklable (the K/V itself stays with the connector).

    Attributes:
        connector: the connector's name (:func:`get_connector`).
        key: the connector's reference to the saved blocks.
        num_tokens: tokens whose K/V were saved (the prompt's first ``P - 1``: the decode
            engine computes the last one itself, for its logits).
        prompt_digest: :func:`token_digest` of those tokens (a decode request whose prompt
            does not start with them is refused).
        block_size: tokens per block of the saved payload.
        layout: ``(num_layers, num_kv_heads, row, dtype, tensor_parallel_size)`` of the pools
            the blocks came from; a decode engine with another layout cannot take them.
        num_bytes: bytes saved, all workers (every block is whole, the last one too: a
            block's share is ``num_bytes // num_blocks``).
    """

    connector: str
    key: Any
    num_tokens: int
    prompt_digest: str
    block_size: int
    layout: tuple
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one saved block, all workers."""
        return self.num_bytes // self.num_blocks if self.num_tokens else 0


class KVConnector(ABC):
    """Keeps saved KV blocks between a prefill engine and a decode engine.

    A decode engine fetches only the blocks its prefix cache lacks, and a connector moves only
    those (:meth:`fetch`). Counters (this process's): ``num_saved`` / ``num_saved_bytes``
    (requests and bytes saved), ``num_loaded_blocks`` / ``num_loaded_bytes`` (blocks and bytes
    fetched), ``num_failed`` (fetches that raised :class:`KVTransferError`).
    """

    #: the name handles carry
    name: str = ""

    def __init__(self) -> None:
        self.num_saved = 0
        self.num_saved_bytes = 0
        self.num_loaded_blocks = 0
        self.num_loaded_bytes = 0
        self.num_failed = 0

    @abstractmethod
    def save(self, payloads: Sequence[KVPayload]) -> Any:
        """Keep one request's blocks (``payloads[rank]``: each worker's shard, per layer ``(K,
        V)`` of ``[num_blocks, block_size, num_kv_heads, row]``); returns the key a
        :class:`KVTransferHandle` carries (small and picklable)."""

    @abstractmethod
    def fetch(self, key: Any, rank: int, blocks: Sequence[int]) -> KVPayload:
        """Blocks ``blocks`` (indices into the saved payload, ascending) of worker ``rank``'s
        shard: per layer ``(K, V)`` of ``[len(blocks), block_size, num_kv_heads, row]``, on the
        CPU. Only those blocks move. A key is loaded once (:meth:`has` is False after).

        Raises:
            KVTransferError: the blocks are gone (released, dropped, loaded already, saved by
                another process's store, their owner died) or did not come within
                :func:`kv_transfer_timeout_s`.
        """

    @abstractmethod
    def has(self, key: Any) -> bool:
        """Whether the blocks of ``key`` can still be fetched (not loaded, not released, not
        lost): a cheap check that moves no block, made when a decode request arrives."""

    @abstractmethod
    def release(self, key: Any) -> None:
        """Drop saved blocks (unknown keys are ignored)."""


_CONNECTORS: dict[str, KVConnector] = {}


def get_connector(name: str) -> KVConnector:
    """This process's connector called ``name`` (``"local"`` or ``"ray"``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in _CONNECTORS:
        if name == "local":
            from kvserve.distributed.kv_transfer.local_connector import LocalKVConnector

            _CONNECTORS[name] = LocalKVConnector()
        elif name == "ray":
            from kvserve.distributed.kv_transfer.ray_connector import RayKVConnector

            _CONNECTORS[name] = RayKVConnector()
        else:
            raise ValueError(f"kv_connector must be 'local' or 'ray', got {name!r}")
    return _CONNECTORS[name]
