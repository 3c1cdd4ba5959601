"""The front end's end of one Ray Serve engine replica (:mod:`kvserve.engine.replica`).

:class:`ReplicaClient` has :class:`~kvserve.engine.core_client.CoreClient`'s interface (the
tokenizer, the model config, an input processor; ``start_io`` / ``send`` / ``is_alive`` /
``shutdown``), so an :class:`~kvserve.entrypoints.openai.async_engine.MPAsyncEngine` drives a
replica exactly as it drives the engine core process. The messages travel through the
replica's ``DeploymentHandle`` instead of pipes:

* a writer thread sends the queued commands in order, all that are waiting in one
  ``commands`` call, the next call only once the previous one returned (so an abort never
  overtakes its add); when idle it pings every :data:`PING_S` seconds;
* a reader thread iterates the replica's ``outputs()`` stream; when the stream fails (the
  replica's actor died, Ray Serve is replacing it) ``on_exit(None)`` runs once, as when the
  core process dies.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from kvserve.engine.core_client import CoreClient
from kvserve.engine.core_proc import CoreInfo

logger = logging.getLogger("kvserve.engine.replica_client")

#: seconds between the front end's pings to an idle replica
PING_S = 2.0
#: seconds a command call may take before the replica counts as gone
COMMAND_TIMEOUT_S = 60.0


class ReplicaClient(CoreClient):
    """:class:`CoreClient`'s interface over a Ray Serve replica.

    Args:
        name: the replica's name in logs, metrics and ``/health`` (e.g. ``"replica-0"``).
        handle: the replica application's ``DeploymentHandle``.
        info: what the replica's ``info()`` returned.
        tokenizer: the model's tokenizer (loaded once by the caller, shared by the clients).
        args: the replica's :class:`~kvserve.engine.args.EngineArgs`.
    """

    def __init__(self, name: str, handle, info: CoreInfo, tokenizer, args) -> None:  # noqa: D107 - no process
        self.name = name
        self.handle = handle
        self.args = args
        self.pid = info.pid
        self._set_info(info, tokenizer)
        self._closed = False
        self._gone = threading.Event()
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        self._stream = None

    # ------------------------------------------------------------ messages
    def start_io(self, on_message: Callable[[tuple], None], on_exit: Callable[[Optional[int]], None]) -> None:
        """Start the writer and reader threads (see :meth:`CoreClient.start_io`)."""
        if self._reader is not None:
            return
        self._stream = self.handle.options(stream=True).outputs.remote()
        self._writer = threading.Thread(target=self._write_loop, name=f"kvserve-{self.name}-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, args=(on_message, on_exit),
                                        name=f"kvserve-{self.name}-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _write_loop(self) -> None:
        while not self._gone.is_set():
            try:
                msgs = [self._sendq.get(timeout=PING_S)]
            except queue.Empty:
                msgs = [("ping",)]
            if msgs[0] is None:
                return
            while True:
                try:
                    msg = self._sendq.get_nowait()
                except queue.Empty:
                    break
                if msg is None:
                    self._send_now(msgs)
                    return
                msgs.append(msg)
            if not self._send_now(msgs):
                return

    def _send_now(self, msgs: list) -> bool:
        try:
            self.handle.commands.remote(msgs).result(timeout_s=COMMAND_TIMEOUT_S)
            return True
        except Exception as e:  # noqa: BLE001 - the replica is gone: the reader reports it
            if not self._closed:
                logger.warning("%s: sending %d command(s) failed: %s", self.name, len(msgs), e)
            self._gone.set()
            return False

    def _read_loop(self, on_message, on_exit) -> None:
        try:
            for batch in self._stream:
                for msg in batch:
                    try:
                        on_message(msg)
                    except Exception:  # noqa: BLE001 - a bug in a handler must not stop the reader
                        logger.exception("handling %s's %r message failed", self.name, msg[0])
        except Exception as e:  # noqa: BLE001 - the replica died or was replaced
            if not self._closed:
                logger.error("%s: the replica's output stream ended: %s: %s", self.name, type(e).__name__, e)
        self._gone.set()
        self._sendq.put(None)
        on_exit(None)

    @property
    def exitcode(self) -> Optional[int]:
        return None

    def death_message(self, exitcode: Optional[int]) -> str:
        return f"the engine replica {self.name} died or became unreachable (Ray Serve is replacing it)"

    def is_alive(self) -> bool:
        """Whether the replica is reachable (its output stream runs)."""
        return not self._closed and not self._gone.is_set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort this front end's requests on the replica and stop the threads (the replica
        itself belongs to Ray Serve); idempotent."""
        if self._closed:
            return
        if self._writer is not None and not self._gone.is_set():
            self._sendq.put(("abort_all",))
        self._sendq.put(None)
        if self._writer is not None:
            self._writer.join(min(timeout, 5.0))
        self._closed = True
        if self._stream is not None:
            try:
                self._stream.cancel()
            except Exception:  # noqa: BLE001 - already over
                pass
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(min(timeout, 5.0))


class ReplicaPool:
    """The front end's end of a :class:`~kvserve.engine.ray_serve.ReplicaDeployment`: the
    attributes the OpenAI server needs (as :class:`CoreClient`'s: the tokenizer, the model
    config, ``max_model_len``, an input processor), and a :class:`ReplicaClient` per replica.

    Args:
        deployment: the started deployment (this pool owns it: :meth:`shutdown` stops it).
        routing: the router's policy (:data:`kvserve.engine.router.ROUTING_POLICIES`).

    Raises:
        ValueError: an unknown ``routing``.
        TimeoutError, RayActorError...: a replica did not answer.
    """

    def __init__(self, deployment, routing: str = "prefix") -> None:
        from kvserve.engine.router import ROUTING_POLICIES
        from kvserve.engine.tokenizer import load_tokenizer
        from kvserve.worker.loader import resolve_model_path

        if routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {list(ROUTING_POLICIES)}, got {routing!r}")
        self.deployment = deployment
        self.routing = routing
        self.args = deployment.args
        self.specs = {s.name: s for s in deployment.specs}
        self.disaggregated = any(s.role != "replica" for s in deployment.specs)
        tokenizer = load_tokenizer(resolve_model_path(self.args.model))
        self.clients: dict[str, ReplicaClient] = {}
        for name in self.specs:
            self.clients[name] = self.connect(name, deployment.info(name), tokenizer)
        first = next(iter(self.clients.values()))
        self.tokenizer = tokenizer
        for attr in ("model_config", "model_path", "max_model_len", "eos_token_ids", "input_processor",
                     "structured_output", "kv_spec_description"):
            setattr(self, attr, getattr(first, attr))

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def role(self, name: str) -> str:
        return self.specs[name].role

    def connect(self, name: str, info: CoreInfo, tokenizer=None) -> ReplicaClient:
        """A new client of replica ``name`` (after Ray Serve replaced it: ``info`` is the new one's)."""
        return ReplicaClient(name, self.deployment.handles[name], info, tokenizer or self.tokenizer,
                             self.deployment.args)

    async def info_async(self, name: str) -> CoreInfo:
        """Replica ``name``'s :class:`CoreInfo`, awaited (blocks while Ray Serve has no replica up)."""
        return await self.deployment.handles[name].info.remote()

    def encode(self, prompt: str) -> list[int]:
        return self.input_processor.encode(prompt)

    def truncate_prompt(self, ids: list[int], text: Optional[str], k: Optional[int]) -> tuple[list[int], Optional[str]]:
        return self.input_processor.truncate_prompt(ids, text, k)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the clients and the deployment (idempotent)."""
        for c in self.clients.values():
            c.shutdown(timeout)
        self.deployment.shutdown()
