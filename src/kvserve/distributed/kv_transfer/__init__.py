"""KV connectors: moving a request's computed KV blocks from one engine to another.

Prefill/decode disaggregation (Splitwise, Patel et al. 2024; DistServe, Zhong et al. 2024)
runs a request's prefill on one engine and its decode on another, so long prompts do not stall
running decodes; the price is moving the prompt's K/V. vLLM hides the move behind a
``KVConnector``; kvserve's is the same idea, small:

* the **prefill engine** runs the request with ``kv_transfer_params={"do_remote_decode": True}``
  (usually ``max_tokens=1``); when it finishes, the engine core has its workers read the K/V of
  the prompt's first ``P - 1`` tokens out of their pools (:meth:`Worker.save_kv_blocks`) and
  hands them to the connector (:meth:`KVConnector.save`), which keeps them and returns a
  :class:`KVTransferHandle`; the handle comes back in ``RequestOutput.kv_transfer_params``;
* the **decode engine** gets the same prompt with ``kv_transfer_params=handle``: when it admits
  the request, it takes what its own prefix cache holds, allocates blocks for the rest, and
  has its workers load only those blocks at once (a ``load`` op, :mod:`kvserve.core.kv_ops`;
  :meth:`KVConnector.fetch` moves only the blocks asked for); the request then computes just
  its last prompt token (the one owed) and decodes. A load that fails (:class:`KVTransferError`:
  the blocks are gone, their owner died, the fetch timed out) fails neither the engine nor the
  request: the request recomputes its prompt after its cached blocks, and the failure is
  counted (``kv_transfer_failed`` in ``EngineCore.stats()``) and logged.

Connectors (:func:`get_connector`): ``"local"`` (:class:`LocalKVConnector`: a store in this
process, for engines that share one, and the reference for the others) and ``"ray"``
(:class:`~kvserve.distributed.kv_transfer.ray_connector.RayKVConnector`: Ray's object store,
one object per block: shared memory on one node, Ray's transfer across nodes).
``torch.distributed`` send/recv (NCCL on GPUs) or NIXL would plug in behind the same calls.

The prefix cache's disk tier (``kv_offload_dir``, :mod:`kvserve.core.kv_offload`) reads through
the same load path: its ``"disk"`` connector
(:class:`~kvserve.distributed.kv_transfer.disk_connector.DiskKVConnector`) is each worker's own
(one per rank, it reads and writes that rank's shard files), not a process-wide one.
"""

from kvserve.distributed.kv_transfer.base import (KV_TRANSFER_TIMEOUT_S, KVConnector, KVTransferError,
                                                  KVTransferHandle, get_connector, kv_transfer_timeout_s)
from kvserve.distributed.kv_transfer.local_connector import LocalKVConnector

__all__ = ["KV_TRANSFER_TIMEOUT_S", "KVConnector", "KVTransferError", "KVTransferHandle", "LocalKVConnector",
           "get_connector", "kv_transfer_timeout_s"]
