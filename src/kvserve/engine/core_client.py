"""The API process's end of the engine core process (:mod:`kvserve.engine.core_proc`).

:class:`CoreClient` starts the core (``multiprocessing``, "spawn" context: the child imports
kvserve afresh, CUDA-safe), waits until it has built its :class:`EngineCore` (or re-raises the
error it failed with), and then exposes what the API process needs without any weights: the
tokenizer, the model config, ``max_model_len``, an :class:`InputProcessor` (``encode``,
``truncate_prompt``) and a :class:`StructuredOutputManager` for the early schema checks.

Two one-way pipes carry the messages: commands go through a writer thread (a send never
blocks the caller, even while the core is inside a long step and not reading), the core's
messages come back on a reader thread that hands each to a callback. The reader also watches
the process itself: when the core dies (killed, crashed), the callback ``on_exit`` runs at
once with its exit code.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import weakref
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional

from kvserve.engine.core_proc import CoreInfo, run_engine_core

logger = logging.getLogger("kvserve.engine.core_client")


class CoreStartError(RuntimeError):
    """The engine core process exited before it reported ready (no error message came back)."""


def describe_exit(exitcode: Optional[int]) -> str:
    """``"exit code 1"`` / ``"killed by signal 9 (SIGKILL)"`` for a process's exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "?"
        return f"killed by signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


@contextlib.contextmanager
def _signals_ignored_by_the_child():
    """SIGINT and SIGTERM ignored while the core process is spawned, so that it starts with them
    ignored (an ignored disposition survives exec, and Python keeps it): its own SIG_IGN comes
    only after the spawn's bootstrap has imported kvserve and torch (a second or two), and a
    Ctrl-C in that window printed a KeyboardInterrupt traceback from the core. The API process
    decides when the core stops (core_proc's docstring). Only on the main thread (elsewhere
    signal handlers cannot be set, and the signals go to the main thread anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class CoreClient:
    """Starts the engine core process and talks to it.

    Args:
        args: the :class:`~kvserve.engine.args.EngineArgs` (picklable) the core builds its
            :class:`EngineCore` from.
        log_level: the level of the ``kvserve`` loggers in the core process (default: this
            process's).

    Attributes:
        args, tokenizer, model_config, model_path, max_model_len, eos_token_ids,
        input_processor, structured_output: as on :class:`EngineCore` (the same values: the
            numbers come from the core's engine, the tokenizer is loaded here from the same path).
        kv_spec_description: the core's ``kv_spec.describe()``.
        pid: the core process's id.

    Raises (at construction; the core process is gone by then):
        ModelNotFoundError, ModelLoadError, UnsupportedModelError, ValueError...: what
            :class:`EngineCore` raised in the core (the same type and message where it pickles,
            else a RuntimeError naming the type).
        CoreStartError: the core process died without a message (e.g. killed, out of memory).
    """

    def __init__(self, args, log_level: Optional[int] = None) -> None:
        from kvserve.worker.loader import resolve_model_path

        args.check()
        path = resolve_model_path(args.model)  # a missing model fails here, before any process starts
        args.resolved_quantization(path)  # (so does a quantization the model's format cannot take)
        if log_level is None:
            log_level = logging.getLogger("kvserve").getEffectiveLevel()
        self.args = args
        ctx = mp.get_context("spawn")
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_engine_core, name="kvserve-engine-core",
                                   args=(args, cmd_recv, out_send, os.getpid(), log_level))
        with _signals_ignored_by_the_child():
            self.process.start()
        cmd_recv.close()  # (the child's ends: the pipe reports EOF only once every copy is closed)
        out_send.close()
        self.pid: int = self.process.pid
        self._closed = False
        # Reaping (waitpid) from two threads at once loses the exit status in one of them (which
        # then thinks the process still runs): the reader, shutdown and is_alive reap under this.
        self._reap_lock = threading.Lock()
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda c: c is not None and c.shutdown(timeout=5.0))(ref())
        atexit.register(self._atexit)
        try:
            tok_error: Optional[BaseException] = None
            try:  # while the core loads the weights
                from kvserve.engine.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(path)
            except Exception as e:  # noqa: BLE001 - the core's own error, if any, says more
                tok_error = e
            info = self._wait_ready()
            if tok_error is not None:
                raise tok_error
        except BaseException:  # (Ctrl-C while loading included: the core is terminated at once)
            self.shutdown(timeout=0.5)
            raise
        self._set_info(info, tokenizer)

    def _wait_ready(self) -> CoreInfo:
        while True:
            ready = wait([self._out, self.process.sentinel])
            if self._out in ready:
                try:
                    msg = self._out.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "ready":
                    return msg[1]
                if msg is not None and msg[0] == "failed":
                    self._wait_exit(10.0)
                    raise msg[1]
            if self._out not in ready or msg is None:
                self._wait_exit(10.0)
                raise CoreStartError(f"the engine core process exited while starting "
                                     f"({describe_exit(self.exitcode)}); see its log above")

    def _set_info(self, info: CoreInfo, tokenizer) -> None:
        from kvserve.engine.input_processor import InputProcessor
        from kvserve.structured_output.manager import StructuredOutputManager

        self.info = info
        self.model_config = info.model_config
        self.model_path: Path = info.model_path
        self.max_model_len: int = info.max_model_len
        self.eos_token_ids: tuple = info.eos_token_ids
        self.kv_spec_description: str = info.kv_spec_description
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.model_config, tokenizer, self.max_model_len)
        self.structured_output = StructuredOutputManager(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    # ------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt (:meth:`InputProcessor.encode`)."""
        return self.input_processor.encode(prompt)

    def truncate_prompt(self, ids: list[int], text: Optional[str], k: Optional[int]) -> tuple[list[int], Optional[str]]:
        """``truncate_prompt_tokens`` applied to a prompt (:meth:`InputProcessor.truncate_prompt`)."""
        return self.input_processor.truncate_prompt(ids, text, k)

    # ------------------------------------------------------------ messages
    def start_io(self, on_message: Callable[[tuple], None], on_exit: Callable[[Optional[int]], None]) -> None:
        """Start the writer and reader threads.

        ``on_message(msg)`` runs on the reader thread for every message of the core;
        ``on_exit(exitcode)`` runs there once, when the core's pipe closes or the process ends
        (``exitcode`` None if it is somehow still running).
        """
        if self._reader is not None:
            return
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-core-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, args=(on_message, on_exit),
                                        name="kvserve-core-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def send(self, msg: tuple) -> None:
        """Queue a command for the core (returns at once; dropped if the core is gone)."""
        self._sendq.put(msg)

    def _write_loop(self) -> None:
        while True:
            msg = self._sendq.get()
            if msg is None:
                return
            try:
                self._cmd.send(msg)
            except (OSError, ValueError):  # the core is gone (the reader reports it)
                return

    def _read_loop(self, on_message, on_exit) -> None:
        try:
            while True:
                ready = wait([self._out, self.process.sentinel])
                if self._out not in ready and not self._out.poll(0):
                    break  # the process ended and left nothing more to read
                try:
                    msg = self._out.recv()
                except (EOFError, OSError):
                    break
                try:
                    on_message(msg)
                except Exception:  # noqa: BLE001 - a bug in a handler must not stop the reader
                    logger.exception("handling the core's %r message failed", msg[0])
        except (OSError, ValueError):  # the pipe was closed under us (shutdown)
            pass
        self._wait_exit(5.0)
        on_exit(self.exitcode)

    def _wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the core to exit, and reap it; True once it has."""
        if not wait([self.process.sentinel], timeout):
            return False
        with self._reap_lock:
            self.process.join(1.0)  # (its sentinel closed: it is exiting)
            return self.process.exitcode is not None

    def death_message(self, exitcode: Optional[int]) -> str:
        """The error of the requests that were live when the core died."""
        return f"the engine core process died ({describe_exit(exitcode)})"

    @property
    def exitcode(self) -> Optional[int]:
        """The core's exit code (negative: killed by that signal), None while it runs."""
        with self._reap_lock:
            return self.process.exitcode

    def is_alive(self) -> bool:
        """Whether the core process is running."""
        with self._reap_lock:
            return not self._closed and self.process.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (``stop``, then SIGKILL: the core ignores SIGTERM) and wait for it; idempotent.

        Args:
            timeout: seconds to wait for the core to stop by itself before it is killed.
        """
        if self._closed:
            return
        atexit.unregister(self._atexit)
        proc = self.process
        if self.exitcode is None:
            if self._writer is not None and self._writer.is_alive():
                self._sendq.put(("stop",))
            else:
                try:
                    self._cmd.send(("stop",))
                except (OSError, ValueError):
                    pass
            if not self._wait_exit(timeout):
                logger.warning("the engine core process did not stop within %.1f s; killing it", timeout)
                proc.kill()  # (it ignores SIGTERM: see core_proc)
                self._wait_exit(5.0)
        self._closed = True
        self._sendq.put(None)
        try:
            self._cmd.close()
        except OSError:
            pass
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(10.0)
        try:
            self._out.close()
        except OSError:
            pass
