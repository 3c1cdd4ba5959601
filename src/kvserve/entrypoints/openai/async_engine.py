"""AsyncEngine: one background thread owns the (not thread-safe) :class:`LLMEngine`.

Threads and queues::

    HTTP handlers (asyncio)  ──commands──►  SimpleQueue  ──►  engine thread
         ▲                                                      │ drain commands, step()
         └──── per-request asyncio.Queue ◄── call_soon_threadsafe ┘

* Handlers never touch the engine: ``add_request`` / ``abort`` / ``call`` put a command on a
  thread-safe queue. The engine thread drains every pending command before each step (so an
  abort frees its KV blocks before the next step runs) and blocks on the queue when it has
  nothing to do (it never spins).
* Outputs of one step are handed to the event loop in one ``call_soon_threadsafe`` call and
  put on each request's own ``asyncio.Queue`` as ``(tag, RequestOutput)``; an error for a
  request arrives as ``(tag, exception)``.
* The engine thread also records the request metrics (TTFT, ITL, TPOT, end-to-end, queue
  time, token counters) as outputs appear, and refreshes the gauges after every step.

:class:`MPAsyncEngine` has the same interface with the engine core in its own process
(``kvserve serve``'s default).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from kvserve.engine.input_processor import EngineCoreRequest, InputProcessor
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output_processor import OutputProcessor
from kvserve.entrypoints.openai.metrics import ServerMetrics
from kvserve.core.request import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.entrypoints.openai")

#: Seconds an idle engine thread waits before refreshing the gauges while disk-tier writes are in flight.
IDLE_STATS_S = 1.0
#: Seconds between an idle engine thread's looks at its workers (a tensor-parallel rank that died
#: between steps turns ``/health`` 503 within about this, as the engine core process does)
IDLE_HEALTH_CHECK_S = 1.0


class EngineStoppedError(RuntimeError):
    """The engine loop stopped (shutdown) or failed; the request cannot complete."""


def core_requests(input_processor: InputProcessor, items: Sequence[tuple[str, Sequence[int]]],
                  params: SamplingParams, priority: int, cache_salt: Optional[str],
                  user: Optional[str] = None) -> list[EngineCoreRequest]:
    """The :class:`EngineCoreRequest` of each ``(request_id, prompt_token_ids)`` of ``items``
    (:meth:`InputProcessor.process`).

    Raises:
        ValueError, TypeError: from :meth:`InputProcessor.process`; the exception's
            ``request_index`` attribute is the position in ``items`` of the request at fault.
    """
    out = []
    for index, (rid, ids) in enumerate(items):
        try:
            out.append(input_processor.process(ids, params, rid, priority, cache_salt, user=user))
        except Exception as e:
            e.request_index = index
            raise
    return out


def run_on_loop(loop: Optional[asyncio.AbstractEventLoop], fn: Callable, *args) -> None:
    """``fn(*args)`` now if this thread runs ``loop``, else soon on ``loop`` (thread-safe);
    nothing when ``loop`` is None (never started) or closed."""
    if loop is None:
        return
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _as_callable(fn: Callable[[LLMEngine], Any] | str, args: tuple) -> Callable[[LLMEngine], Any]:
    """``fn``, or for a method name a function calling that public engine method with ``args``.

    Raises:
        ValueError: a private name, or ``args`` given with a callable.
    """
    if isinstance(fn, str):
        if fn.startswith("_"):
            raise ValueError(f"{fn!r} is private: only public engine methods can be called")
        return lambda engine: getattr(engine, fn)(*args)
    if args:
        raise ValueError("args are for a method name; a callable takes the engine only")
    return fn


@dataclass
class _Track:
    """What the engine thread knows about a live request (for delivery and metrics)."""

    queue: asyncio.Queue
    tag: Any
    arrival: float  # time.perf_counter() when the server received the request
    num_samples: int
    beam: bool = False  # beam search: the returned beams are final only at the end
    prompt_only: bool = False  # echo with max_tokens 0: the token sampled is dropped, not counted
    first_token: Optional[float] = None  # the request's first generated token (any sample)
    prompt_counted: bool = False
    queue_time_seen: bool = False
    num_tokens: int = 0  # returned tokens counted so far, over all samples
    finished_indices: set = field(default_factory=set)
    # per sample index (not beams): its first token's and last output's times, its tokens so far
    sample_first: dict = field(default_factory=dict)
    sample_last: dict = field(default_factory=dict)
    sample_tokens: dict = field(default_factory=dict)
    defer_finishes: bool = False  # count the samples' ends when the request ends (see _track)
    pending: list = field(default_factory=list)  # (reason, e2e s, TPOT s or None) not counted yet

    @property
    def uncounted(self) -> int:
        """Samples not counted in ``request_success_total`` yet (an abort or error counts them)."""
        return self.num_samples - len(self.finished_indices) + len(self.pending)


def _track(out_queue, tag, arrival: float, params, prompt_only: bool) -> _Track:
    """A new request's track. A request of the replicas' front end that it may send again to
    another replica (``out_queue`` counts the failures and is not streamed: see
    :mod:`~kvserve.entrypoints.openai.replica_engine`) has its samples' ends counted when the
    whole request ends: one that finished on a replica that died before the others did is
    counted where the request is answered, once."""
    return _Track(out_queue, tag, arrival, params.n, beam=params.use_beam_search, prompt_only=prompt_only,
                  defer_finishes=getattr(out_queue, "counts_failures", False) and not out_queue.streaming)


def _reason(t: _Track, reason: Optional[str]) -> Optional[str]:
    """The finish reason a request's metrics count: the engine's, except that an echo with
    max_tokens 0 ends by its length whatever the dropped token was (a stop token, EOS), as its
    response says."""
    return "length" if t.prompt_only and reason not in (None, "abort", "error") else reason


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread and feeds per-request queues.

    Args:
        engine: the engine; from :meth:`start` on only the engine thread touches it.
        metrics: where to record request metrics (optional).
    """

    def __init__(self, engine: LLMEngine, metrics: Optional[ServerMetrics] = None) -> None:
        self.engine = engine
        self.metrics = metrics
        #: record the request metrics (TTFT, ITL...) of the outputs; False: only the engine's gauges
        #: and counters (a prefill replica, whose requests' metrics the decode replica records)
        self.record_requests = True
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[str, _Track] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._paused = False
        self._stopped = False
        self.fatal_error: Optional[BaseException] = None
        self._last_preemptions = 0
        self._last_spec: dict[str, int] = {}  # spec-decode and swap counters already added to the metrics
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._last_q = 0
        self._last_h = 0
        # the step heartbeat (see stalled_for): when the engine last made progress, or
        # became busy after being idle; whether it has work pending
        self._last_beat = time.monotonic()
        self._busy = False

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; live requests get :class:`EngineStoppedError`."""
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    @property
    def busy(self) -> bool:
        """Whether the engine has requests it has not finished."""
        return self._busy

    @property
    def stalled_for(self) -> float:
        """Seconds since the engine last made a step while requests are pending (0 when it has
        nothing to do): the heartbeat behind ``/health``'s ``--health-timeout``."""
        return time.monotonic() - self._last_beat if self.busy else 0.0

    # -------------------------------------------------------------- commands
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        out_queue: asyncio.Queue,
        tag: Any = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        arrival: Optional[float] = None,
    ) -> None:
        """Queue a request; returns once the engine accepted it.

        Its outputs then arrive on ``out_queue`` as ``(tag, RequestOutput)``.

        Raises:
            ValueError: the engine rejected the request (prompt too long, bad token ids...).
            QueueFullError: the waiting queue is full.
            EngineStoppedError: the engine is not running.
        """
        await self.add_requests([(request_id, prompt_token_ids, tag)], params, out_queue, priority=priority,
                                cache_salt=cache_salt, arrival=arrival)

    async def add_requests(
        self,
        requests: Sequence[tuple[str, Sequence[int], Any]],
        params: SamplingParams,
        out_queue: asyncio.Queue,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        arrival: Optional[float] = None,
        prompt_only: bool = False,
        streaming: bool = True,
        user: Optional[str] = None,
    ) -> None:
        """Queue several requests ``(request_id, prompt_token_ids, tag)`` all or nothing.

        ``prompt_only``: the caller keeps only the prompt's results (echo with max_tokens 0,
        run as one sampled token that it drops): the metrics count no generated token and no
        TTFT/TPOT for these requests. ``streaming``: whether the caller passes outputs on as they
        come (False: only the final ones; engines of replicas may then send a request again
        after its replica died). ``user``: who sent them (the scheduler shares the sequence
        slots fairly between users).

        The engine thread checks every request before it adds any (and takes back the ones it
        added if a later one still fails, before any step), so a rejected batch leaves no
        trace: nothing runs and no metric moves. Outputs then arrive on ``out_queue`` as
        ``(tag, RequestOutput)``.

        Raises:
            ValueError: the engine rejected a request (prompt too long, bad token ids...), or
                the batch is larger than the engine's whole waiting queue (``max_waiting``).
            QueueFullError: the waiting queue is full.
            EngineStoppedError: the engine is not running.
            The exception's ``request_index`` attribute is the position in ``requests`` of the
            request it is about.
        """
        if not self.is_running:
            raise EngineStoppedError("the engine is not running" if self.fatal_error is None
                                     else f"the engine is not running: {self.fatal_error}")
        limit = self.engine.args.max_waiting
        if limit and len(requests) > limit:  # could never be queued, however long the client waits
            raise ValueError(f"prompt: a batch of {len(requests)} prompts exceeds the waiting-queue limit of this "
                             f"server ({limit} requests, --max-waiting); send at most {limit} at a time")
        fut = asyncio.get_running_loop().create_future()
        arrival = time.perf_counter() if arrival is None else arrival
        items = [(rid, list(ids), tag) for rid, ids, tag in requests]
        self._cmds.put(("add", items, params, out_queue, priority, cache_salt, arrival, prompt_only, fut, user))
        try:
            await fut
        except asyncio.CancelledError:
            for rid, _, _ in items:
                self.abort(rid)  # commands run in order: these aborts follow the add
            raise

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe, returns at once); its KV blocks are freed before the next step."""
        self._cmds.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any] | str, *args) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        ``fn`` may also be the name of a public :class:`LLMEngine` method, called with
        ``args`` (the form that works with the core in its own process too, see
        :class:`MPAsyncEngine`)."""
        fn = _as_callable(fn, args)
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("call", fn, fut))
        return await fut

    def call_sync(self, fn: Callable[[LLMEngine], Any] | str, *args, timeout: float = 30.0) -> Any:
        """Like :meth:`call`, from a thread that is not the event loop's.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds.
        """
        fn = _as_callable(fn, args)
        box: dict = {}
        done = threading.Event()

        def run(engine):
            try:
                box["value"] = fn(engine)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e
            done.set()

        self._cmds.put(("call_sync", run))
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def pause(self) -> None:
        """Stop stepping (commands are still handled): requests queue up. For tests and drains."""
        self._cmds.put(("pause",))

    def resume(self) -> None:
        self._cmds.put(("resume",))

    # ----------------------------------------------------------- the thread
    def _run(self) -> None:
        engine = self.engine
        while True:
            idle = self._paused or not engine.has_unfinished_requests()
            pending = getattr(engine, "kv_offload_pending", None)
            # (idle with disk-tier writes in flight: wake up to count them in the gauges)
            wait = IDLE_STATS_S if idle and pending is not None and pending() else IDLE_HEALTH_CHECK_S
            cmds = []
            try:
                if idle:
                    cmds.append(self._cmds.get(timeout=wait))
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            if idle and not cmds and self.fatal_error is None and not engine.is_healthy():
                self.fatal_error = EngineStoppedError(  # (a rank died between steps: /health 503 now)
                    f"the engine cannot run steps any more: {engine.health_error() or 'a worker died'}")
                logger.error("%s", self.fatal_error)
            for cmd in cmds:
                if cmd[0] == "stop":
                    self._stop_all()
                    return
                self._handle(cmd)
            busy = engine.has_unfinished_requests()
            if not busy or not self._busy:  # idle, or work just arrived: the heartbeat starts now
                self._last_beat = time.monotonic()
            self._busy = busy
            if self._paused or not busy:
                self._update_gauges()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug: fail the live requests, keep serving new ones
                logger.exception("engine step failed; failing %d live request(s)", len(self._tracks))
                if not engine.is_healthy():  # a worker died: /health answers 503 from now on (before
                    self.fatal_error = e     # any request learns of it)
                self._fail_all(e)
                self._busy = engine.has_unfinished_requests()
                continue
            self._last_beat = time.monotonic()
            self._busy = engine.has_unfinished_requests()  # (the loop may block next: no stale busy)
            self._dispatch(outputs)
            self._update_gauges()

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            rid = cmd[1]
            self.engine.abort_request(rid)
            track = self._tracks.pop(rid, None)
            if track is not None and self.metrics is not None and self.record_requests:
                if track.uncounted > 0:
                    self.metrics.finished("abort", track.uncounted)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                value = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._resolve(fut, error=e)
            else:
                self._resolve(fut, value=value)
        elif kind == "call_sync":
            cmd[1](self.engine)
        elif kind == "pause":
            self._paused = True
        elif kind == "resume":
            self._paused = False

    def _add(self, items: list[tuple[str, list[int], Any]], params: SamplingParams, out_queue: asyncio.Queue,
             priority: int, salt: Optional[str], arrival: float, prompt_only: bool, fut: asyncio.Future,
             user: Optional[str] = None) -> None:
        """Add every request of ``items`` or none (see :meth:`add_requests`)."""
        try:
            requests = core_requests(self.engine.input_processor, [(rid, ids) for rid, ids, _ in items], params,
                                     priority, salt, user)
            self.engine.add_core_requests(requests)
        except Exception as e:  # noqa: BLE001 - handed to the handler (with its request_index)
            self._resolve(fut, error=e)
            return
        for rid, _, tag in items:
            self._tracks[rid] = _track(out_queue, tag, arrival, params, prompt_only)
        self._resolve(fut)

    def _resolve(self, fut: asyncio.Future, value: Any = None, error: Optional[BaseException] = None) -> None:
        def set_it():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        self._call_soon(set_it)

    def _call_soon(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @staticmethod
    def _deliver(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
        for q, item in batch:
            q.put_nowait(item)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch = []
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            if self.metrics is not None and self.record_requests:
                self._record(track, out, now)
            batch.append((track.queue, (track.tag, out)))
            if out.finished:
                del self._tracks[out.request_id]
        if batch:
            self._call_soon(self._deliver, batch)

    def _record(self, t: _Track, out: RequestOutput, now: float) -> None:
        """Update the metrics with one output of a request. A returned sequence counts as one
        request in the histograms, as in vLLM (where ``n > 1`` makes ``n`` child requests): TTFT,
        ITL, TPOT, e2e latency and queue time are observed per sample, like
        ``request_success_total``; a beam search counts once (its beams are final only at the end)."""
        m = self.metrics
        if not t.prompt_counted:
            t.prompt_counted = True
            n = len(out.prompt_token_ids)
            m.prompt_tokens.inc(n)
            self._prefix_queries += n
            self._prefix_hits += out.num_cached_tokens
        if not t.queue_time_seen and out.metrics.first_scheduled_time is not None:
            t.queue_time_seen = True
            queued = max(0.0, out.metrics.first_scheduled_time - t.arrival)
            for _ in range(1 if t.beam else t.num_samples):
                m.queue_time.observe(queued)
        total = sum(len(o.token_ids) for o in out.outputs)
        if t.beam:  # the best beams change until the end: counted once, at the end, with the
            if out.finished:  # time of the search's first token as TTFT (no ITL: no token stream)
                m.generation_tokens.inc(total)
                if total:
                    first = out.metrics.first_token_time
                    t.first_token = now if first is None else min(first, now)
                    m.ttft.observe(max(0.0, t.first_token - t.arrival))
                for o in out.outputs:
                    if o.finish_reason is not None and o.index not in t.finished_indices:
                        t.finished_indices.add(o.index)
                        m.finished(_reason(t, o.finish_reason))
                m.e2e.observe(now - t.arrival)
                longest = max((len(o.token_ids) for o in out.outputs), default=0)
                if longest >= 2:
                    m.tpot.observe((now - t.first_token) / (longest - 1))
        else:
            if not t.prompt_only and total > t.num_tokens:
                m.generation_tokens.inc(total - t.num_tokens)
                t.num_tokens = total
            for o in out.outputs:
                i, n = o.index, len(o.token_ids)
                if not t.prompt_only and n > t.sample_tokens.get(i, 0):
                    t.sample_tokens[i] = n
                    if i not in t.sample_first:
                        t.sample_first[i] = now
                        t.first_token = now if t.first_token is None else t.first_token
                        m.ttft.observe(now - t.arrival)
                    else:
                        m.record_itl(now - t.sample_last[i])
                    t.sample_last[i] = now
                if o.finish_reason is not None and i not in t.finished_indices:
                    t.finished_indices.add(i)
                    tpot = None
                    if t.sample_tokens.get(i, 0) >= 2:
                        tpot = (now - t.sample_first[i]) / (t.sample_tokens[i] - 1)
                    t.pending.append((_reason(t, o.finish_reason), now - t.arrival, tpot))
            if t.pending and (out.finished or not t.defer_finishes):
                for reason, e2e, tpot in t.pending:
                    m.finished(reason)
                    m.e2e.observe(e2e)
                    if tpot is not None:
                        m.tpot.observe(tpot)
                t.pending.clear()
        if out.finished:  # the dashboard's ring: one entry per request
            longest = max((len(o.token_ids) for o in out.outputs), default=0)
            tpot = None
            if longest >= 2 and t.first_token is not None:
                tpot = (now - t.first_token) / (longest - 1)
            scheduled = out.metrics.first_scheduled_time
            m.record_request(len(out.prompt_token_ids), 0 if t.prompt_only else total,
                             None if t.first_token is None else t.first_token - t.arrival, tpot, now - t.arrival,
                             None if scheduled is None else max(0.0, scheduled - t.arrival),
                             _reason(t, out.outputs[0].finish_reason) if out.outputs else None)

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        self._apply_stats(self.engine.stats())

    def _apply_stats(self, s: dict) -> None:
        """Set the gauges and advance the counters from the engine's :meth:`LLMEngine.stats`."""
        if self.metrics is None:
            return
        m = self.metrics
        m.running.set(s.get("num_running", 0))
        m.waiting.set(s.get("num_waiting", 0))
        m.kv_usage.set(s.get("kv_usage", 0.0))
        m.kv_blocks_free.set(s.get("kv_blocks_free", 0))
        m.kv_blocks_cached.set(s.get("kv_blocks_cached", 0))
        m.kv_blocks_in_use.set(s.get("kv_blocks_in_use", 0))
        m.cpu_cache_usage.set(s.get("swap_usage", 0.0))
        m.swapped.set(s.get("num_swapped", 0))
        pre = s.get("num_preemptions", 0)
        if pre > self._last_preemptions:
            m.preemptions.inc(pre - self._last_preemptions)
        self._last_preemptions = pre
        for key, counter in (("spec_decode_num_drafts", m.spec_drafts),
                             ("spec_decode_num_draft_tokens", m.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", m.spec_accepted_tokens),
                             ("spec_decode_num_grammar_cut_tokens", m.spec_grammar_cut_tokens),
                             ("swap_num_swap_outs", m.swap_outs), ("swap_num_swap_ins", m.swap_ins),
                             ("swap_num_swapped_out_blocks", m.swap_out_blocks),
                             ("swap_num_swapped_in_blocks", m.swap_in_blocks),
                             ("swap_num_recompute_fallbacks", m.swap_fallbacks),
                             ("kv_offload_written_blocks", m.offload_written_blocks),
                             ("kv_offload_failed_writes", m.offload_failed_writes),
                             ("kv_offload_read_blocks", m.offload_read_blocks),
                             ("kv_offload_hits", m.offload_hits),
                             ("kv_offload_read_failed", m.offload_read_failures),
                             ("kv_compactions", m.kv_compactions),
                             ("kv_compression_dropped_tokens", m.kv_compression_dropped)):
            v = s.get(key, 0)
            if v > self._last_spec.get(key, 0):
                counter.inc(v - self._last_spec.get(key, 0))
            self._last_spec[key] = v
        # Prefix-cache counters: the KV manager's own when it reports them, else the cached
        # prompt tokens of the requests' outputs.
        q = s.get("prefix_cache_queries", self._prefix_queries)
        h = s.get("prefix_cache_hits", self._prefix_hits)
        if q > self._last_q:
            m.prefix_queries.inc(q - self._last_q)
        if h > self._last_h:
            m.prefix_hits.inc(h - self._last_h)
        self._last_q, self._last_h = q, h
        rate = s.get("prefix_cache_hit_rate")
        m.prefix_hit_rate.set(rate if rate is not None else (h / q if q else 0.0))

    def _fail_all(self, error: BaseException) -> None:
        batch = []
        for rid, track in list(self._tracks.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken
                logger.exception("abort of %s failed", rid)
            if self.metrics is not None and self.record_requests:
                self.metrics.finished("error", track.uncounted)
            batch.append((track.queue, (track.tag, EngineStoppedError(f"the engine failed: {error}"))))
        self._tracks.clear()
        if batch:
            self._call_soon(self._deliver, batch)

    def _stop_all(self) -> None:
        self._stopped = True
        while True:  # commands that arrived after "stop": refuse the adds, answer the calls
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._resolve(cmd[-1], error=EngineStoppedError("the server is shutting down"))
            elif cmd[0] == "call":
                self._resolve(cmd[2], error=EngineStoppedError("the server is shutting down"))
        batch = []
        for rid, track in list(self._tracks.items()):
            self.engine.abort_request(rid)
            batch.append((track.queue, (track.tag, EngineStoppedError("the server is shutting down"))))
        self._tracks.clear()
        if batch:
            self._call_soon(self._deliver, batch)


class MPAsyncEngine(AsyncEngine):
    """:class:`AsyncEngine`'s interface with the engine core in its own process.

    Threads and pipes::

        HTTP handlers (asyncio) ──commands──► writer thread ──pipe──► core process
             ▲                                                         │ drain commands, step()
             └── per-request asyncio.Queue ◄── event loop ◄── reader thread ◄──pipe── outputs + stats

    The core (:mod:`kvserve.engine.core_proc`) adds, aborts and steps; this side processes
    the requests' inputs (:class:`~kvserve.engine.input_processor.InputProcessor`) and their
    outputs (:class:`~kvserve.engine.output_processor.OutputProcessor`: detokenization, stop
    strings, whose ends it sends back to the core), keeps the per-request queues and records
    the metrics from the outputs and the ``stats()`` the core sends after every step (request
    bookkeeping runs on the event loop, in the order the core's messages arrive). When the core process dies, :attr:`is_running` turns False at
    once (``/health`` answers 503), every live request gets an :class:`EngineStoppedError`
    and waiting commands fail with it; new requests are refused with it.

    ``call``/``call_sync`` take only the name of a public :class:`~kvserve.engine.core.EngineCore`
    method (and picklable arguments): a function cannot cross the process boundary.

    Args:
        client: the started :class:`~kvserve.engine.core_client.CoreClient`.
        metrics: where to record request metrics (optional).
    """

    def __init__(self, client, metrics: Optional[ServerMetrics] = None) -> None:
        super().__init__(client, metrics)
        self.client = client
        self._pending: dict[int, tuple] = {}
        self._pending_lock = threading.Lock()
        self._cids = itertools.count()
        self._dead = False
        self._started = False
        self.output_processor = OutputProcessor(client.tokenizer)

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the pipe threads; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._started:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._started = True
        self.client.start_io(self._on_message, self._on_exit)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core process and wait for it; live requests get :class:`EngineStoppedError`."""
        self._stopped = True
        self.client.shutdown(timeout)
        self._core_gone("the server is shutting down")

    @property
    def is_running(self) -> bool:
        return (self._started and not self._stopped and not self._dead and self.fatal_error is None
                and self.client.is_alive())

    @property
    def core_pid(self) -> int:
        """The core process's id."""
        return self.client.pid

    # -------------------------------------------------------------- commands
    def _register(self, entry: tuple) -> int:
        with self._pending_lock:
            if self._dead or self._stopped:
                raise EngineStoppedError(self._stop_message())
            cid = next(self._cids)
            self._pending[cid] = entry
        return cid

    def _stop_message(self) -> str:
        if self.fatal_error is not None:
            return str(self.fatal_error)
        return "the server is shutting down" if self._stopped else "the engine is not running"

    async def add_requests(self, requests, params: SamplingParams, out_queue: asyncio.Queue, priority: int = 0,
                           cache_salt: Optional[str] = None, arrival: Optional[float] = None,
                           prompt_only: bool = False, kv_transfer_params: Any = None,
                           streaming: bool = True, user: Optional[str] = None) -> None:
        """See :meth:`AsyncEngine.add_requests` (the same checks run in the core process).

        ``kv_transfer_params``: every request's (prefill/decode disaggregation, see
        :class:`~kvserve.engine.input_processor.EngineCoreRequest`)."""
        if not self.is_running:
            raise EngineStoppedError(self._stop_message())
        limit = self.engine.args.max_waiting
        if limit and len(requests) > limit:
            raise ValueError(f"prompt: a batch of {len(requests)} prompts exceeds the waiting-queue limit of this "
                             f"server ({limit} requests, --max-waiting); send at most {limit} at a time")
        fut = asyncio.get_running_loop().create_future()
        arrival = time.perf_counter() if arrival is None else arrival
        items = [(rid, list(ids), tag) for rid, ids, tag in requests]
        reqs = core_requests(self.client.input_processor, [(rid, ids) for rid, ids, _ in items], params,
                             priority, cache_salt, user)
        for r in reqs:
            r.kv_transfer_params = kv_transfer_params
        cid = self._register(("add", items, reqs, out_queue, arrival, prompt_only, fut))
        self.client.send(("add", cid, reqs))
        try:
            await fut
        except asyncio.CancelledError:
            for rid, _, _ in items:
                self.abort(rid)  # the core handles commands in order: these aborts follow the add
            raise

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe, returns at once); the core frees its KV blocks before its next step."""
        self.client.send(("abort", [request_id]))
        run_on_loop(self._loop, self._forget, request_id)

    def _forget(self, request_id: str) -> None:
        self.output_processor.abort_request(request_id)
        track = self._tracks.pop(request_id, None)
        if track is not None and self.metrics is not None and self.record_requests:
            if track.uncounted > 0:
                self.metrics.finished("abort", track.uncounted)

    async def call(self, fn: str, *args) -> Any:
        """Run the public :class:`~kvserve.engine.core.EngineCore` method ``fn`` with ``args`` in
        the core, between steps.

        Raises:
            TypeError: ``fn`` is not a method name.
            EngineStoppedError: the core is gone.
            Exception: what the method raised.
        """
        if not isinstance(fn, str):
            raise TypeError("with the engine core in its own process, call() takes a public engine method's name "
                            f"(e.g. 'stats'), not {type(fn).__name__}")
        fut = asyncio.get_running_loop().create_future()
        cid = self._register(("call", fut))
        self.client.send(("call", cid, fn, args))
        return await fut

    def call_sync(self, fn: str, *args, timeout: float = 30.0) -> Any:
        """Like :meth:`call`, from a thread that is not the event loop's.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if not isinstance(fn, str):
            raise TypeError("with the engine core in its own process, call_sync() takes a public engine method's "
                            f"name (e.g. 'stats'), not {type(fn).__name__}")
        box: dict = {}
        done = threading.Event()
        cid = self._register(("call_sync", box, done))
        self.client.send(("call", cid, fn, args))
        if not done.wait(timeout):
            with self._pending_lock:
                self._pending.pop(cid, None)
            raise TimeoutError("the engine core did not answer")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def pause(self) -> None:
        """Stop stepping (commands are still handled): requests queue up. For tests and drains."""
        self.client.send(("pause",))

    def resume(self) -> None:
        self.client.send(("resume",))

    # ------------------------------------------------- the reader thread's side
    @property
    def busy(self) -> bool:
        return bool(self._tracks)

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("outputs", "stats", "step_failed"):  # the core sends one after each step (or when idle)
            self._last_beat = time.monotonic()
        if kind == "outputs":
            self._call_soon(self._on_outputs, msg[1], msg[2])
        elif kind == "stats":
            self._call_soon(self._apply_stats, msg[1])
        elif kind in ("added", "reply"):
            with self._pending_lock:
                entry = self._pending.pop(msg[1], None)
            if entry is None:  # (a call_sync that timed out)
                return
            if kind == "added":
                self._call_soon(self._added, entry, msg[2])
            elif entry[0] == "call_sync":
                _, box, done = entry
                box["value" if msg[2] else "error"] = msg[3]
                done.set()
            else:
                self._resolve(entry[1], value=msg[3] if msg[2] else None, error=None if msg[2] else msg[3])
        elif kind == "step_failed":
            self._call_soon(self._fail_tracks, f"the engine failed: {msg[1]}")
            self._call_soon(self._apply_stats, msg[2])
        elif kind == "dead":  # (the core exits next: not running from now on, /health 503)
            if not self._stopped and self.fatal_error is None:
                self.fatal_error = EngineStoppedError(msg[1])
                logger.error("%s; failing %d live request(s)", msg[1], len(self._tracks))
                self._core_gone(msg[1])
        elif kind == "stopped":
            pass
        else:
            logger.error("unknown message from the engine core: %r", kind)

    def _on_exit(self, exitcode: Optional[int]) -> None:
        if self._stopped:
            self._core_gone("the server is shutting down")
            return
        if self.fatal_error is not None:  # (the core said why before it exited: "dead")
            self._core_gone(str(self.fatal_error))
            return
        from kvserve.engine.core_client import describe_exit

        describe = getattr(self.client, "death_message", None)  # (a replica's client names the replica)
        self.fatal_error = EngineStoppedError(describe(exitcode) if describe is not None
                                              else f"the engine core process died ({describe_exit(exitcode)})")
        logger.error("%s; failing %d live request(s)", self.fatal_error, len(self._tracks))
        self._core_gone(str(self.fatal_error))

    def _core_gone(self, message: str) -> None:
        """Fail every waiting command and live request with ``message`` (any thread; idempotent)."""
        with self._pending_lock:
            self._dead = True
            pending, self._pending = list(self._pending.values()), {}
        for entry in pending:
            err = EngineStoppedError(message)
            if entry[0] == "call_sync":
                entry[1]["error"] = err
                entry[2].set()
            else:
                self._resolve(entry[-1] if entry[0] == "add" else entry[1], error=err)
        if self._loop is not None:  # (never started: no request was ever tracked)
            self._call_soon(self._fail_tracks, message)

    # ------------------------------------------------------ the event loop's side
    def _added(self, entry: tuple, error: Optional[BaseException]) -> None:
        _, items, reqs, out_queue, arrival, prompt_only, fut = entry
        if fut.done():  # the handler was cancelled: it aborts these requests itself
            return
        if error is not None:
            fut.set_exception(error)
            return
        if not self._tracks:  # work arrives at an idle engine: the heartbeat starts now
            self._last_beat = time.monotonic()
        for (rid, _, tag), r in zip(items, reqs):
            params = r.sampling_params
            self.output_processor.add_request(rid, r.prompt_token_ids, r.prompt, params)
            self._tracks[rid] = _track(out_queue, tag, arrival, params, prompt_only)
        fut.set_result(None)

    def _on_outputs(self, outputs: list, stats: dict) -> None:
        """A step's :class:`~kvserve.engine.core_output.EngineCoreOutput` s: detokenized here
        (:class:`OutputProcessor`); samples ended at a stop string are finished in the core,
        requests whose output processing failed are aborted there."""
        processed = self.output_processor.process_outputs(outputs)
        if processed.finished_samples:
            self.client.send(("finish", processed.finished_samples))
        if processed.failed:
            self.client.send(("abort", processed.failed))
        self._dispatch(processed.request_outputs)
        self._apply_stats(stats)

    def _fail_tracks(self, message: str) -> None:
        """Fail every live request with an :class:`EngineStoppedError` (its ``unfinished_samples``:
        the samples not finished yet), counted as errors, except for the requests whose queue
        counts their failures itself (``counts_failures``: the replicas' front end, which may
        send such a request again to another replica)."""
        batch = []
        for rid, track in list(self._tracks.items()):
            err = EngineStoppedError(message)
            err.unfinished_samples = track.uncounted
            if self.metrics is not None and self.record_requests and not getattr(track.queue, "counts_failures",
                                                                                  False):
                self.metrics.finished("error", err.unfinished_samples)
            batch.append((track.queue, (track.tag, err)))
        self._tracks.clear()
        self.output_processor.requests.clear()
        self._deliver(batch)
