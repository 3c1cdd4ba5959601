"""The engine core's own process: an :class:`LLMEngine` stepping behind two pipes.

``kvserve serve`` runs the engine (scheduler, model, sampling, detokenization) in a child
process started with :mod:`multiprocessing`'s "spawn" context; the API process keeps HTTP,
tokenization of prompts and the metrics. :func:`run_engine_core` is the child's entry point,
:class:`kvserve.engine.core_client.CoreClient` the parent's end.

Messages (tuples, pickled by :mod:`multiprocessing.connection`):

API → core (``cmd`` pipe):
    ``("add", cid, [(request_id, prompt_token_ids), ...], params, priority, cache_salt)``:
    add the batch all or nothing (:func:`add_batch`);
    ``("abort", [request_id, ...])``; ``("call", cid, method_name, args)``: run a public
    :class:`LLMEngine` method (``stats``, ``has_unfinished_requests``...) between steps;
    ``("pause",)`` / ``("resume",)``: stop / restart stepping; ``("stop",)``.

core → API (``out`` pipe):
    ``("ready", CoreInfo)`` or ``("failed", exception)`` once, after construction;
    ``("added", cid, exception_or_None)``; ``("outputs", [RequestOutput, ...], stats)`` after
    every step (logprobs lists as :class:`ListDelta` s, :class:`OutputEncoder`); ``("stats", stats)`` when idle; ``("reply", cid, ok, value_or_exception)``;
    ``("step_failed", message, stats)``: a step raised, every live request was aborted (the
    core goes on serving new ones); ``("stopped",)``.

The core exits when told to stop, when the command pipe closes (the API process died) or
when its parent process is gone; it ignores SIGINT (Ctrl-C reaches the whole process group:
the API process decides when the core stops).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

logger = logging.getLogger("kvserve.engine.core_proc")

# How often an idle core checks that its parent is still alive (seconds).
PARENT_CHECK_S = 1.0


@dataclass
class CoreInfo:
    """What the API process needs to know about the engine the core built.

    Attributes:
        model_config: the model's :class:`~kvserve.config.ModelConfig`.
        model_path: the resolved model path.
        max_model_len: the context window, tokens.
        eos_token_ids: the tokens that end a sequence.
        kv_spec_description: ``kv_spec.describe()`` (the KV pool's size, for the start-up log).
        pid: the core's process id.
    """

    model_config: Any
    model_path: Any
    max_model_len: int
    eos_token_ids: tuple
    kv_spec_description: str
    pid: int


class ListDelta(NamedTuple):
    """A list on the wire as its items after the first ``start``, which the receiver already has."""

    start: int
    tail: list


class OutputEncoder:
    """Sends a request's logprobs (``CompletionOutput.logprobs``, ``RequestOutput.prompt_logprobs``)
    as :class:`ListDelta` s: the engine reports the whole lists at every step, and pickling them
    again each step would cost O(tokens²) per request (5.3 s instead of 1.8 s for 480 tokens with
    ``logprobs=20`` on the tiny test model). A list is sent whole the first time, and again
    whenever it is not the previous one plus new items (its last sent item moved: beam search).
    """

    def __init__(self) -> None:
        self._sent: dict[str, dict] = {}  # request id -> slot -> (items sent, the last one)

    def _encode(self, slots: dict, slot, items: Optional[list]):
        if not items:
            slots.pop(slot, None)
            return items
        prev = slots.get(slot)
        slots[slot] = (len(items), items[-1])
        if prev is not None and len(items) >= prev[0] and items[prev[0] - 1] is prev[1]:
            return ListDelta(prev[0], items[prev[0]:])
        return items

    def encode(self, outputs: list) -> list:
        """``outputs`` with their logprobs lists replaced by deltas where possible (in place)."""
        for out in outputs:
            slots = self._sent.setdefault(out.request_id, {})
            out.prompt_logprobs = self._encode(slots, None, out.prompt_logprobs)
            for o in out.outputs:
                o.logprobs = self._encode(slots, o.index, o.logprobs)
            if out.finished:
                del self._sent[out.request_id]
        return outputs

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDecoder:
    """The receiving end of :class:`OutputEncoder`: rebuilds the whole lists (each output gets
    its own list, as the engine's own outputs have)."""

    def __init__(self) -> None:
        self._have: dict[str, dict] = {}  # request id -> slot -> the list so far

    def _decode(self, slots: dict, slot, items):
        if isinstance(items, ListDelta):
            have = slots.get(slot)
            if have is None or len(have) < items.start:
                raise RuntimeError(f"logprobs delta from position {items.start} for a list of "
                                   f"{0 if have is None else len(have)} items (a bug)")
            del have[items.start:]
            have.extend(items.tail)
            return list(have)
        if items:
            slots[slot] = list(items)
        else:
            slots.pop(slot, None)
        return items

    def decode(self, out) -> None:
        """Rebuild ``out``'s lists (in place)."""
        slots = self._have.setdefault(out.request_id, {})
        out.prompt_logprobs = self._decode(slots, None, out.prompt_logprobs)
        for o in out.outputs:
            o.logprobs = self._decode(slots, o.index, o.logprobs)
        if out.finished:
            del self._have[out.request_id]

    def forget(self, request_id: str) -> None:
        self._have.pop(request_id, None)

    def clear(self) -> None:
        self._have.clear()


def add_batch(engine, items: Sequence[tuple[str, Sequence[int]]], params, priority: int,
              cache_salt: Optional[str]) -> None:
    """Add every request ``(request_id, prompt_token_ids)`` of ``items`` to ``engine``, or none.

    With more than one request every one is checked (:meth:`LLMEngine.validate_request`)
    before any is added; one that still fails when added (e.g. the batch overfills the waiting
    queue) takes back those added before it (no step ran in between).

    Raises:
        ValueError, TypeError, QueueFullError: from the engine; the exception's
            ``request_index`` attribute is the position in ``items`` of the request at fault.
    """
    added: list[str] = []
    index: Optional[int] = None
    try:
        if len(items) > 1:  # check them all first: a bad one must not start the others
            for index, (rid, ids) in enumerate(items):
                engine.validate_request(ids, params)
        for index, (rid, ids) in enumerate(items):
            engine.add_request(ids, params, request_id=rid, priority=priority, cache_salt=cache_salt)
            added.append(rid)
    except Exception as e:
        for rid in added:
            engine.abort_request(rid)
        e.request_index = index
        raise


def _picklable(e: BaseException) -> BaseException:
    """``e`` itself when it pickles (its type importable, ``request_index`` kept), else a
    RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - replaced by a plain error with the same message
        plain = RuntimeError(f"{type(e).__name__}: {e}")
        if hasattr(e, "request_index"):
            plain.request_index = e.request_index
        return plain


def run_engine_core(args, cmd_conn, out_conn, parent_pid: int, log_level: int = logging.WARNING) -> None:
    """The core process's main function (the target of the "spawn" process).

    Args:
        args: the :class:`~kvserve.engine.args.EngineArgs` to build the :class:`LLMEngine` from.
        cmd_conn: the receiving end of the command pipe.
        out_conn: the sending end of the output pipe.
        parent_pid: the API process's pid (the core exits when it is gone).
        log_level: the level of the ``kvserve`` loggers in this process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("kvserve").setLevel(log_level)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s (core): %(message)s")
    try:
        from kvserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it with its message
        logger.debug("engine core failed to start:\n%s", traceback.format_exc())
        try:
            out_conn.send(("failed", _picklable(e)))
        finally:
            out_conn.close()
        _exit(1)
    out_conn.send(("ready", CoreInfo(engine.model_config, engine.model_path, engine.max_model_len,
                                     tuple(engine.eos_token_ids), engine.kv_spec.describe(), os.getpid())))
    try:
        _CoreLoop(engine, cmd_conn, out_conn, parent_pid).run()
    except (EOFError, OSError, BrokenPipeError):  # the API process is gone: nobody to serve
        pass
    finally:
        try:
            out_conn.close()
        except OSError:
            pass
    _exit(0)


def _exit(code: int) -> None:
    """Leave now: flush the logs and stdio, skip the interpreter's teardown (torch's takes
    seconds, and nothing of the engine needs it), so a stopping server is not kept waiting."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


class _CoreLoop:
    def __init__(self, engine, cmd_conn, out_conn, parent_pid: int) -> None:
        self.engine = engine
        self.cmd = cmd_conn
        self.out = out_conn
        self.parent_pid = parent_pid
        self.paused = False
        self.live: set[str] = set()  # ids of the requests added and not finished or aborted
        self.encoder = OutputEncoder()

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> None:
        engine = self.engine
        while True:
            idle = self.paused or not engine.has_unfinished_requests()
            if idle:  # block (with a periodic check of the parent) until a command arrives
                while not self.cmd.poll(PARENT_CHECK_S):
                    if not self._parent_alive():
                        return
            while self.cmd.poll(0):
                cmd = self.cmd.recv()
                if cmd[0] == "stop":  # (the engine goes with the process)
                    self.out.send(("stopped",))
                    return
                self._handle(cmd)
            if self.paused or not engine.has_unfinished_requests():
                self.out.send(("stats", engine.stats()))
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug: fail the live requests, keep serving new ones
                logger.exception("engine step failed; aborting every live request")
                for rid in sorted(self.live):
                    try:
                        engine.abort_request(rid)
                    except Exception:  # noqa: BLE001 - the engine is already broken
                        logger.exception("abort of %s failed", rid)
                for rid in self.live:
                    self.encoder.forget(rid)
                self.live.clear()
                self.out.send(("step_failed", str(e) or type(e).__name__, engine.stats()))
                continue
            for out in outputs:
                if out.finished:
                    self.live.discard(out.request_id)
            self.out.send(("outputs", self.encoder.encode(outputs), engine.stats()))

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, cid, items, params, priority, salt = cmd
            try:
                add_batch(self.engine, items, params, priority, salt)
            except Exception as e:  # noqa: BLE001 - the request's error, handed back
                self.out.send(("added", cid, _picklable(e)))
            else:
                self.live.update(rid for rid, _ in items)
                self.out.send(("added", cid, None))
        elif kind == "abort":
            for rid in cmd[1]:
                self.engine.abort_request(rid)
                self.live.discard(rid)
                self.encoder.forget(rid)
        elif kind == "call":
            _, cid, name, args = cmd
            try:
                if name.startswith("_"):
                    raise ValueError(f"{name!r} is private: only public engine methods can be called")
                value = getattr(self.engine, name)(*args)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self.out.send(("reply", cid, False, _picklable(e)))
            else:
                try:  # (pickled before anything is written: a value that does not pickle sends nothing)
                    self.out.send(("reply", cid, True, value))
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    self.out.send(("reply", cid, False, TypeError(f"{name}() returned a {type(value).__name__}, "
                                                                  f"which cannot cross to the API process: {e}")))
        elif kind == "pause":
            self.paused = True
        elif kind == "resume":
            self.paused = False
        else:
            logger.error("unknown command %r", kind)
