"""Connection-level time-outs and a connection limit for uvicorn (issue #21, point 2).

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds *after* a response,
but not one that never sends a request, sends its headers byte by byte, or its body slowly:
each holds a socket (and, for a body, a handler) for ever, before the API key is even checked.
:func:`guarded_protocol` returns uvicorn's HTTP protocol class (httptools' when installed,
as uvicorn's ``auto``, else h11's) with:

* a **header time-out**: a request's headers must be complete within ``header_timeout``
  seconds of the connection's first byte (or of its opening, for a connection that sends
  nothing, or of the end of the previous response on a kept-alive one); else the connection
  is closed with ``408``;
* a **body time-out**: the body must be complete within ``body_timeout`` seconds of the
  headers; else ``408`` (if no response has started) and the connection is closed, and the
  handler sees a disconnect (the request is never submitted);
* a **connection limit**: beyond ``max_connections`` open connections a new one is answered
  ``503`` and closed at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

logger = logging.getLogger("kvserve.entrypoints.openai")


def _base_protocol() -> type:
    try:
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # pragma: no cover - h11 only
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def _raw_reply(status: int, reason: str, message: str) -> bytes:
    body = ('{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"%s"}}'
            % (message, "request_timeout" if status == 408 else "too_many_connections")).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def guarded_protocol(header_timeout: Optional[float] = 10.0, body_timeout: Optional[float] = 60.0,
                     max_connections: Optional[int] = None) -> type:
    """uvicorn's HTTP protocol class with the guards of the module's docstring (None: no limit).

    Pass it as ``uvicorn.Config(http=...)`` / ``uvicorn.run(http=...)``.
    """
    base = _base_protocol()

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: Optional[asyncio.TimerHandle] = None
        _body_timer: Optional[asyncio.TimerHandle] = None
        _guarded_cycle = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                logger.warning("refused a connection: %d open, the limit is %d (--max-connections)",
                               len(self.connections) - 1, max_connections)
                transport.write(_raw_reply(503, "Service Unavailable",
                                           f"too many connections (the limit is {max_connections}); retry later"))
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if header_timeout is not None and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._timed_out, "headers")

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if not self._in_request():  # the first bytes of a request: its headers are due
                self._arm_header_timer()
            super().data_received(data)
            self._check_progress()

        def _check_progress(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle is self._guarded_cycle:
                if cycle is not None and not cycle.more_body:
                    self._cancel("_body_timer")
                return
            # a new request's headers are complete
            self._guarded_cycle = cycle
            self._cancel("_header_timer")
            self._cancel("_body_timer")
            if cycle.more_body and body_timeout is not None:
                self._body_timer = self.loop.call_later(body_timeout, self._timed_out, "body")

        def _timed_out(self, what: str) -> None:
            setattr(self, "_header_timer" if what == "headers" else "_body_timer", None)
            if self.transport.is_closing():
                return
            limit = header_timeout if what == "headers" else body_timeout
            if what == "body" and (self.cycle is None or not self.cycle.more_body):
                return
            started = self.cycle is not None and self._in_request() and self.cycle.response_started
            logger.debug("closed a connection from %s: its request %s did not arrive within %g s",
                        "%s:%d" % tuple(self.client[:2]) if self.client else "?", what, limit)
            if not started:
                flag = "--header-timeout" if what == "headers" else "--body-timeout"
                self.transport.write(_raw_reply(408, "Request Timeout",
                                                f"the request {what} did not arrive within {limit:g} s ({flag})"))
            self.transport.close()

        def on_response_complete(self) -> None:
            self._cancel("_body_timer")
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._cancel("_header_timer")
            self._cancel("_body_timer")
            super().connection_lost(exc)

    return GuardedHTTPProtocol
