"""Serving-benchmark math: per-request timings, aggregate metrics, request arrival times.

Definitions (vLLM's, in milliseconds in the report):

* **TTFT**: request sent -> first streamed chunk that carries output (text or a finish).
* **ITL**: the gaps between successive output chunks of a request, pooled over requests.
* **E2EL**: request sent -> end of the stream.
* **TPOT**: ``(E2EL - TTFT) / (output_tokens - 1)`` per request with more than one output
  token, where ``output_tokens`` is the server's ``usage.completion_tokens``.

Throughputs divide by the benchmark's wall time (first dispatch to last completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``itl`` has one gap per chunk after the
    first."""

    success: bool = False
    prompt_len: int = 0  # usage.prompt_tokens (0 when the server sent no usage)
    output_tokens: int = 0  # usage.completion_tokens (or the chunk count without usage)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    generated_text: str = ""
    error: str = ""
    num_images: int = 0
    send_time: float = 0.0  # time.perf_counter() when the request was sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None for one-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def timings_from_chunks(
    start: float, chunk_times: Sequence[float], end: float
) -> tuple[float, list[float], float]:
    """``(ttft, itl, e2el)`` from the send time, the arrival times of the output chunks and
    the end of the stream (all ``time.perf_counter()`` seconds)."""
    if not chunk_times:
        raise ValueError("no output chunk arrived")
    ttft = chunk_times[0] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return ttft, itl, max(end, chunk_times[-1]) - start


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Dispatch offsets in seconds from the start: the first request at 0, then gaps drawn from
    a gamma distribution with mean ``1 / request_rate`` and shape ``burstiness`` (1 = Poisson
    arrivals; lower is burstier, higher is more regular). ``inf`` sends everything at 0."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate == float("inf") or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1
    )
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each must be in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: cannot parse {text!r}") from None
    bad = [p for p in values if not 0 < p <= 100]
    if bad or not values:
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot"`` -> names, checked against ttft/tpot/itl/e2el."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(
            f"--percentile-metrics: unknown {bad or text!r}; choose from {','.join(METRICS)}"
        )
    return names


def _pct_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    metric_percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """Aggregates the requests into vLLM's result fields (times in ms).

    Every metric gets mean/median/std; the ones in ``percentile_metrics`` also get
    ``p{P}_{metric}_ms`` for each P. Failed requests count only in ``failed``."""
    ok = [r for r in results if r.success]
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    for name in METRICS:
        values_ms = np.asarray(samples[name], dtype=np.float64) * 1000.0
        empty = values_ms.size == 0
        out[f"mean_{name}_ms"] = 0.0 if empty else float(values_ms.mean())
        out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(values_ms))
        out[f"std_{name}_ms"] = 0.0 if empty else float(values_ms.std())
        if name in percentile_metrics:
            for p in metric_percentiles:
                out[f"p{_pct_word(p)}_{name}_ms"] = (
                    0.0 if empty else float(np.percentile(values_ms, p))
                )
    return out


METRIC_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_report(
    m: dict[str, Any],
    percentile_metrics: Sequence[str],
    metric_percentiles: Sequence[float],
    max_concurrency: int | None,
    request_rate: float,
) -> str:
    """The printed summary table."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Maximum request concurrency:", max_concurrency),
        ("Request rate (req/s):", request_rate),
        ("Benchmark duration (s):", m["duration"]),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", m["request_throughput"]),
        ("Output token throughput (tok/s):", m["output_throughput"]),
        ("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [_row(k, v) for k, v in rows]
    for name in percentile_metrics:
        lines.append("{s:{c}^60}".format(s=f" {METRIC_HEADERS[name]} ", c="-"))
        lines.append(_row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"]))
        for p in metric_percentiles:
            word = _pct_word(p)
            lines.append(_row(f"P{word} {name.upper()} (ms):", m[f"p{word}_{name}_ms"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40}{value:<20.2f}"
    return f"{label:<40}{value!s:<20}"
