"""Engine statistics for `LLM(disable_log_stats=False)` (vLLM's switch): each request's times
(RequestOutput.metrics) and the counters and histograms `LLM.get_metrics()` returns, under the
names the server exports. A SchedulingHook notes when a request is first scheduled; the front
hands the recorder every step's outputs. Off by default: no cost on the step path."""

from __future__ import annotations

import time
from collections import Counter as Tally

from nanovllm.core.hooks import SchedulingHook
from nanovllm.features.speculative.drafting import draft_counts
from nanovllm.metrics import (E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Counter, Gauge, Histogram, Metric,
                              RequestMetrics, Vector)


class StatsRecorder(SchedulingHook):
    """The statistics of one engine (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.times: dict[int, RequestMetrics] = {}  # seq id (every sample) -> its times
        self.prompt_tokens = self.generation_tokens = 0
        self.success: Tally = Tally()  # finish reason -> requests
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []

    def arrived(self, seq) -> None:
        now = time.time()
        self.prompt_tokens += seq.num_prompt_tokens
        for sample in seq.samples:
            self.times[sample.seq_id] = RequestMetrics(now)

    def scheduled(self, scheduler, batch) -> None:
        now = None
        for seq in batch.seqs:
            m = self.times.get(seq.seq_id)
            if m is not None and m.first_scheduled_time is None:
                now = now or time.time()
                m.first_scheduled_time = now

    def observe(self, outputs) -> None:
        """A step's outputs (core/lifecycle.py's StepOutputs) arrived."""
        now = time.time()
        for o in outputs:
            m = self.times.get(o.seq.seq_id)
            if m is None or not o.new_token_ids:
                continue
            if m.first_token_time is None:
                m.first_token_time = now
                self.ttft.append(now - m.arrival_time)
            else:
                self.itl.append(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += len(o.new_token_ids)
            self.generation_tokens += len(o.new_token_ids)
            if o.finished:
                m.finished_time = now
                self.e2e.append(now - m.arrival_time)
                self.success[o.finish_reason or "abort"] += 1

    def request_metrics(self, seq) -> RequestMetrics | None:
        """A finished request's times (sample 0's), forgetting every sample's."""
        for sample in seq.samples[1:]:
            self.times.pop(sample.seq_id, None)
        return self.times.pop(seq.seq_id, None)

    def metrics(self) -> list[Metric]:
        kv = self.engine.kv_usage()
        return [Gauge("vllm:num_requests_running", {}, len(self.engine.scheduler.running)),
                Gauge("vllm:num_requests_waiting", {}, len(self.engine.scheduler.waiting)),
                Gauge("vllm:kv_cache_usage_perc", {}, kv.used_blocks / max(kv.num_blocks, 1)),
                Counter("vllm:prompt_tokens", {}, self.prompt_tokens),
                Counter("vllm:generation_tokens", {}, self.generation_tokens),
                *(Counter("vllm:request_success", {"finished_reason": r}, n) for r, n in sorted(self.success.items())),
                Histogram.of("vllm:time_to_first_token_seconds", TTFT_BUCKETS, self.ttft),
                Histogram.of("vllm:inter_token_latency_seconds", ITL_BUCKETS, self.itl),
                Histogram.of("vllm:e2e_request_latency_seconds", E2E_BUCKETS, self.e2e),
                *self.speculation_metrics()]

    def speculation_metrics(self) -> list[Metric]:
        """vLLM's spec_decode counters, with speculative_config on (none otherwise)."""
        c = draft_counts(self.engine.scheduler)
        if c is None:
            return []
        return [Counter("vllm:spec_decode_num_drafts", {}, c.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, c.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, c.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(c.accepted_per_position))]
