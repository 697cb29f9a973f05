"""What the engine counts as it runs, under vLLM's (V0) metric names: tokens and steps, the
timing of every request, and its parameters. ``/metrics`` reads a snapshot at scrape time.

Everything is recorded where it happens (the output processor, on the engine thread), so it
holds for every request alike: streamed or not, online or offline. The definitions:

- ``prompt_tokens`` / ``generation_tokens``: tokens a prefill step computed, tokens appended
  to outputs (a token sampled for a sequence that had already finished is not one).
- ``iteration_tokens_total``: per step, its prompt tokens plus the tokens it generated.
- ``time_to_first_token_seconds``: arrival to the first output (the prefill's results).
- ``time_per_output_token_seconds``: per request and step after its first, the time since the
  request's previous tokens (vLLM V0's inter-token latency).
- per finished request (not aborted or failed), with its arrival A, first scheduling S, first
  token F and end E: ``e2e_request_latency`` E - A, ``request_queue_time`` S - A,
  ``request_prefill_time`` F - S, ``request_decode_time`` E - F,
  ``request_inference_time`` E - S; its prompt and generated token counts (all sequences, and
  the longest), ``n`` and ``max_tokens``; one ``request_success`` per sequence and reason.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

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
N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1-2-5 buckets up to ``max_value`` (vLLM's token-count histograms)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exp += 1


def step_token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1, 8, then powers of two up to the step's token budget (``iteration_tokens``)."""
    out, value = [1.0, 8.0], 16
    while value < max_tokens:
        out.append(float(value))
        value *= 2
    out.append(float(max_tokens))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram's name (without the ``vllm:`` prefix), documentation and buckets."""

    name: str
    documentation: str
    buckets: tuple[float, ...]


def histogram_specs(max_model_len: int, max_num_batched_tokens: int) -> list[HistogramSpec]:
    tokens = token_buckets(max_model_len)
    return [
        HistogramSpec(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            step_token_buckets(max_num_batched_tokens),
        ),
        HistogramSpec(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ),
        HistogramSpec(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TPOT_BUCKETS,
        ),
        HistogramSpec(
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            LATENCY_BUCKETS,
        ),
        HistogramSpec(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        ),
        HistogramSpec(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        ),
        HistogramSpec(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        ),
        HistogramSpec(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        ),
        HistogramSpec("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
        HistogramSpec(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        ),
        HistogramSpec(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        ),
        HistogramSpec("request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
        HistogramSpec(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        ),
    ]


@dataclass
class Histogram:
    """Counts per bucket (the last one is +Inf), their sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' ``le`` buckets: (upper bound, observations at or below it)."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


@dataclass(frozen=True)
class FinishedRequest:
    """What a finished request contributes (times in ``time.time()`` seconds)."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    generated: list[int]  # output tokens of each sequence
    finish_reasons: list[str]  # of the sequences that were not aborted
    n: int
    max_tokens: int | None


class EngineStats:
    """The engine's counters and histograms; written by the engine thread, read by scrapes
    (``snapshot``) from any thread."""

    def __init__(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        self._lock = threading.Lock()
        self.specs = histogram_specs(max_model_len, max_num_batched_tokens)
        self.reset()

    def reset(self) -> None:
        """Back to zero: the start-up warm-up's synthetic requests are not served traffic
        (called before anything has been scraped, so the series stay monotonic)."""
        with self._lock:
            self._hist = {s.name: Histogram(s.buckets) for s in self.specs}
            self.prompt_tokens = 0
            self.generation_tokens = 0
            self.request_success: Counter[str] = Counter()

    def record_step(
        self,
        prompt_tokens: int,
        generated: int,
        first_tokens: list[float],
        inter_token: list[float],
    ) -> None:
        """One collected step: its token counts, time-to-first-token of the requests it
        started, time since the previous tokens of the others."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            if prompt_tokens or generated:
                self._hist["iteration_tokens_total"].observe(prompt_tokens + generated)
            for value in first_tokens:
                self._hist["time_to_first_token_seconds"].observe(value)
            for value in inter_token:
                self._hist["time_per_output_token_seconds"].observe(value)

    def record_finished(self, r: FinishedRequest) -> None:
        h = self._hist
        with self._lock:
            h["e2e_request_latency_seconds"].observe(max(0.0, r.finished - r.arrival))
            if r.scheduled is not None and r.first_token is not None:
                h["request_queue_time_seconds"].observe(max(0.0, r.scheduled - r.arrival))
                h["request_prefill_time_seconds"].observe(max(0.0, r.first_token - r.scheduled))
                h["request_decode_time_seconds"].observe(max(0.0, r.finished - r.first_token))
                h["request_inference_time_seconds"].observe(max(0.0, r.finished - r.scheduled))
            h["request_prompt_tokens"].observe(r.prompt_tokens)
            h["request_generation_tokens"].observe(sum(r.generated))
            h["request_max_num_generation_tokens"].observe(max(r.generated, default=0))
            h["request_params_n"].observe(r.n)
            if r.max_tokens is not None:
                h["request_params_max_tokens"].observe(r.max_tokens)
            self.request_success.update(r.finish_reasons)

    def snapshot(self) -> dict[str, Any]:
        """Copies of every value, consistent with each other."""
        with self._lock:
            return {
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "request_success": dict(self.request_success),
                "histograms": {
                    s.name: (
                        s.documentation,
                        self._hist[s.name].cumulative(),
                        self._hist[s.name].total,
                    )
                    for s in self.specs
                },
            }
