"""The multiprocess executor: tensor-parallel ranks as local processes (``--distributed-executor-backend mp``).

Rank 0, the *driver*, is a :class:`~kvserve.worker.worker.Worker` in the engine core's own
process; ranks ``1 .. N-1`` are processes started with :mod:`multiprocessing`'s "spawn" context,
each holding a ``Worker`` over its shard. The ranks form a ``torch.distributed`` group (gloo on
CPU, NCCL on CUDA) whose collectives run inside the model's forward (the row-parallel
all-reduces, the vocabulary-parallel embedding and LM head).

One step (:meth:`MultiprocExecutor.execute_model`), as in vLLM's driver-worker design: the
driver's model runner builds the batch tensors from the scheduler output (``input_ids``,
``positions``, attention metadata with slot mapping and block tables, ``logits_indices``) and
sends them, with the step's KV block ops, to every other rank once, through its pipe; then all
ranks apply the block ops and run the forward together; the logits are gathered to the driver,
which alone samples (so the scheduler's requests, grammars and sampler state never leave the
core). :meth:`~MultiprocExecutor.collective_rpc` calls a worker method on every rank (loading,
KV allocation).

Faults: a rank that dies makes the call fail with :class:`WorkerDiedError` naming it. A step
that fails once its batch went to the ranks (a rank raised, or the driver did mid-forward) may
have left the ranks' collectives out of step: the ranks are stopped and the step fails with a
:class:`WorkerDiedError` too. Either way the executor is unusable from then on
(:attr:`MultiprocExecutor.is_alive` False): every later call fails at once, the engine core
ends its requests with the error and reports itself unhealthy. A step that fails before its
batch went out (the driver building it) is an ordinary request error. The collectives and the
replies have a time-out (``distributed_timeout_s``), so the driver never waits forever on a
rank that stopped answering. Rank processes exit when the engine core's process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch

from kvserve.executor.abstract import Executor, ExecutorError
from kvserve.worker.worker import Worker

logger = logging.getLogger(__name__)

# How often a rank process checks that the engine core's process is still alive (seconds).
PARENT_CHECK_S = 1.0


class WorkerError(RuntimeError):
    """A worker method raised on a rank (the message names the rank and has its traceback)."""


class WorkerDiedError(ExecutorError):
    """A tensor-parallel rank's process died, or the ranks fell out of step; the executor
    cannot run any more steps."""


def free_tcp_init_method() -> str:
    """``tcp://127.0.0.1:<port>`` on a port free now (the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _portable(value: Any) -> Any:
    """What a rank sends back for a call's result: tensors (KV pools) stay in the rank."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, list, tuple)) for v in value):
        return None
    return value


def _picklable_error(e: BaseException, rank: int) -> BaseException:
    """``e`` where it pickles, else a :class:`WorkerError` with its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - replaced by a plain error with the same message
        return WorkerError(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def build_driver_worker(dtype: torch.dtype, device, world_size: int, init_method: str, timeout_s: float,
                        watch: Callable[[], None]) -> Worker:
    """Rank 0's :class:`Worker`, built on a thread (it joins the ranks' rendezvous, which returns
    once every rank has joined) while ``watch()`` runs every 0.2 s: ``watch`` raises for a rank
    that failed or died while starting, so that the construction fails instead of leaving the
    driver waiting in the rendezvous.

    Raises:
        What ``watch`` raised; WorkerDiedError: the ranks did not meet within ``timeout_s``;
        the driver's own error.
    """
    box: dict = {}

    def build():
        try:
            box["worker"] = Worker(dtype, device, 0, world_size, init_method, distributed_timeout_s=timeout_s,
                                   logits_dst=0)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=build, name="kvserve-tp-driver-init", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        t.join(0.2)
        watch()
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"the {world_size} tensor-parallel ranks did not meet within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["worker"]


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent_pid:  # the engine core is gone: nobody to serve
            os._exit(3)


def run_worker(rank: int, world_size: int, dtype: torch.dtype, device: str, init_method: str,
               timeout_s: Optional[float], conn, parent_pid: int) -> None:
    """A rank process's main function: build the :class:`Worker`, then answer the driver's
    messages until told to stop or the pipe closes.

    Messages (driver → rank): ``("rpc", method, args, kwargs)``; ``("forward", kv_ops, inputs)``
    (:meth:`Worker.execute_forward`); ``("stop",)``. Replies: ``("ready",)`` once, then
    ``("ok", value)`` or ``("err", exception)`` for each message.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):  # (Ctrl-C or a SIGTERM to the group: the core decides)
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        worker = Worker(dtype, torch.device(device), rank, world_size, init_method, distributed_timeout_s=timeout_s,
                        logits_dst=0)
        conn.send(("ready",))
    except BaseException as e:  # noqa: BLE001 - the driver re-raises it
        conn.send(("err", _picklable_error(e, rank)))
        os._exit(1)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "stop":
            break
        try:
            if kind == "forward":
                worker.execute_forward(msg[1], *msg[2])
                value = None
            else:
                _, method, args, kwargs = msg
                value = _portable(getattr(worker, method)(*args, **kwargs))
            reply = ("ok", value)
        except BaseException as e:  # noqa: BLE001 - handed to the driver
            logger.debug("rank %d: %s failed:\n%s", rank, kind, traceback.format_exc())
            reply = ("err", _picklable_error(e, rank))
        try:
            conn.send(reply)
        except (OSError, ValueError):  # the driver is gone (its peers' collectives broke): leave quietly
            os._exit(0)
    try:
        worker.shutdown()
    finally:
        os._exit(0)


class MultiprocExecutor(Executor):
    """``world_size`` tensor-parallel ranks: the driver (rank 0) here, the others in processes.

    Args:
        world_size: tensor_parallel_size, at least 2.
        dtype: weights and activations dtype.
        device: the device (``"cpu"``, ``"cuda"``).
        distributed_timeout_s: how long a collective, or a reply of a rank, may take before
            the step fails (seconds).

    Raises at construction (no process is left behind):
        RuntimeError: this process already holds a tensor-parallel group (another engine's,
            not shut down: a process has one), before any process starts.
        WorkerError / the rank's own exception: a rank failed to start.
        WorkerDiedError: a rank died while starting.
    """

    def __init__(self, world_size: int, dtype: torch.dtype, device: torch.device,
                 distributed_timeout_s: float = 120.0) -> None:
        if world_size < 2:
            raise ValueError(f"MultiprocExecutor needs tensor_parallel_size >= 2, got {world_size}")
        from kvserve.distributed import is_initialized

        if is_initialized():  # (its driver would take that group, and its ranks would never meet)
            raise RuntimeError("this process already holds a tensor-parallel group (another engine with "
                               "tensor_parallel_size > 1 that is not shut down: call its shutdown(), LLM.shutdown() "
                               "or LLMEngine.shutdown()): a process runs one at a time")
        self.world_size = world_size
        self.timeout_s = distributed_timeout_s
        self._dead: Optional[str] = None
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        init_method = free_tcp_init_method()
        self.procs: list = []
        self.conns: list = []
        try:
            for rank in range(1, world_size):
                here, there = ctx.Pipe(duplex=True)
                p = ctx.Process(target=run_worker, name=f"kvserve-tp-rank{rank}", daemon=True,
                                args=(rank, world_size, dtype, str(device), init_method, distributed_timeout_s,
                                      there, os.getpid()))
                p.start()
                there.close()
                self.procs.append(p)
                self.conns.append(here)
            # (the driver's Worker joins the group here: it returns once every rank has joined)
            ready: set[int] = set()
            self.driver_worker = self._build_driver(dtype, device, init_method, ready)
            self._replies("start", [r for r in range(1, world_size) if r not in ready])
        except BaseException:
            self.shutdown()
            raise

    def _build_driver(self, dtype, device, init_method, ready: set[int]) -> Worker:
        """The driver's Worker, built while watching the ranks: a rank that fails to start
        fails the construction instead of leaving the driver waiting in the rendezvous (the
        ranks that reported ready meanwhile are added to ``ready``)."""

        def watch() -> None:
            for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
                if rank in ready:
                    continue
                try:
                    msg = c.recv() if c.poll(0) else None
                except (EOFError, OSError):  # it died before a word: let the exit code tell
                    p.join(5.0)
                    msg = None
                if msg is not None:
                    if msg[0] == "err":
                        raise msg[1]
                    ready.add(rank)
                elif not p.is_alive():
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} died while starting (exit code {p.exitcode}). The ranks are "
                        f"spawned processes that import the main script: a script that builds an engine with "
                        f"tensor_parallel_size > 1 must do so under `if __name__ == \"__main__\":`")

        return build_driver_worker(dtype, device, self.world_size, init_method, self.timeout_s, watch)

    # ------------------------------------------------------------------ calls
    @property
    def is_alive(self) -> bool:
        """Whether every rank runs (False for good once one died)."""
        if self._dead is None:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    self._dead = f"tensor-parallel rank {rank} died (exit code {p.exitcode})"
        return self._dead is None

    @property
    def death(self) -> Optional[str]:
        """Why the ranks cannot run steps any more (which rank died), or None while they can."""
        return None if self.is_alive else self._dead

    def _check(self) -> None:
        if not self.is_alive:
            raise WorkerDiedError(self._dead)

    def _send_all(self, msg: tuple) -> None:
        for rank, c in enumerate(self.conns, start=1):
            try:
                c.send(msg)
            except (OSError, ValueError) as e:
                self._dead = self._dead or f"tensor-parallel rank {rank} is gone ({e})"
                raise WorkerDiedError(self._dead) from e

    def _replies(self, what: str, ranks: Optional[list[int]] = None) -> list[Any]:
        """One reply from every rank (or those of ``ranks``), in rank order, waiting on the
        pipes and the processes.

        Raises:
            WorkerDiedError: a rank died or did not answer within the time-out.
            The rank's exception: the rank raised (the first rank's, if several did).
        """
        values: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        pending = {c: rank for rank, c in enumerate(self.conns, start=1) if ranks is None or rank in ranks}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._dead = f"tensor-parallel ranks {sorted(pending.values())} did not answer {what} within " \
                             f"{self.timeout_s:.0f} s"
                raise WorkerDiedError(self._dead)
            sentinels = {self.procs[r - 1].sentinel: r for r in pending.values()}
            ready = wait(list(pending) + list(sentinels), min(left, 1.0))
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        continue  # (the sentinel reports the death)
                    del pending[obj]
                    if msg[0] == "err":
                        errors[rank] = msg[1]
                    else:
                        values[rank] = msg[1] if len(msg) > 1 else None
            for obj in ready:
                if obj in sentinels and self.conns[sentinels[obj] - 1] in pending:
                    c = self.conns[sentinels[obj] - 1]
                    if c.poll(0):
                        continue  # its last words first
                    p = self.procs[sentinels[obj] - 1]
                    p.join(1.0)
                    self._dead = f"tensor-parallel rank {sentinels[obj]} died (exit code {p.exitcode})"
                    raise WorkerDiedError(self._dead)
        if errors:
            raise errors[min(errors)]
        return [values[r] for r in sorted(values)]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        """Call ``method`` on every rank at once; the driver's result, then the other ranks'
        (tensors stay in their rank: None)."""
        with self._lock:
            self._check()
            self._send_all(("rpc", method, args, kwargs or {}))
            try:
                mine = getattr(self.driver_worker, method)(*args, **(kwargs or {}))
            except BaseException as e:
                # (the ranks ran the same call: a collective in it may now wait for the driver)
                self._dead = self._dead or f"{method} failed on the driver ({type(e).__name__}: {e})"
                self._stop_ranks()
                raise
            return [mine] + self._replies(method)

    def execute_model(self, scheduler_output):
        """One step: the driver builds the batch, sends it to the other ranks, and every rank
        runs the forward; the driver samples (:meth:`Worker.execute_model`)."""
        with self._lock:
            self._check()
            sent = []

            def broadcast(kv_ops, inputs) -> None:
                self._send_all(("forward", kv_ops, inputs))
                sent.append(True)

            try:
                out = self.driver_worker.execute_model(scheduler_output, broadcast=broadcast)
                if sent:
                    self._replies("forward")
            except WorkerDiedError:
                self._stop_ranks()
                raise
            except BaseException as e:
                if not sent:  # (the driver failed building the batch: the ranks saw nothing)
                    raise
                if isinstance(e, KeyboardInterrupt):  # Ctrl-C: stop the ranks, and stop as asked
                    self._dead = self._dead or "interrupted"
                    self._stop_ranks()
                    raise
                time.sleep(0.1)  # (a rank that died broke the collective: let its death show first)
                if self.is_alive:
                    self._dead = f"a tensor-parallel step failed once its batch went to the ranks " \
                                 f"({type(e).__name__}: {e}); the ranks may be out of step"
                self._stop_ranks()
                raise WorkerDiedError(self._dead) from e
            return out

    def _stop_ranks(self) -> None:
        """Kill the ranks of a broken executor (one may sit in a collective that never completes)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)

    def shutdown(self) -> None:
        """Stop every rank (``stop``, then SIGKILL: ranks ignore SIGTERM) and leave the group; idempotent."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.procs, self.conns = [], []
        self._dead = self._dead or "the executor was shut down"
        worker = getattr(self, "driver_worker", None)
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:  # noqa: BLE001 - leaving a group that is already broken
                logger.debug("leaving the tensor-parallel group failed", exc_info=True)
