"""Graceful drain on SIGTERM and Ctrl-C (issue #21, point 4), around uvicorn.

:class:`DrainingServer` is a ``uvicorn.Server`` whose first SIGTERM or SIGINT does not stop
the server at once but runs :meth:`OpenAIServer.drain
<kvserve.entrypoints.openai.api.OpenAIServer.drain>`: new requests get 503 (``code:
"draining"``) and ``/ready`` 503 while the live requests may finish for up to
``shutdown_timeout`` seconds; the ones left are then aborted in the engine and end with an
error (streamed: an error event and ``data: [DONE]``). Only then does uvicorn's own shutdown
run (closing the idle connections, then the app's lifespan, which stops the engine), and the
process exits 0. A second SIGTERM or SIGINT exits at once (uvicorn's ``force_exit``: live
streams are cut).

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
            print(f"kvserve: {name} again: exiting now", file=sys.stderr, flush=True)
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
