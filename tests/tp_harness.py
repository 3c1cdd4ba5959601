"""Tensor-parallel tests: ranks in spawned processes joined by gloo, and a driver that runs a
Worker through prefill and decode steps by hand.

:class:`RankPool` starts ``world_size`` processes once (importing torch and kvserve costs a few
seconds per process on 2 cores) and runs test functions in all of them: ``pool.run(fn, *args)``
calls ``fn(*args)`` in every rank and returns the results in rank order. Nothing is left behind:
when a rank raises, dies or runs past the timeout, every rank is killed (a rank blocked in a
collective would otherwise wait for its peer forever) and the pool is closed; each rank also
exits on its own when the test process goes away.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message has every rank's traceback."""


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:  # the test process is gone: do not linger
            os._exit(3)


def _rank_main(rank: int, world_size: int, init_method: str, inq, outq, dist_timeout_s: float, ppid: int) -> None:
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    try:
        torch.set_num_threads(1)
        from kvserve.distributed import init_distributed

        init_distributed(world_size, rank, init_method, timeout_s=dist_timeout_s)
        outq.put((rank, True, "ready"))
    except BaseException:
        outq.put((rank, False, traceback.format_exc()))
        return
    while True:
        job = inq.get()
        if job is None:
            break
        fn, args = job
        try:
            outq.put((rank, True, fn(*args)))
        except BaseException:
            outq.put((rank, False, traceback.format_exc()))
    from kvserve.distributed import destroy_distributed

    destroy_distributed()


class RankPool:
    """``world_size`` spawned processes in one gloo group (``file://`` rendezvous in a temporary folder).

    Args:
        world_size: ranks.
        start_timeout_s: how long the ranks may take to start and join the group.
        dist_timeout_s: how long a collective waits for a missing rank before it raises.
    """

    def __init__(self, world_size: int, start_timeout_s: float = 120, dist_timeout_s: float = 60) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="kvserve-tp-")
        init_method = f"file://{self._dir}/store"
        self._in = [ctx.Queue() for _ in range(world_size)]
        self._out = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, daemon=True, name=f"kvserve-tp-rank{r}",
                                  args=(r, world_size, init_method, self._in[r], self._out, dist_timeout_s,
                                        os.getpid()))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.alive = True
        self._collect(start_timeout_s)

    def run(self, fn: Callable, *args, timeout_s: float = 120) -> list[Any]:
        """``fn(*args)`` in every rank (``fn`` importable by name); the results in rank order.

        Raises:
            RankError: a rank raised, died, or the ranks ran past ``timeout_s`` (the pool is
                then closed: every rank killed).
        """
        if not self.alive:
            raise RankError("the pool is closed")
        for q in self._in:
            q.put((fn, args))
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        grace = False
        while len(results) + len(errors) < self.world_size:
            if errors and not grace:  # the others may wait in a collective for the failed rank: a short grace
                deadline, grace = min(deadline, time.monotonic() + 2.0), True
            try:
                rank, ok, value = self._out.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in self.procs if p.exitcode is not None]
                if dead or time.monotonic() >= deadline:
                    self.close(kill=True)
                    why = f"ranks {dead} died" if dead else ("a rank failed, the others did not return" if errors
                                                            else f"timed out after {timeout_s} s")
                    raise RankError(f"{why}; errors: {errors}") from None
                continue
            (results if ok else errors)[rank] = value
        if errors:
            self.close(kill=True)
            raise RankError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop every rank: asked to leave (or killed), joined, killed if still there after 5 s."""
        if not kill and self.alive:
            for q in self._in:
                q.put(None)
        self.alive = False
        deadline = time.monotonic() + (0 if kill else 5)
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in self._in + [self._out]:
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# ------------------------------------------------------------------------------ model driver

def drive_worker(worker, folder: str, prompts: list[list[int]], max_new: int, *, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, block_size: int = 4, chunk: int = 5,
                 fused_cpu_ops: bool = True, logits_dst: Optional[int] = None) -> dict:
    """Load ``folder`` in ``worker`` and run ``prompts`` greedily for ``max_new`` tokens each, by
    hand: chunked prefill (``chunk`` tokens a step) batched with the decodes of the requests
    already past their prompt, every token through the paged KV cache (``block_size`` tokens a
    block). The same schedule on every rank and at every tensor-parallel size: each step, rank
    0's sampled tokens are broadcast (what an executor's engine core does), so the ranks agree
    also when only rank ``logits_dst`` gets logits (set on the loaded model).

    Returns:
        ``{"logits": [per step, the model's logits rows (float32, CPU); none on a rank the logits
        are not gathered to], "rows": [per step, ``(prompt index, position)`` of each logits row:
        the row is the logits after that position of the prompt + generated sequence; empty on a
        rank without logits], "tokens": [per prompt, the generated ids], "kv_heads": KV heads in
        this worker's pool, "num_heads": query heads of its attention}``.
    """
    from kvserve.kernels import cpu_ops

    avail = cpu_ops.available
    if not fused_cpu_ops:
        cpu_ops.available = lambda: False  # the PyTorch path (model and attention backend), until we return
    try:
        return _drive(worker, folder, prompts, max_new, dtype, quantization, block_size, chunk, logits_dst)
    finally:
        cpu_ops.available = avail


def _drive(worker, folder, prompts, max_new, dtype, quantization, block_size, chunk, logits_dst) -> dict:
    from pathlib import Path

    from kvserve.core.kv_cache_manager import plan_kv_cache
    from kvserve.distributed import broadcast_object
    from kvserve.core.request import Request
    from kvserve.core.scheduler import SchedulerOutput
    from kvserve.sampling_params import SamplingParams

    cfg = worker.load_model(Path(folder), 128, quantization)
    if logits_dst is not None:
        worker.model.logits_dst = worker.model.lm_head.gather_dst = logits_dst
    per_req = -(-(max(len(p) for p in prompts) + max_new) // block_size)
    spec = plan_kv_cache(cfg, dtype, 1.0, block_size, 128, num_blocks=per_req * len(prompts),
                         tp_size=worker.world_size)
    kv = worker.initialize_kv_cache(cfg, spec, dtype)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    reqs = [Request(f"r{i}", list(p), params, seed=i) for i, p in enumerate(prompts)]
    tables = {r.request_id: list(range(i * per_req, (i + 1) * per_req)) for i, r in enumerate(reqs)}
    worker.init_model_runner(tables, block_size, None)
    logits: list[torch.Tensor] = []
    rows: list[list[tuple[int, int]]] = []

    def keep(module, args, out) -> None:
        if out is not None:  # (None: a rank the logits are not gathered to)
            logits.append(out.float().clone())

    hook = worker.model.register_forward_hook(keep)
    try:
        while any(len(r.output_token_ids) < max_new for r in reqs):
            sched = SchedulerOutput()
            for r in reqs:
                if len(r.output_token_ids) < max_new:
                    sched.scheduled.append((r, min(chunk, r.num_tokens - r.num_computed_tokens)))
            out = worker.execute_model(sched)
            for r, n in sched.scheduled:
                r.num_computed_tokens += n
            # (before the sampled tokens are appended: each row scores the token after the last one)
            rows.append([(reqs.index(r), r.num_tokens - 1) for r in out.sample_requests])
            sampled = [] if out.sampler_output is None else list(
                zip([r.request_id for r in out.sample_requests], out.sampler_output.sampled_token_ids.tolist()))
            sampled = broadcast_object(sampled, src=0)  # (a no-op with one rank)
            by_id = {r.request_id: r for r in reqs}
            for rid, t in sampled:
                by_id[rid].output_token_ids.append(t)
    finally:
        hook.remove()
    attn = worker.model.layers[0].self_attn
    return {"logits": logits, "rows": rows if logits else [], "tokens": [r.output_token_ids for r in reqs],
            "kv_heads": kv[0][0].shape[2], "num_heads": attn.num_heads}


def tp_generate(folder: str, prompts: list[list[int]], max_new: int, dtype: str = "float32",
                quantization: Optional[str] = None, fused_cpu_ops: bool = True,
                logits_dst: Optional[int] = None) -> dict:
    """(A rank job.) Build this rank's :class:`~kvserve.worker.worker.Worker` in the pool's group and
    :func:`drive_worker` it; the worker leaves its model when done (the group stays)."""
    from kvserve.distributed import get_tp_rank, get_tp_world_size
    from kvserve.worker.worker import Worker

    # (the pool's ranks are already in their group: the worker finds it joined, with this rank and size)
    w = Worker(getattr(torch, dtype), torch.device("cpu"), get_tp_rank(), get_tp_world_size(), "joined://")
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // get_tp_world_size())
    return drive_worker(w, folder, prompts, max_new, dtype=getattr(torch, dtype), quantization=quantization,
                        fused_cpu_ops=fused_cpu_ops, logits_dst=logits_dst)


def local_generate(folder: str, prompts: list[list[int]], max_new: int, dtype: str = "float32",
                   quantization: Optional[str] = None, fused_cpu_ops: bool = True) -> dict:
    """The same as :func:`tp_generate` with a one-rank worker in this process (the reference)."""
    from kvserve.worker.worker import Worker

    return drive_worker(Worker(getattr(torch, dtype), torch.device("cpu")), folder, prompts, max_new,
                        dtype=getattr(torch, dtype), quantization=quantization, fused_cpu_ops=fused_cpu_ops)
