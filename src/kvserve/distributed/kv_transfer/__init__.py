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
  records a ``load`` of only those blocks (:mod:`kvserve.core.kv_ops`), which its workers apply
  before the next forward (:meth:`KVConnector.fetch`); the request then computes just its last
  prompt token (the one owed) and decodes.

Connectors (:func:`get_connector`): ``"local"`` (:class:`LocalKVConnector`: a store in this
process, for engines that share one, and the reference for the others) and ``"ray"``
(:class:`~kvserve.distributed.kv_transfer.ray_connector.RayKVConnector`: Ray's object store,
shared memory on one node, Ray's transfer across nodes). ``torch.distributed`` send/recv (NCCL
on GPUs) or NIXL would plug in behind the same calls.
"""

from kvserve.distributed.kv_transfer.base import KVConnector, KVTransferHandle, get_connector
from kvserve.distributed.kv_transfer.local_connector import LocalKVConnector

__all__ = ["KVConnector", "KVTransferHandle", "LocalKVConnector", "get_connector"]
