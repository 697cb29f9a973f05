"""Prometheus metrics under vLLM's names, one ``CollectorRegistry`` per app.

Everything about requests and steps is counted by the engine itself (``vllm/engine/stats.py``
defines each metric), so a streamed request counts exactly as a non-streamed one; it is read,
with the engine's gauges (running / waiting requests, KV-cache usage), its own counters
(preemptions, CUDA-graph replays, eager decode steps) and ``vllm:cache_config_info``, from
``engine.stats()`` at scrape time, so nothing is ever stale. Every engine series carries the
``model_name`` label (the first served model name). The app's HTTP traffic is counted by
``http_metrics.HTTPMetricsMiddleware`` under prometheus-fastapi-instrumentator's names, as
vLLM exposes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from vllm.entrypoints.openai.http_metrics import HTTPMetrics
from vllm.logger import init_logger

logger = init_logger(__name__)

# vLLM leaves the *_created series out.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# (name, documentation, key in engine.stats()) of the engine's own counters.
_ENGINE_COUNTERS = (
    (
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
        "num_preemptions",
    ),
    ("vllm:eager_decode_steps", "Decode steps run eagerly (no CUDA graph).", "eager_decode_steps"),
    (
        "vllm:images_encoded_ahead",
        "Requests whose images were encoded over several steps before their prefill.",
        "images_encoded_ahead",
    ),
    (
        "vllm:encoder_steps",
        "Steps that advanced an image encoding spread over steps.",
        "encoder_steps",
    ),
    (
        "vllm:prefix_cache_queries",
        "Prefix-cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix-cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    (
        "vllm:cross_cache_queries",
        "Lookups of an image group's cross-attention KV in the prefix cache.",
        "cross_cache_queries",
    ),
    (
        "vllm:cross_cache_hits",
        "Lookups of an image group's cross-attention KV that found it (no vision tower, no "
        "K/V projection).",
        "cross_cache_hits",
    ),
    (
        "vllm:prefill_chunks",
        "Prefill chunks that did not end their prompt (chunked prefill).",
        "prefill_chunks",
    ),
    (
        "vllm:row_chunks",
        "Prefill chunks run as rows of the step's decode graph instead of an eager forward.",
        "row_chunks",
    ),
)


class _EngineCollector(Collector):
    """Reads the engine's live state and statistics at scrape time."""

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
        except Exception:  # a racing engine update or a dead engine: skip this scrape's series
            logger.debug("engine.stats() failed during a scrape", exc_info=True)
            return
        yield from self._gauges(stats)
        for name, doc, key in _ENGINE_COUNTERS:
            yield self._counter(name, doc, stats.get(key, 0))
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
        yield from self._requests(stats.get("requests"))
        cache = stats.get("cache_config")
        if cache:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=sorted(cache),
            )
            info.add_metric([str(cache[k]) for k in sorted(cache)], 1)
            yield info

    def _gauges(self, stats: dict[str, Any]) -> Iterator[Metric]:
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

    def _requests(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        """Token counters, request outcomes and the latency and size histograms."""
        if snap is None:
            return
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", snap["prompt_tokens"]
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            snap["generation_tokens"],
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(snap["request_success"].items()):
            success.add_metric([self.model_name, reason], count)
        yield success
        for name, (doc, buckets, total) in snap["histograms"].items():
            family = HistogramMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], buckets, sum_value=total)
            yield family


class ServerMetrics:
    """The app's registry: the engine's series and the app's HTTP metrics."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.http = HTTPMetrics(self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
