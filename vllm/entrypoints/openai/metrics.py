"""Prometheus metrics under vLLM's names, one ``CollectorRegistry`` per app.

Request counters and latency histograms are updated by the handlers when a request finishes;
the engine's gauges (running / waiting requests, KV-cache usage) and its own counters
(preemptions, CUDA-graph replays, eager decode steps) are read from ``engine.stats()`` at
scrape time, so they are never stale. Every series carries the ``model_name`` label (the first
served model name).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm.logger import init_logger
from vllm.outputs import RequestOutput

logger = init_logger(__name__)

# vLLM leaves the *_created series out.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to max_model_len (vLLM's token-count histograms)."""
    out, mantissa, exp = [], [1, 2, 5], 0
    while True:
        for m in mantissa:
            value = m * 10**exp
            if value > max_model_len:
                return out
            out.append(float(value))
        exp += 1


class _EngineCollector(Collector):
    """Reads the engine's live state at scrape time."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # a racing engine update or a dead engine: skip this scrape's gauges
            logger.debug("engine.stats() failed during a scrape", exc_info=True)
            return
        usage = float(stats.get("kv_cache_usage", 0.0))
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.get("num_running", 0),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.get("num_waiting", 0),
        )
        yield self._gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent "
            "usage (deprecated name of vllm:kv_cache_usage_perc).",
            usage,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            stats.get("num_preemptions", 0),
        )
        yield self._counter(
            "vllm:eager_decode_steps",
            "Decode steps run eagerly (no CUDA graph).",
            stats.get("eager_decode_steps", 0),
        )
        yield self._counter(
            "vllm:images_encoded_ahead",
            "Requests whose images were encoded over decode steps before their prefill.",
            stats.get("images_encoded_ahead", 0),
        )
        yield self._counter(
            "vllm:encoder_steps",
            "Steps that also advanced an image encoding (interleaved prefill).",
            stats.get("encoder_steps", 0),
        )
        replays = CounterMetricFamily(
            "vllm:cuda_graph_replays",
            "Decode CUDA-graph replays per graph family and batch bucket.",
            labels=["model_name", "family", "bucket"],
        )
        for (family, bucket), count in sorted(
            stats.get("graph_replays", {}).items(), key=lambda kv: (str(kv[0][0]), kv[0][1])
        ):
            replays.add_metric([self.model_name, str(family), str(bucket)], count)
        yield replays


class ServerMetrics:
    """The app's registry and the series updated from finished requests."""

    def __init__(self, engine: Any, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent waiting in the queue in seconds.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=token_buckets,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=token_buckets,
            registry=reg,
        )
        reg.register(_EngineCollector(engine, model_name))

    def observe_finished(self, out: RequestOutput) -> None:
        """Counts a finished request (called once, with its final output)."""
        name = self.model_name
        num_prompt = len(out.prompt_token_ids)
        num_generated = [len(c.token_ids) for c in out.outputs]
        self.prompt_tokens.labels(name).inc(num_prompt)
        self.generation_tokens.labels(name).inc(sum(num_generated))
        self.request_prompt_tokens.labels(name).observe(num_prompt)
        self.request_generation_tokens.labels(name).observe(sum(num_generated))
        for c in out.outputs:
            if c.finish_reason is not None:
                self.request_success.labels(name, c.finish_reason).inc()
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(name).observe(max(0.0, m.finished_time - m.arrival_time))
        most = max(num_generated, default=0)
        if most > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.labels(name).observe(
                max(0.0, (m.last_token_time - m.first_token_time) / (most - 1))
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)
