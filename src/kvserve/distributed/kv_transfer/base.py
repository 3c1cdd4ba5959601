"""The KV connector interface (:class:`KVConnector`) and its handle (:class:`KVTransferHandle`)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch

#: One worker's saved blocks: per layer ``(K, V)``, each ``[num_blocks, block_size, num_kv_heads,
#: row]`` in the pools' dtype, on the CPU (``row``: ``head_dim``, or ``head_dim + 4`` for 8-bit
#: pools, whose rows carry their scale).
KVPayload = list[tuple[torch.Tensor, torch.Tensor]]


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
        num_bytes: bytes saved, all workers.
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


class KVConnector(ABC):
    """Keeps saved KV blocks between a prefill engine and a decode engine."""

    #: the name handles carry
    name: str = ""

    @abstractmethod
    def save(self, payloads: Sequence[KVPayload]) -> Any:
        """Keep one request's blocks (``payloads[rank]``: each worker's shard); returns the key
        a :class:`KVTransferHandle` carries."""

    @abstractmethod
    def fetch(self, key: Any, rank: int, blocks: Sequence[int]) -> KVPayload:
        """Blocks ``blocks`` (indices into the saved payload) of worker ``rank``'s shard.

        Raises:
            KeyError: no such key (released, or saved by another process's store).
        """

    @abstractmethod
    def has(self, key: Any) -> bool:
        """Whether the blocks of ``key`` are still kept (not loaded in full, not released)."""

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
