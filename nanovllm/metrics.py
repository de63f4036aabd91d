"""The engine's metrics as vLLM's offline API reads them (`LLM.get_metrics()`, vLLM's
`vllm.v1.metrics.reader`): Counter, Gauge, Histogram and Vector objects under the names the
server exports to Prometheus (serve/metrics.py, same buckets), and `RequestOutput.metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field

# Histogram buckets (seconds), vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    """`buckets`: upper bound (as a string, "+Inf" last) -> how many observations are at most it."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, bounds: tuple[float, ...], values: list[float], labels: dict | None = None) -> "Histogram":
        buckets = {str(b): sum(v <= b for v in values) for b in bounds}
        buckets["+Inf"] = len(values)
        return cls(name, labels or {}, len(values), float(sum(values)), buckets)


@dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and its last token, and
    finished (time.time(); None until it happens); vLLM's names."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time
