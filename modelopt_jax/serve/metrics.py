"""``GET /metrics``: the server's state and latencies in Prometheus' text format (prometheus_client).

Names follow vLLM's (``vllm:`` -> ``modelopt_jax:``), so dashboards carry over. The engine's gauges
(running, waiting, KV usage, prefix-cache hits) are read from the last step's
:class:`~.core_protocol.EngineGauges` when scraped; token counts and latencies are measured here,
on the frontend, from the deltas each client is sent (what a client sees, transport included).
Each server has its own registry, so two apps in one process never share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _EngineCollector:
    """The engine's gauges at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        g = self.engine.gauges
        yield GaugeMetricFamily("modelopt_jax:num_requests_running", "Requests being generated (engine sequences).",
                                value=g.running if g else 0)
        yield GaugeMetricFamily("modelopt_jax:num_requests_waiting", "Requests waiting for admission.",
                                value=g.waiting if g else 0)
        yield GaugeMetricFamily("modelopt_jax:kv_cache_usage_perc", "Fraction of KV-cache pages held (1 = full).",
                                value=g.kv_cache_usage if g else 0.0)
        yield CounterMetricFamily("modelopt_jax:prefix_cache_hits", "Prompt tokens taken from the prefix cache.",
                                  value=g.prefix_cache_hit_tokens if g else 0)
        yield CounterMetricFamily("modelopt_jax:num_preemptions", "Sequences preempted (recomputed later).",
                                  value=g.preemptions if g else 0)


class ServerMetrics:
    """The registry of one server; :meth:`request` times one HTTP request's generation."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.prompt_tokens = Counter("modelopt_jax:prompt_tokens", "Prompt tokens of finished and running requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("modelopt_jax:generation_tokens", "Tokens generated and sent to clients.",
                                         registry=self.registry)
        self.request_success = Counter("modelopt_jax:request_success", "Sequences finished, by reason.",
                                       ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("modelopt_jax:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("modelopt_jax:inter_token_latency_seconds", "Between two tokens of one sequence.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("modelopt_jax:e2e_request_latency_seconds", "Arrival to the last token of a request.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def request(self, sequences: int, prompt_tokens: int, arrival: float) -> "RequestTimer":
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self, sequences, arrival)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one HTTP request's sequences, from the deltas its client is sent."""

    def __init__(self, metrics: ServerMetrics, sequences: int, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: list[float | None] = [None] * sequences   # time of each sequence's latest token
        self.first_token: float | None = None
        self.tokens = 0

    def delta(self, index: int, tokens: int, finish_reason: str | None) -> None:
        now = time.perf_counter()
        if tokens:
            self.tokens += tokens
            self.metrics.generation_tokens.inc(tokens)
            previous = self.last[index]
            if previous is None:
                if self.first_token is None:
                    self.first_token = now
                    self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe((now - previous) / tokens)
            self.last[index] = now
        if finish_reason is not None:
            self.metrics.request_success.labels(finish_reason).inc()

    def finished(self) -> float:
        """Observes and returns the request's end-to-end latency (seconds)."""
        e2e = time.perf_counter() - self.arrival
        self.metrics.e2e.observe(e2e)
        return e2e
