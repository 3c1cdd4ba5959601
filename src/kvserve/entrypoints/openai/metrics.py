"""Prometheus metrics of a serving engine (names after vLLM's, prefix ``kvserve:``).

Each server owns its own :class:`prometheus_client.CollectorRegistry`, so several servers
(e.g. in one test process) never share counters. All latencies are seconds; every metric
carries a ``model_name`` label.

Histograms (one observation per returned sequence, as ``request_success_total``: a request with
``n > 1`` counts ``n``, as vLLM's ``n`` child requests do; a beam search counts once):
    time_to_first_token_seconds       arrival at the server → the sequence's first generated token
    time_per_output_token_seconds     (finish − first token) / (output tokens − 1), sequences with ≥ 2 tokens
    inter_token_latency_seconds       gap between successive outputs of a sequence (one per step)
    e2e_request_latency_seconds       arrival → the sequence's finish
    request_queue_time_seconds        arrival → first scheduled
Gauges: num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1),
    kv_cache_free_blocks / kv_cache_cached_blocks / kv_cache_used_blocks (KV blocks unreferenced
    and empty / in the prefix cache and evictable / referenced by requests: they sum to the pool),
    prefix_cache_hit_rate (cached / queried prompt tokens, 0..1), cpu_cache_usage_perc (host swap pool
    blocks in use, 0..1), num_requests_swapped (requests whose KV is in the host swap pool).
Counters: prompt_tokens_total, generation_tokens_total, num_preemptions_total,
    prefix_cache_queries_total / prefix_cache_hits_total (tokens),
    spec_decode_num_drafts_total (verification steps with drafts),
    spec_decode_num_draft_tokens_total / spec_decode_num_accepted_tokens_total (proposed and
    accepted draft tokens: their ratio is the acceptance rate),
    spec_decode_num_grammar_cut_tokens_total (drafts of structured-output requests dropped before
    verification, after one their grammar rejects),
    swap_out_requests_total / swap_in_requests_total (preempted requests whose KV moved to the host
    pool and back), swap_out_blocks_total / swap_in_blocks_total (KV blocks moved, all layers),
    swap_recompute_fallbacks_total (preemptions recomputed because the host pool was full),
    kv_offload_written_blocks_total / kv_offload_read_blocks_total (KV blocks written to and read
    back from the prefix cache's disk tier, --kv-offload-dir; written: as the workers reported),
    kv_offload_failed_writes_total (blocks whose write failed), kv_offload_hits_total (requests that
    read blocks from the disk tier), kv_offload_read_failures_total (reads refused: a missing,
    corrupt or truncated file; the request recomputed),
    kv_compactions_total / kv_compression_dropped_tokens_total (KV compression: compactions applied,
    cached tokens they dropped),
    request_success_total{finished_reason} (one per returned sequence: stop, length, abort, error).

Besides the registry, bounded rings of the most recent finished requests (their prompt and
output lengths and latencies, :meth:`ServerMetrics.record_request`) and inter-token gaps feed
the web dashboard's distributions (:meth:`ServerMetrics.recent`), and :meth:`ServerMetrics.values`
reads every series' current value (summed over the replicas of a server of replicas).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series (as vLLM)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: how many finished requests, and inter-token gaps, the rings behind the dashboard keep
RECENT_REQUESTS = 1000
RECENT_ITL = 5000


class ServerMetrics:
    """The server's metrics in a private registry.

    Args:
        model_name: value of the ``model_name`` label.
        replicas: for a server of engine replicas (``kvserve serve --data-parallel-size`` or
            ``--prefill-replicas/--decode-replicas``), the replicas' names: every metric above
            then also carries a ``replica`` label, recorded through :meth:`for_replica`'s views
            (sum over it to aggregate), and the server adds the disaggregation histograms (with
            the ``replica`` label too: the decode replica's for kv_transfer_* and
            ttft_transfer_seconds, the prefill replica's for ttft_queue_seconds and
            ttft_prefill_seconds):

            kv_transfer_blocks / kv_transfer_bytes / kv_transfer_seconds    per transferred request:
                blocks and bytes a decode replica loaded, seconds it took (fetch and write)
            ttft_queue_seconds      arrival → first scheduled on the prefill replica
            ttft_prefill_seconds    first scheduled → the prefill's K/V saved and its handle back
            ttft_transfer_seconds   handle back → first token of the decode replica (the hop, the
                                    load of the blocks and the one prompt token owed)

        and the counter request_retries_total: requests this replica lost (it died before they
        showed anything) that were sent again to another replica. Such a request counts once in
        request_success_total, on the replica that finished it; one lost with its replica and
        not sent again counts as an error there (a prefill replica's, with disaggregation).
    """

    def __init__(self, model_name: str, replicas=None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model_name
        self._families: dict = {}
        self._lock = threading.Lock()  # (the rings: shared with the replicas' views)
        self._requests: deque = deque(maxlen=RECENT_REQUESTS)
        self._itl: deque = deque(maxlen=RECENT_ITL)
        r, lab = self.registry, ["model_name"] + (["replica"] if replicas is not None else [])

        def hist(attr, name, doc, buckets):
            self._families[attr] = Histogram(f"kvserve:{name}", doc, lab, buckets=buckets, registry=r)

        def gauge(attr, name, doc):
            self._families[attr] = Gauge(f"kvserve:{name}", doc, lab, registry=r)

        def counter(attr, name, doc):
            self._families[attr] = Counter(f"kvserve:{name}", doc, lab, registry=r)

        hist("ttft", "time_to_first_token_seconds", "Time to first token (s).", LATENCY_BUCKETS)
        hist("tpot", "time_per_output_token_seconds", "Mean time per output token after the first (s).",
             TOKEN_LATENCY_BUCKETS)
        hist("itl", "inter_token_latency_seconds", "Time between successive outputs of a request (s).",
             TOKEN_LATENCY_BUCKETS)
        hist("e2e", "e2e_request_latency_seconds", "End-to-end request latency (s).", LATENCY_BUCKETS)
        hist("queue_time", "request_queue_time_seconds", "Time from arrival to first schedule (s).", LATENCY_BUCKETS)
        gauge("running", "num_requests_running", "Requests running in the engine.")
        gauge("waiting", "num_requests_waiting", "Requests waiting to be scheduled.")
        gauge("kv_usage", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        gauge("kv_blocks_free", "kv_cache_free_blocks", "KV blocks unreferenced and holding no cached KV.")
        gauge("kv_blocks_cached", "kv_cache_cached_blocks", "KV blocks in the prefix cache, unreferenced (evictable).")
        gauge("kv_blocks_in_use", "kv_cache_used_blocks", "KV blocks referenced by requests.")
        gauge("prefix_hit_rate", "prefix_cache_hit_rate",
              "Prompt tokens served from the prefix cache / prompt tokens (0..1).")
        counter("prompt_tokens", "prompt_tokens", "Prompt tokens of the requests (counted once per request).")
        counter("generation_tokens", "generation_tokens", "Generated tokens (all returned sequences).")
        counter("preemptions", "num_preemptions", "Preemptions by the scheduler.")
        counter("prefix_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        counter("prefix_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        counter("spec_drafts", "spec_decode_num_drafts", "Speculative verification steps (requests with drafts).")
        counter("spec_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        counter("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        counter("spec_grammar_cut_tokens", "spec_decode_num_grammar_cut_tokens",
                "Draft tokens dropped before verification by a request's grammar.")
        gauge("cpu_cache_usage", "cpu_cache_usage_perc", "Fraction of host swap-pool KV blocks in use (0..1).")
        gauge("swapped", "num_requests_swapped", "Requests whose KV is swapped out to the host pool.")
        counter("swap_outs", "swap_out_requests", "Preempted requests whose KV was swapped out to the host.")
        counter("swap_ins", "swap_in_requests", "Swapped requests whose KV was swapped back in.")
        counter("swap_out_blocks", "swap_out_blocks", "KV blocks copied to the host pool.")
        counter("swap_in_blocks", "swap_in_blocks", "KV blocks copied back from the host pool.")
        counter("swap_fallbacks", "swap_recompute_fallbacks",
                "Preemptions recomputed instead of swapped (host pool full).")
        counter("offload_written_blocks", "kv_offload_written_blocks",
                "KV blocks evicted from the prefix cache and written to the disk tier (every rank's file).")
        counter("offload_failed_writes", "kv_offload_failed_writes",
                "KV blocks whose write to the disk tier failed (full disk, directory gone); not on disk.")
        counter("offload_read_blocks", "kv_offload_read_blocks", "KV blocks read back from the disk tier.")
        counter("offload_hits", "kv_offload_hits", "Requests that read KV blocks from the disk tier.")
        counter("offload_read_failures", "kv_offload_read_failures",
                "Disk-tier reads refused (missing, corrupt or truncated files); the request recomputed.")
        counter("kv_compactions", "kv_compactions", "KV compressions applied (StreamingLLM, SnapKV, H2O).")
        counter("kv_compression_dropped", "kv_compression_dropped_tokens",
                "Cached tokens dropped by KV compression.")
        self._success_family = Counter("kvserve:request_success", "Finished sequences by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.replicas = list(replicas) if replicas is not None else None
        if replicas is None:
            self._bind(self, (model_name,))
        else:
            hist("kv_transfer_blocks", "kv_transfer_blocks", "KV blocks a decode replica loaded per transferred "
                 "request.", BLOCK_BUCKETS)
            hist("kv_transfer_bytes", "kv_transfer_bytes", "KV bytes a decode replica loaded per transferred request.",
                 BYTE_BUCKETS)
            hist("kv_transfer_seconds", "kv_transfer_seconds", "Seconds a decode replica took to load a request's "
                 "transferred blocks.", LATENCY_BUCKETS)
            hist("ttft_queue", "ttft_queue_seconds", "TTFT part: arrival to first scheduled on the prefill replica (s).",
                 LATENCY_BUCKETS)
            hist("ttft_prefill", "ttft_prefill_seconds", "TTFT part: prefill, until its K/V handle is back (s).",
                 LATENCY_BUCKETS)
            hist("ttft_transfer", "ttft_transfer_seconds", "TTFT part: handle back to the decode replica's first "
                 "token (s).", LATENCY_BUCKETS)
            counter("retries", "request_retries", "Requests sent again to another replica after this one died "
                    "before they showed anything.")
            self._views = {name: self._view(name) for name in replicas}

    def _bind(self, target: "ServerMetrics", values: tuple) -> None:
        for attr, family in self._families.items():
            setattr(target, attr, family.labels(*values))
        target._success = self._success_family
        target._values = values
        for reason in ("stop", "length", "abort", "error"):
            self._success_family.labels(*values, reason)

    def _view(self, replica: str) -> "ServerMetrics":
        view = object.__new__(ServerMetrics)
        view.registry, view._model, view.replicas = self.registry, self._model, None
        view._lock, view._requests, view._itl = self._lock, self._requests, self._itl
        self._bind(view, (self._model, replica))
        return view

    def for_replica(self, replica: str) -> "ServerMetrics":
        """The metrics of one replica (the same registry, ``replica`` label set).

        Raises:
            KeyError: not a replica of this server.
        """
        return self._views[replica]

    def record_itl(self, seconds: float) -> None:
        """One inter-token gap (also observed in the ``inter_token_latency_seconds`` histogram)."""
        self.itl.observe(seconds)
        with self._lock:
            self._itl.append(round(seconds, 6))

    def record_request(self, prompt_tokens: int, output_tokens: int, ttft: "float | None", tpot: "float | None",
                       e2e: float, queue_time: "float | None", finish_reason: "str | None") -> None:
        """A finished request in the ring of recent ones (latencies in seconds, None when not
        measured: no token generated, fewer than 2 tokens, never scheduled)."""
        r = lambda x: None if x is None else round(x, 6)  # noqa: E731
        with self._lock:
            self._requests.append({"time": round(time.time(), 3), "prompt_tokens": prompt_tokens,
                                   "output_tokens": output_tokens, "ttft": r(ttft), "tpot": r(tpot), "e2e": r(e2e),
                                   "queue_time": r(queue_time), "finish_reason": finish_reason})

    def recent(self) -> tuple[list[dict], list[float]]:
        """Copies of the rings: the recent finished requests (oldest first: ``time`` (Unix s),
        ``prompt_tokens``, ``output_tokens``, ``ttft``, ``tpot``, ``e2e``, ``queue_time``,
        ``finish_reason``) and the recent inter-token gaps (s)."""
        with self._lock:
            return list(self._requests), list(self._itl)

    def values(self) -> dict[str, float]:
        """Every sample's current value, by name without the ``kvserve:`` prefix (counters
        as ``..._total``, histograms as ``..._sum`` / ``..._count``; the finish-reason counter
        as ``request_success_total.<reason>``); a server of replicas' series summed over them
        (fractions such as KV usage: their mean)."""
        out: dict[str, float] = {}
        seen: dict[str, int] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    continue
                name = sample.name.removeprefix("kvserve:")
                reason = sample.labels.get("finished_reason")
                key = f"{name}.{reason}" if reason else name
                out[key] = out.get(key, 0.0) + sample.value
                seen[key] = seen.get(key, 0) + 1
        for key, n in seen.items():  # fractions: the replicas' mean
            if n > 1 and (key.endswith("_perc") or key.endswith("_rate")):
                out[key] /= n
        return out

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(*self._values, reason).inc(count)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
