"""An engine core as a Ray Serve replica: :class:`EngineReplica`.

``kvserve serve --data-parallel-size N`` (and ``--prefill-replicas P --decode-replicas D``)
deploys one Ray Serve application per engine replica (:mod:`kvserve.engine.ray_serve`); each
runs this class: an :class:`~kvserve.engine.core.EngineCore` (scheduler, KV cache manager,
executor) stepping in a thread of the replica's actor, behind the same messages as the engine
core process (:mod:`kvserve.engine.core_proc`, whose loop it reuses). The front end's end is
:class:`kvserve.engine.replica_client.ReplicaClient`.

Methods (called through the replica's ``DeploymentHandle``):
    ``info()``: the :class:`~kvserve.engine.core_proc.CoreInfo` of the engine it built.
    ``commands([msg, ...])``: the core process's commands (``add``, ``abort``, ``finish``,
    ``call``, ``pause``, ``resume``), handled in order between steps, plus ``("ping",)`` (the
    front end is alive) and ``("abort_all",)``.
    ``outputs()``: a stream of message lists (``added``, ``outputs``, ``stats``, ``reply``,
    ``step_failed``: the core process's messages). One front end reads it at a time; a new
    ``outputs()`` call ends the previous one and aborts the requests of the front end before.
    ``check_health()``: Ray Serve's health check; raises once the engine cannot step any more
    (a worker died, the loop ended), and Ray Serve then replaces the replica.

Requests never outlive their front end: the replica aborts every live request when its
``outputs()`` stream is cancelled, or when no command (the front end pings every
:data:`~kvserve.engine.replica_client.PING_S` seconds) arrived for :data:`FRONT_END_TIMEOUT_S`
seconds while requests were live.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from typing import Optional

from kvserve.engine.core_proc import CoreInfo, _CoreLoop

logger = logging.getLogger("kvserve.engine.replica")

#: seconds without a command from the front end, with requests live, before they are aborted
FRONT_END_TIMEOUT_S = float(os.environ.get("KVSERVE_REPLICA_FRONT_END_TIMEOUT_S", "15"))


class _CommandQueue:
    """The command end the core loop reads: ``poll(timeout)`` / ``recv()``, fed from the actor."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition()
        self.last_put = time.monotonic()

    def put_all(self, msgs) -> None:
        with self._cond:
            self._items.extend(msgs)
            self.last_put = time.monotonic()
            self._cond.notify()

    def poll(self, timeout: float = 0.0) -> bool:
        with self._cond:
            if not self._items and timeout:
                self._cond.wait(timeout)
            return bool(self._items)

    def recv(self) -> tuple:
        with self._cond:
            return self._items.popleft()


class _OutputBuffer:
    """The output end the core loop writes (``send``); ``outputs()`` drains it on the actor's loop."""

    def __init__(self) -> None:
        self._items: list = []
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        with self._lock:
            self._loop, self._event = loop, asyncio.Event()
            self._items.clear()  # (a previous front end's messages)
            return self._event

    def send(self, msg: tuple) -> None:
        with self._lock:
            if msg[0] == "stats" and self._items and self._items[-1][0] == "stats":
                self._items[-1] = msg  # (idle stats: only the latest matters)
            else:
                self._items.append(msg)
            loop, event = self._loop, self._event
        if loop is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # (the actor's loop is closing)
                pass

    def take(self) -> list:
        with self._lock:
            items, self._items = self._items, []
            if self._event is not None:
                self._event.clear()
            return items


class _ReplicaLoop(_CoreLoop):
    """The core process's loop, with the replica's extra commands; it never exits on its own
    while the engine is healthy (the replica lives as long as Ray Serve keeps it)."""

    def _parent_alive(self) -> bool:
        return True

    def _engine_dead(self, reason: str) -> int:
        # (no "dead" message: the replica's check_health fails and Ray Serve replaces it, and its
        # front end sees the output stream end)
        logger.error("the engine cannot run steps any more (%s); the replica's loop ends", reason)
        return 1

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "ping":
            return
        if cmd[0] == "abort_all":
            for rid in sorted(self.live):
                self.engine.abort_request(rid)
            if self.live:
                logger.warning("aborted %d request(s) of a front end that is gone", len(self.live))
            self.live.clear()
            return
        super()._handle(cmd)


class EngineReplica:
    """One engine core as a Ray Serve replica (see the module docstring).

    Args:
        args: the :class:`~kvserve.engine.args.EngineArgs` of the engine.
        num_threads: torch threads of this replica's steps (None: as Ray set them, i.e. the
            replica's ``num_cpus``).
        log_level: the level of the ``kvserve`` loggers in the replica.

    Raises (at construction, which Ray Serve reports as the deployment's failure):
        what :class:`~kvserve.engine.core.EngineCore` raises (a missing model, bad arguments).
    """

    def __init__(self, args, num_threads: Optional[int] = None, log_level: int = logging.WARNING) -> None:
        import torch

        logging.getLogger("kvserve").setLevel(log_level)
        if num_threads:
            torch.set_num_threads(int(num_threads))
        from kvserve.engine.core import EngineCore

        self.engine = EngineCore(args)
        self._cmd = _CommandQueue()
        self._out = _OutputBuffer()
        self._loop = _ReplicaLoop(self.engine, self._cmd, self._out, os.getppid())
        self._info = CoreInfo(self.engine.model_config, self.engine.model_path, self.engine.max_model_len,
                              tuple(self.engine.eos_token_ids), self.engine.kv_spec.describe(), os.getpid())
        self._error: Optional[BaseException] = None
        self._session = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-replica-core", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="kvserve-replica-watchdog", daemon=True)
        self._watchdog.start()

    def _run(self) -> None:
        try:
            code = self._loop.run()
            if code:
                self._error = RuntimeError("the engine cannot run steps any more (a worker died)")
        except BaseException as e:  # noqa: BLE001 - reported by check_health
            logger.exception("the replica's engine loop failed")
            self._error = e

    def _watch(self) -> None:
        while self._thread.is_alive():
            time.sleep(1.0)
            if self._loop.live and time.monotonic() - self._cmd.last_put > FRONT_END_TIMEOUT_S:
                logger.warning("no word from the front end for %.0f s", FRONT_END_TIMEOUT_S)
                self._cmd.put_all([("abort_all",)])

    async def info(self) -> CoreInfo:
        """The engine's :class:`~kvserve.engine.core_proc.CoreInfo`."""
        return self._info

    async def commands(self, msgs: list) -> None:
        """Queue commands for the engine loop (in order, before its next step)."""
        self._cmd.put_all(msgs)

    async def outputs(self):
        """The engine loop's messages, in lists, as they come (an async generator)."""
        self._session += 1
        session = self._session
        if session > 1:  # a new front end: the previous one's requests are nobody's
            self._cmd.put_all([("abort_all",)])
        event = self._out.attach(asyncio.get_running_loop())
        try:
            while session == self._session:
                try:
                    await asyncio.wait_for(event.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    if self._error is not None:
                        raise RuntimeError(f"the replica's engine failed: {self._error}") from None
                    continue
                items = self._out.take()
                if items:
                    yield items
        finally:
            if session == self._session:  # (the front end hung up, or was cancelled)
                self._cmd.put_all([("abort_all",)])

    def check_health(self) -> None:
        """Ray Serve's health check.

        Raises:
            RuntimeError: the engine loop ended or the engine cannot step any more.
        """
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine loop is not running: {self._error}")
        if not self.engine.is_healthy():
            raise RuntimeError("the engine cannot run steps any more (a worker died)")

    def __del__(self) -> None:  # (Ray Serve stops the replica: the workers go with it)
        try:
            self._cmd.put_all([("stop",)])
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            pass
