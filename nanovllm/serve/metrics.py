"""The OpenAI server's Prometheus metrics (GET /metrics), under vLLM's names, so that dashboards
and alerts written for a vLLM server read a nano-vllm one unchanged.

Counted in the server's process as each request's events pass through it (run.py's Run):
prompt and generated tokens, finished requests by finish reason (sample 0's with n > 1; "abort"
for a client that left),
time to first token, the gaps between a sample's token batches (one per engine step: inter-token
latency) and end-to-end latency, all from the moment the HTTP request was read. Read from the
engine at each scrape: running and waiting sequences and the share of KV blocks in use. Every
series carries a `model_name` label (the served model name). Each ServerMetrics has a registry of
its own: two apps in one process (the tests) never share a counter.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The histograms' buckets: vLLM's, so that its quantile panels apply (the offline metrics' too).
from nanovllm.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The metrics of one served model; `engine` is read at each scrape (its `stats`)."""

    def __init__(self, model_name: str, engine):
        self.engine = engine
        self.registry = CollectorRegistry()
        r, name = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", name,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", name,
                                         registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                name + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token of a request.", name,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a sample's token batches.", name,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from a request's arrival to its end.", name,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._running = Gauge("vllm:num_requests_running", "Sequences in the engine's running queue.", name,
                              registry=r).labels(model_name)
        self._waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", name,
                              registry=r).labels(model_name)
        self._kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0 to 1).", name,
                               registry=r).labels(model_name)
        self._drafts = [Counter(f"vllm:spec_decode_{what}", help_text, name, registry=r).labels(model_name)
                        for what, help_text in (("num_drafts", "Speculative decoding: verifications of drafts."),
                                                ("num_draft_tokens", "Speculative decoding: drafted tokens."),
                                                ("num_accepted_tokens", "Speculative decoding: accepted tokens."))]
        self._drafts_seen = (0, 0, 0)
        self._scrape = threading.Lock()  # two scrapes at once must not both add the same increments
        self.model_name = model_name

    def request(self) -> "RequestTimes":
        """The clock of one engine request (one prompt), started now."""
        return RequestTimes(self)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        """The text the scrape gets: the engine's queues and KV use as of now, then everything."""
        stats = self.engine.stats
        if stats is not None:
            self._running.set(stats.running)
            self._waiting.set(stats.waiting)
            self._kv_usage.set(1 - stats.free_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0)
            with self._scrape:
                for counter, now, seen in zip(self._drafts, stats.drafts, self._drafts_seen):
                    counter.inc(max(now - seen, 0))  # the engine's totals, as counter increments
                self._drafts_seen = stats.drafts
        return generate_latest(self.registry)


class RequestTimes:
    """Arrival, first token and each sample's latest token batch of one engine request."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first = None
        self.last: dict[int, float] = {}  # sample index -> time of its latest token batch
        self.reason = None  # sample 0's finish reason, once it has one

    def tokens(self, sample: int, count: int, finish_reason: str | None = None) -> None:
        """`count` new tokens of sample `sample` arrived now (and its finish reason, if it ended)."""
        if sample == 0 and finish_reason is not None:
            self.reason = finish_reason
        if not count:
            return
        now = time.perf_counter()
        m = self.metrics
        m.generation_tokens.inc(count)
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.arrival)
        if sample in self.last:
            m.itl.observe(now - self.last[sample])
        self.last[sample] = now

    def end(self, reason: str | None = None) -> None:
        """The request ended: counted once, under `reason` or else its sample 0's finish reason."""
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.finished(reason or self.reason or "unknown")
