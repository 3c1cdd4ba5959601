"""The engine core's own process: an :class:`EngineCore` stepping behind two pipes.

``kvserve serve`` runs the engine core (scheduler, KV cache manager, executor: the model and
the sampler) in a child process started with :mod:`multiprocessing`'s "spawn" context; the API
process keeps HTTP, input processing (tokenization, chat templates), output processing
(detokenization, stop strings, ``RequestOutput`` s) and the metrics. :func:`run_engine_core` is
the child's entry point, :class:`kvserve.engine.core_client.CoreClient` the parent's end.

Messages (tuples, pickled by :mod:`multiprocessing.connection`):

API → core (``cmd`` pipe):
    ``("add", cid, [EngineCoreRequest, ...])``: add the batch all or nothing
    (:meth:`EngineCore.add_requests`); ``("abort", [request_id, ...])``;
    ``("finish", [(request_id, sample_index), ...])``: samples the API process ended at a
    stop string (:meth:`EngineCore.finish_samples`); ``("call", cid, method_name, args)``: run
    a public :class:`EngineCore` method (``stats``, ``has_unfinished_requests``...) between
    steps; ``("pause",)`` / ``("resume",)``: stop / restart stepping; ``("stop",)``.

core → API (``out`` pipe):
    ``("ready", CoreInfo)`` or ``("failed", exception)`` once, after construction;
    ``("added", cid, exception_or_None)``; ``("outputs", [EngineCoreOutput, ...], stats)`` after
    every step (token deltas: what a step sends does not grow with the sequences' length);
    ``("stats", stats)`` at the start and when idle; ``("reply", cid, ok, value_or_exception)``;
    ``("step_failed", message, stats)``: a step raised, every live request was aborted (the
    core goes on serving new ones); ``("dead", message)``: the engine cannot run steps any more
    (a tensor-parallel rank died, during a step or between steps): the core exits (sent before
    that step's ``step_failed``); ``("stopped",)``.

The core exits when told to stop, when the command pipe closes (the API process died) or
when its parent process is gone; it ignores SIGINT and SIGTERM (Ctrl-C, ``kill -- -PGID`` and
systemd's default stop reach the whole process group: the API process drains its requests and
then decides when the core stops; SIGKILL still ends the core).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any

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
        args: the :class:`~kvserve.engine.args.EngineArgs` to build the :class:`EngineCore` from.
        cmd_conn: the receiving end of the command pipe.
        out_conn: the sending end of the output pipe.
        parent_pid: the API process's pid (the core exits when it is gone).
        log_level: the level of the ``kvserve`` loggers in this process.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):  # (the API process decides: module docstring)
        signal.signal(sig, signal.SIG_IGN)
    logging.getLogger("kvserve").setLevel(log_level)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s (core): %(message)s")
    try:
        from kvserve.engine.core import EngineCore

        engine = EngineCore(args)
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it with its message
        logger.debug("engine core failed to start:\n%s", traceback.format_exc())
        try:
            out_conn.send(("failed", _picklable(e)))
        except OSError:  # (BrokenPipeError: the API process is gone, nobody to tell)
            pass
        finally:
            out_conn.close()
        _exit(1)
    code = 0
    try:
        # (a BrokenPipeError here: the API process went away while the model loaded)
        out_conn.send(("ready", CoreInfo(engine.model_config, engine.model_path, engine.max_model_len,
                                         tuple(engine.eos_token_ids), engine.kv_spec.describe(), os.getpid())))
        code = _CoreLoop(engine, cmd_conn, out_conn, parent_pid).run()
    except (EOFError, OSError, BrokenPipeError):  # the API process is gone: nobody to serve
        pass
    finally:
        try:
            out_conn.close()
        except OSError:
            pass
        engine.shutdown()  # (the tensor-parallel ranks, if any)
    _exit(code or 0)


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

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> int:
        """Serve until told to stop (returns 0) or the engine cannot run steps any more (1)."""
        engine = self.engine
        self.out.send(("stats", engine.stats()))  # (the front end's gauges, before any request)
        while True:
            idle = self.paused or not engine.has_unfinished_requests()
            if idle:  # block (with a periodic check of the parent) until a command arrives
                while not self.cmd.poll(PARENT_CHECK_S):
                    if not self._parent_alive():
                        return 0
                    if not engine.is_healthy():  # (a rank died between steps)
                        return self._engine_dead(engine.health_error() or "a worker died")
                    pending = getattr(engine, "kv_offload_pending", None)
                    if pending is not None and pending():  # (the disk tier's last writes, counted while idle)
                        self.out.send(("stats", engine.stats()))
            while self.cmd.poll(0):
                cmd = self.cmd.recv()
                if cmd[0] == "stop":  # (the engine goes with the process)
                    self.out.send(("stopped",))
                    return 0
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
                self.live.clear()
                dead = not engine.is_healthy()
                if dead:  # (said first: /health is 503 before any request learns of the failure)
                    self._engine_dead(engine.health_error() or str(e) or type(e).__name__)
                self.out.send(("step_failed", str(e) or type(e).__name__, engine.stats()))
                if dead:  # a worker died: exit, the API process reports it (/health 503)
                    return 1
                continue
            for out in outputs:
                if out.finished:
                    self.live.discard(out.request_id)
            self.out.send(("outputs", outputs, engine.stats()))

    def _engine_dead(self, reason: str) -> int:
        """The engine cannot run steps any more: tell the API process at once (``("dead",
        message)``: it answers ``/health`` with 503 from then on, without waiting for this
        process to stop its workers and exit, which takes seconds with Ray); returns the exit
        code, 1."""
        logger.error("the engine cannot run steps any more (%s); the engine core exits", reason)
        self.out.send(("dead", f"the engine cannot run steps any more: {reason}"))
        return 1

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, cid, requests = cmd
            try:
                rids = self.engine.add_requests(requests)
            except Exception as e:  # noqa: BLE001 - the request's error, handed back
                self.out.send(("added", cid, _picklable(e)))
            else:
                self.live.update(rids)
                self.out.send(("added", cid, None))
        elif kind == "abort":
            for rid in cmd[1]:
                self.engine.abort_request(rid)
                self.live.discard(rid)
        elif kind == "finish":
            self.engine.finish_samples(cmd[1])
            self.live.intersection_update(self.engine.groups)
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
