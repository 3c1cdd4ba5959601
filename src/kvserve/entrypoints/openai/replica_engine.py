"""ReplicatedAsyncEngine: :class:`~kvserve.entrypoints.openai.async_engine.AsyncEngine`'s
interface over engine replicas on Ray Serve.

``kvserve serve --data-parallel-size N`` / ``--prefill-replicas P --decode-replicas D``: the
OpenAI server (HTTP, tokenization, chat templates, detokenization, metrics) runs in this
process as for one engine; each replica is an engine core in a Ray Serve replica
(:mod:`kvserve.engine.replica`), driven by an :class:`MPAsyncEngine` over a
:class:`~kvserve.engine.replica_client.ReplicaClient`. This class routes each request
(:class:`~kvserve.engine.router.Router`) and follows it to the end (:class:`_Relay`):

* **Replicas** (data parallel): the router picks a replica; the request runs there.
* **Prefill/decode disaggregation**: the request first runs on a prefill replica with
  ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``: the replica computes
  the prompt and saves the K/V of its first ``P - 1`` tokens through the ``"ray"`` KV
  connector (Ray's object store), and its final output carries the
  :class:`~kvserve.distributed.kv_transfer.KVTransferHandle`. The token it sampled is dropped.
  The request then runs on a decode replica with that handle: the decode engine takes the
  blocks its prefix cache holds, loads only the others, computes the one prompt token owed
  and decodes to the end (vLLM's disaggregated-prefill proxy does the same with
  ``max_tokens=1``). Requests the transfer cannot serve (beam search, ``prompt_logprobs``,
  echo without generation) run on a decode replica alone. The objects are freed when the
  front end drops the handle (Ray's reference counting: a prefill replica that dies takes them
  with it, and the decode replica then recomputes the prompt).
* **Faults**: when a replica dies, its requests that have delivered nothing yet are sent
  again to another replica (at most :data:`MAX_RETRIES` times), and the others end with an
  :class:`EngineStoppedError` (an error event for a stream). Ray Serve replaces the replica;
  a watcher reconnects to it (:meth:`replica_states` says ``restarting`` meanwhile, then
  ``healthy`` with the new process id) and forgets its routing tree.
* **Metrics**: a request counts once in ``request_success_total``: on the replica that
  finished it, or as an ``error`` (``abort``) of the replica it was on when it failed (was
  aborted), a prefill replica included; a request sent again after its replica died counts one
  ``request_retries_total`` of that replica, not an error; its samples' ends (success, e2e
  latency, TPOT) count only where it is answered (a request that is not streamed counts them
  when it ends, as it may be sent again until then: ``async_engine._track``), while the prompt
  tokens, TTFT and ITL the dead replica observed stay there (the relay counts the failures and the
  prefill phase's outcomes; the decode replicas' engines count the rest).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

from kvserve.engine.router import Router
from kvserve.entrypoints.openai.async_engine import EngineStoppedError, MPAsyncEngine, run_on_loop
from kvserve.entrypoints.openai.metrics import ServerMetrics
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.entrypoints.openai")

#: times a request that got nothing yet is sent again after its replica died
MAX_RETRIES = 2
#: seconds between the watcher's looks at the replicas
WATCH_PERIOD_S = 1.0
#: seconds the watcher waits for a restarted replica to answer, per try
RECONNECT_TIMEOUT_S = 5.0


def _prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill replica runs: the prompt and one greedy token (dropped)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class ReplicatedAsyncEngine:
    """Routes requests to engine replicas and follows each to its end (see the module docstring).

    Args:
        pool: the :class:`~kvserve.engine.replica_client.ReplicaPool` (its deployment started).
        metrics: the server's metrics, made with ``replicas=pool.names``.
        router_kwargs: :class:`~kvserve.engine.router.Router`'s thresholds.
    """

    def __init__(self, pool, metrics: Optional[ServerMetrics] = None, **router_kwargs) -> None:
        self.pool = pool
        self.metrics = metrics
        self.disaggregated = pool.disaggregated
        self.prefill_names = [n for n in pool.names if pool.role(n) == "prefill"]
        self.decode_names = [n for n in pool.names if pool.role(n) != "prefill"]
        bs = pool.args.block_size
        self.router = Router(self.decode_names, pool.routing, bs, **router_kwargs)
        self.prefill_router = Router(self.prefill_names, pool.routing, bs, **router_kwargs) \
            if self.disaggregated else None
        self.engines: dict[str, MPAsyncEngine] = {}
        self.states: dict[str, str] = {n: "starting" for n in pool.names}
        self.restarts: dict[str, int] = {n: 0 for n in pool.names}
        self._relays: dict[str, _Relay] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._watcher: Optional[asyncio.Task] = None
        self._stopped = False
        self.fatal_error: Optional[BaseException] = None
        self.num_retries = 0
        self.num_transfers = 0

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start every replica's engine and the watcher, on ``loop`` (default: the running loop)."""
        if self._loop is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        for name, client in self.pool.clients.items():
            self._attach(name, client)
        self._watcher = self._loop.create_task(self._watch())

    def _attach(self, name: str, client) -> None:
        eng = MPAsyncEngine(client, self.metrics.for_replica(name) if self.metrics is not None else None)
        eng.record_requests = self.pool.role(name) != "prefill"
        eng.start(self._loop)
        self.pool.clients[name] = client
        self.engines[name] = eng
        self.states[name] = "healthy"

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop routing, fail the live requests, and stop the replicas (the deployment)."""
        self._stopped = True
        if self._watcher is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._watcher.cancel)
        for eng in list(self.engines.values()):
            eng.shutdown(timeout)
        self.pool.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        """Whether requests can be served: a healthy decode replica (and a prefill one when disaggregated)."""
        if self._stopped or self._loop is None:
            return False
        ok = any(self._healthy(n) for n in self.decode_names)
        return ok and (not self.disaggregated or any(self._healthy(n) for n in self.prefill_names))

    def _healthy(self, name: str) -> bool:
        eng = self.engines.get(name)
        return eng is not None and eng.is_running

    def healthy(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if self._healthy(n)]

    @property
    def stalled_for(self) -> float:
        """The step heartbeat of the replicas that could serve (``/ready``): seconds since any
        healthy replica last made a step while it had requests pending, 0 if one is idle or
        stepping."""
        stalls = [self.engines[n].stalled_for for n in self.healthy(self.pool.names)]
        return min(stalls) if stalls else 0.0

    def replica_states(self, health_timeout: Optional[float] = None) -> dict[str, dict]:
        """``{name: {"role", "state", "pid", "restarts", "in_flight", "stalled_s"}}``: ``state`` is
        ``healthy``, ``restarting`` (its process died: Ray Serve is replacing it), ``starting``, or
        ``stalled`` (no step for ``health_timeout`` seconds while requests are pending)."""
        out = {}
        for name in self.pool.names:
            router = self.prefill_router if self.pool.role(name) == "prefill" else self.router
            state = self.states[name]
            stalled = 0.0
            if state == "healthy" and not self._healthy(name):
                state = "restarting"
            elif state == "healthy":
                stalled = self.engines[name].stalled_for
                if health_timeout is not None and stalled > health_timeout:
                    state = "stalled"
            out[name] = {"role": self.pool.role(name), "state": state,
                         "pid": self.pool.clients[name].pid, "restarts": self.restarts[name],
                         "in_flight": router.load[name], "stalled_s": round(stalled, 3)}
        return out

    async def _watch(self) -> None:
        """Reconnect to replicas that Ray Serve replaced."""
        while not self._stopped:
            await asyncio.sleep(WATCH_PERIOD_S)
            for name, eng in list(self.engines.items()):
                if eng.is_running or self._stopped:
                    continue
                if self.states[name] != "restarting":
                    self.states[name] = "restarting"
                    (self.prefill_router if self.pool.role(name) == "prefill" else self.router).forget(name)
                    logger.error("replica %s is gone (%s); waiting for Ray Serve to replace it", name,
                                 eng.fatal_error)
                try:
                    info = await asyncio.wait_for(self.pool.info_async(name), RECONNECT_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - not back yet
                    logger.debug("replica %s not back yet: %s", name, e)
                    continue
                if self._stopped:
                    return
                old = self.pool.clients[name]
                old.shutdown(1.0)
                self.restarts[name] += 1
                self._attach(name, self.pool.connect(name, info))
                logger.warning("replica %s is back (process %d)", name, info.pid)

    # -------------------------------------------------------------- requests
    async def add_requests(self, requests, params: SamplingParams, out_queue: asyncio.Queue, priority: int = 0,
                           cache_salt: Optional[str] = None, arrival: Optional[float] = None,
                           prompt_only: bool = False, streaming: bool = True, user: Optional[str] = None) -> None:
        """See :meth:`AsyncEngine.add_requests`: each request is routed on its own; all are
        accepted or none runs. A request whose replica dies is sent again to another one if
        nothing of it reached the client yet: no output at all, or (``streaming`` False) no
        final output.

        Raises:
            ValueError, TypeError, QueueFullError: a replica rejected a request (its
                ``request_index`` attribute says which).
            EngineStoppedError: no replica can take requests.
        """
        if not self.is_running:
            raise EngineStoppedError("no engine replica is available (restarting?)" if not self._stopped
                                     else "the server is shutting down")
        arrival = time.perf_counter() if arrival is None else arrival
        transfer = self.disaggregated and not (params.use_beam_search or params.prompt_logprobs is not None
                                               or prompt_only)
        relays = [_Relay(self, rid, list(ids), tag, params, out_queue, priority, cache_salt, arrival, prompt_only,
                         transfer, streaming, user) for rid, ids, tag in requests]
        for r in relays:
            self._relays[r.rid] = r
        try:
            results = await asyncio.gather(*(r.submit() for r in relays), return_exceptions=True)
        except asyncio.CancelledError:
            for r in relays:
                r.abort()
            raise
        errors = [(i, e) for i, e in enumerate(results) if isinstance(e, BaseException)]
        if errors:
            for r in relays:
                r.abort()
            index, error = errors[0]
            error.request_index = index
            raise error

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it runs (thread-safe, returns at once)."""
        run_on_loop(self._loop, self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        relay = self._relays.get(request_id)
        if relay is not None:
            relay.abort()

    async def call(self, fn: str, *args, replica: Optional[str] = None) -> Any:
        """Run the public :class:`~kvserve.engine.core.EngineCore` method ``fn`` on ``replica``,
        or on every healthy replica: ``{name: value}``."""
        if replica is not None:
            return await self.engines[replica].call(fn, *args)
        names = self.healthy(self.pool.names)
        values = await asyncio.gather(*(self.engines[n].call(fn, *args) for n in names))
        return dict(zip(names, values))

    def call_sync(self, fn: str, *args, timeout: float = 30.0, replica: Optional[str] = None) -> Any:
        """Like :meth:`call`, from a thread that is not the event loop's."""
        if replica is not None:
            return self.engines[replica].call_sync(fn, *args, timeout=timeout)
        return {n: self.engines[n].call_sync(fn, *args, timeout=timeout) for n in self.healthy(self.pool.names)}

    def pause(self) -> None:
        for eng in self.engines.values():
            eng.pause()

    def resume(self) -> None:
        for eng in self.engines.values():
            eng.resume()


class _Relay:
    """One request's path through the replicas: it stands in for the request's ``out_queue``
    on the replica's :class:`MPAsyncEngine` (``put_nowait``, on the event loop), hands the
    prefill's handle to a decode replica, retries after a replica's death while nothing was
    delivered, and forwards the decode replica's outputs."""

    def __init__(self, owner: ReplicatedAsyncEngine, rid: str, ids: list[int], tag, params: SamplingParams,
                 out_queue: asyncio.Queue, priority: int, cache_salt: Optional[str], arrival: float,
                 prompt_only: bool, transfer: bool, streaming: bool = True, user: Optional[str] = None) -> None:
        self.owner, self.rid, self.ids, self.tag, self.params = owner, rid, ids, tag, params
        self.out_queue, self.priority, self.cache_salt = out_queue, priority, cache_salt
        self.arrival, self.prompt_only, self.transfer = arrival, prompt_only, transfer
        self.streaming = streaming
        self.user = user
        self.phase = "prefill" if transfer else "decode"
        self.replica: Optional[str] = None
        self.delivered = False  # an output the client may have seen
        self.first_seen = False
        self.done = False
        self.attempts = 0
        self.prefill_done_at: Optional[float] = None
        self._counted: Optional[tuple[Router, str]] = None  # the load count this request holds

    #: the replicas' engines leave the count of this request's failures to the relay (:meth:`_failed`)
    counts_failures = True

    def _outcome(self, reason: str, samples: Optional[int] = None) -> None:
        """Count the request's end (``error``, ``abort``) in ``request_success_total`` of the
        replica it was on: ``samples`` sequences (default: all of them)."""
        m = self.owner.metrics
        if m is not None and self.replica is not None:
            m.for_replica(self.replica).finished(reason, self.params.n if samples is None else samples)

    def _retried(self, name: str) -> None:
        """The request was lost with replica ``name`` and is sent again."""
        self.attempts += 1
        self.owner.num_retries += 1
        if self.owner.metrics is not None:
            self.owner.metrics.for_replica(name).retries.inc()

    def _can_retry(self) -> bool:
        """Whether a replica could take the request again (a decode one, and a prefill one for a transfer)."""
        owner = self.owner
        return (self.attempts < MAX_RETRIES and not owner._stopped and bool(owner.healthy(owner.decode_names))
                and (not self.transfer or bool(owner.healthy(owner.prefill_names))))

    def _count(self, router: Router, name: str) -> None:
        self._uncount()
        router.started(name, self.ids)
        self._counted = (router, name)

    def _uncount(self) -> None:
        if self._counted is not None:
            router, name = self._counted
            router.finished(name)
            self._counted = None

    # ------------------------------------------------------------- sending
    def _router(self, phase: str) -> Router:
        return self.owner.prefill_router if phase == "prefill" else self.owner.router

    async def submit(self) -> None:
        """Send the request to its first replica; raises if it is rejected (counted as an error
        if the replica it was routed to died meanwhile)."""
        owner = self.owner
        try:
            if self.transfer:  # the decode side's checks (max_tokens vs the context...) before any work
                d = owner.router.choose(self.ids, owner.healthy(owner.decode_names))
                await owner.engines[d].call("validate_request", self.ids, self.params)
                await self._send("prefill")
            else:
                await self._send("decode")
        except EngineStoppedError:
            if self.replica is not None and not self.done and not owner._healthy(self.replica):
                self._outcome("error")  # lost with the replica it was routed to
            raise

    async def _send(self, phase: str, handle: Any = None, exclude: Sequence[str] = ()) -> None:
        owner = self.owner
        router = self._router(phase)
        names = owner.prefill_names if phase == "prefill" else owner.decode_names
        try:
            name = router.choose(self.ids, owner.healthy(names), exclude)
        except LookupError:
            raise EngineStoppedError(f"no {'prefill' if phase == 'prefill' else 'engine'} replica is available "
                                     "(restarting?)") from None
        self._count(router, name)
        self.phase, self.replica = phase, name
        eng = owner.engines[name]
        try:
            if phase == "prefill":
                await eng.add_requests([(self.rid, self.ids, self.tag)], _prefill_params(self.params), self,
                                       self.priority, self.cache_salt, self.arrival,
                                       kv_transfer_params={"do_remote_decode": True}, user=self.user)
            else:
                await eng.add_requests([(self.rid, self.ids, self.tag)], self.params, self, self.priority,
                                       self.cache_salt, self.arrival, self.prompt_only, kv_transfer_params=handle,
                                       user=self.user)
                track = eng._tracks.get(self.rid)
                if handle is not None and track is not None:  # its queue time was the prefill replica's
                    track.queue_time_seen = True
        except EngineStoppedError:
            # the replica died before it accepted the request (it was chosen while still up):
            # nothing ran, so the request goes to another one, as after a death mid-run
            self._uncount()
            if (owner._healthy(name) or self.done or owner._stopped or self.attempts >= MAX_RETRIES
                    or not owner.healthy(names)):
                raise
            self._retried(name)
            logger.warning("request %s: replica %s died before it accepted it; sending it again (try %d)",
                           self.rid, name, self.attempts + 1)
            await self._send(phase, handle, exclude=(*exclude, name))
            return
        except BaseException:
            self._uncount()
            raise
        if self.done:  # aborted meanwhile
            self._abort_on(eng)

    # ------------------------------------------------------------ receiving
    def put_nowait(self, item: tuple) -> None:
        """An output (or an error) of the replica's engine for this request."""
        if self.done:
            return
        _, out = item
        if isinstance(out, BaseException):
            self._failed(out)
            return
        if self.phase == "prefill":
            if out.error is not None:
                self._outcome("error")  # (a prefill replica's engine records no request)
                self._end((self.tag, out))
            elif out.finished:
                self._prefill_done(out)
            return
        if not self.first_seen:
            self.first_seen = True
            self._first_output(out)
        self.delivered = self.streaming or out.finished  # (what the client may have seen)
        if out.finished:
            self._end((self.tag, out))
        else:
            self.out_queue.put_nowait((self.tag, out))

    def _prefill_done(self, out) -> None:
        owner = self.owner
        self._uncount()
        now = time.perf_counter()
        self.prefill_done_at = now
        if owner.metrics is not None and out.metrics is not None and out.metrics.first_scheduled_time is not None:
            m = owner.metrics.for_replica(self.replica)  # (the prefill replica's)
            start = max(out.metrics.first_scheduled_time, self.arrival)
            m.ttft_queue.observe(max(0.0, start - self.arrival))
            m.ttft_prefill.observe(max(0.0, now - start))
            m.queue_time.observe(max(0.0, start - self.arrival))
        handle = out.kv_transfer_params
        if handle is None:
            self._fail(EngineStoppedError("the prefill replica returned no KV transfer handle"))
            return
        owner.num_transfers += 1
        asyncio.ensure_future(self._hop(handle))

    async def _hop(self, handle) -> None:
        try:
            await self._send("decode", handle=handle)
        except Exception as e:  # noqa: BLE001 - the request's error
            if not self.done:
                self._fail(e)

    def _first_output(self, out) -> None:
        if self.owner.metrics is None or not self.transfer:
            return
        m = self.owner.metrics.for_replica(self.replica)  # (the decode replica's)
        if self.prefill_done_at is not None:
            m.ttft_transfer.observe(max(0.0, time.perf_counter() - self.prefill_done_at))
        stats = getattr(out, "kv_transfer_stats", None)
        if stats:
            m.kv_transfer_blocks.observe(stats.get("blocks", 0))
            m.kv_transfer_bytes.observe(stats.get("bytes", 0))
            m.kv_transfer_seconds.observe(stats.get("seconds", 0.0))

    def _failed(self, error: BaseException) -> None:
        """The replica's engine failed the request (it died, or a step failed): sent again if
        the replica is gone, nothing was shown and another replica can take it, else ended
        with ``error`` (its unfinished samples counted as errors of the replica)."""
        owner = self.owner
        self._uncount()
        gone = not owner._healthy(self.replica)
        if gone and not self.delivered and self._can_retry():
            self._retried(self.replica)
            logger.warning("request %s: replica %s died before it answered; sending it again (try %d)",
                           self.rid, self.replica, self.attempts + 1)
            asyncio.ensure_future(self._retry(self.replica))
            return
        # (the prefill replica ran one sample of it: all of them are lost)
        self._outcome("error", None if self.phase == "prefill" else getattr(error, "unfinished_samples", None))
        self.done = True
        self.owner._relays.pop(self.rid, None)
        self.out_queue.put_nowait((self.tag, error))

    async def _retry(self, failed: str) -> None:
        try:
            await self._send("prefill" if self.transfer else "decode", exclude=(failed,))
        except Exception as e:  # noqa: BLE001 - the request's error
            if not self.done:
                self._fail(e)

    def _fail(self, error: BaseException) -> None:
        """End the request with ``error``, raised in the front end (no engine counted it)."""
        self._outcome("error")
        self._end((self.tag, error))

    def _end(self, item: tuple) -> None:
        self._uncount()
        self.done = True
        self.owner._relays.pop(self.rid, None)
        self.out_queue.put_nowait(item)

    def abort(self) -> None:
        """Cancel the request on the replica that has it (idempotent)."""
        if self.done:
            return
        self.done = True
        self.owner._relays.pop(self.rid, None)
        self._uncount()
        if self.replica is not None:
            eng = self.owner.engines.get(self.replica)
            if eng is not None:
                self._abort_on(eng)

    def _abort_on(self, eng) -> None:
        """Abort the request on ``eng``, its replica's engine (which counts the abort, except a
        prefill replica's: counted here if it held the request)."""
        if self.phase == "prefill" and self.rid in eng._tracks:
            self._outcome("abort")
        eng.abort(self.rid)
