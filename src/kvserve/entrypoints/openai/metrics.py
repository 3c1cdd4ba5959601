"""Prometheus metrics of a serving engine (names after vLLM's, prefix ``kvserve:``).

Each server owns its own :class:`prometheus_client.CollectorRegistry`, so several servers
(e.g. in one test process) never share counters. All latencies are seconds; every metric
carries a ``model_name`` label.

Histograms (one observation per request unless noted):
    time_to_first_token_seconds       arrival at the server → first generated token
    time_per_output_token_seconds     (finish − first token) / (output tokens − 1), requests with ≥ 2 tokens
    inter_token_latency_seconds       gap between successive outputs of a request (one per step)
    e2e_request_latency_seconds       arrival → finish
    request_queue_time_seconds        arrival → first scheduled
Gauges: num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1),
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
    request_success_total{finished_reason} (one per returned sequence: stop, length, abort, error).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series (as vLLM)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The server's metrics in a private registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"kvserve:{name}", doc, lab, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"kvserve:{name}", doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"kvserve:{name}", doc, lab, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s).", LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first (s).",
                         TOKEN_LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a request (s).",
                        TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency (s).", LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first schedule (s).",
                               LATENCY_BUCKETS)
        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens (0..1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests (counted once per request).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens (all returned sequences).")
        self.preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verification steps (requests with drafts).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_grammar_cut_tokens = counter("spec_decode_num_grammar_cut_tokens",
                                               "Draft tokens dropped before verification by a request's grammar.")
        self.cpu_cache_usage = gauge("cpu_cache_usage_perc", "Fraction of host swap-pool KV blocks in use (0..1).")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out to the host pool.")
        self.swap_outs = counter("swap_out_requests", "Preempted requests whose KV was swapped out to the host.")
        self.swap_ins = counter("swap_in_requests", "Swapped requests whose KV was swapped back in.")
        self.swap_out_blocks = counter("swap_out_blocks", "KV blocks copied to the host pool.")
        self.swap_in_blocks = counter("swap_in_blocks", "KV blocks copied back from the host pool.")
        self.swap_fallbacks = counter("swap_recompute_fallbacks",
                                      "Preemptions recomputed instead of swapped (host pool full).")
        self._success = Counter("kvserve:request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(self._model, reason)

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(self._model, reason).inc(count)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
