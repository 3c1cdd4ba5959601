"""Graceful drain on SIGTERM and Ctrl-C (issue #21, point 4), around uvicorn.

:class:`DrainingServer` is a ``uvicorn.Server`` whose first SIGTERM or SIGINT does not stop
the server at once but runs :meth:`OpenAIServer.drain
<kvserve.entrypoints.openai.api.OpenAIServer.drain>`: new requests get 503 (``code:
"draining"``) and ``/ready`` 503 while the live requests may finish for up to
``shutdown_timeout`` seconds; the ones left are then aborted in the engine and end with an
error (streamed: an error event and ``data: [DONE]``). Only then does uvicorn's own shutdown
run (closing the idle connections, then the app's lifespan, which stops the engine), and the
process exits 0. A second SIGTERM or SIGINT exits at once (uvicorn's ``force_exit``): one
line says how many live requests it cuts, their connections are closed (each request then ends
as if its client had gone: aborted in the engine, nothing logged), the app's lifespan shutdown
stops the engine, and the process exits 0 without a traceback (uvicorn itself would skip the
lifespan shutdown, leaving the request and lifespan tasks to ``asyncio.run``'s cancellation,
which logs each one's ``CancelledError``).

Unlike ``uvicorn.Server`` it does not re-raise the signal after the shutdown, so a drained
server's exit status is 0, not ``-SIGTERM``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType
from typing import Optional

import uvicorn

logger = logging.getLogger("kvserve.entrypoints.openai")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: seconds the requests cut by a second signal may take to end once their connections are closed,
#: then the app's lifespan shutdown to stop the engine (each: what is left is cancelled)
CUT_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that drains ``api`` (an ``OpenAIServer``) on the first signal.

    ``shutdown_timeout``: seconds the live requests may run after the first signal.
    """

    def __init__(self, config: uvicorn.Config, api, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        super().__init__(config)
        self.api = api
        self.shutdown_timeout = shutdown_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Task] = None
        self._signalled = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # (a signal.signal handler: runs on the main thread, between the event loop's bytecodes)
        name = signal.Signals(sig).name
        if self._signalled or self.should_exit:  # the second signal: at once
            if not self.force_exit:
                print(f"kvserve: {name} again: stopping now, {self.api.num_live_requests} live request(s) cut",
                      file=sys.stderr, flush=True)
            self.should_exit = self.force_exit = True
            return
        if self._loop is None or not self.started:  # still starting: nothing to drain
            self.should_exit = True
            return
        self._signalled = True
        live = self.api.num_live_requests
        print(f"kvserve: {name}: shutting down; no new requests, {live} live request(s) may finish within "
              f"{self.shutdown_timeout:g} s (send it again to exit at once)", file=sys.stderr, flush=True)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.api.drain(self.shutdown_timeout)
        except Exception:  # noqa: BLE001 - the shutdown goes on
            logger.exception("the graceful drain failed")
        finally:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # (uvicorn skipped the lifespan shutdown)
            await self._cut()

    async def _cut(self) -> None:
        """After a second signal: close every connection at once (the streams still running see
        their client gone, end without an error logged, and abort their engine requests), wait
        up to :data:`CUT_TIMEOUT_S` for their tasks, then run the app's lifespan shutdown (which
        stops the engine) for up to :data:`CUT_TIMEOUT_S` more."""
        for connection in list(self.server_state.connections):
            connection.transport.abort()  # (close() would first send what the socket still holds)
        tasks = [t for t in (*self.server_state.tasks, self._drain_task) if t is not None and not t.done()]
        if self._drain_task is not None:
            self._drain_task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CUT_TIMEOUT_S)
        done = getattr(self.lifespan, "shutdown_event", None)
        if done is not None and done.is_set():  # (the signal came during the first one's lifespan shutdown)
            return
        try:
            await asyncio.wait_for(self.lifespan.shutdown(), CUT_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("the app's shutdown took more than %g s; stopping anyway", CUT_TIMEOUT_S)
