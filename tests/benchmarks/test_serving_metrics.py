"""The serving benchmark's pure parts: metric math, flag parsing, arrival times, dataset."""

from __future__ import annotations

import math

import pytest

from vllm.entrypoints.cli.benchmark.serve_client import build_payload, synthetic_dataset
from vllm.entrypoints.cli.benchmark.serve_metrics import (
    RequestResult,
    arrival_times,
    calculate_metrics,
    parse_metric_names,
    parse_percentiles,
    timings_from_chunks,
)


def test_timings_from_chunks() -> None:
    ttft, itl, e2el = timings_from_chunks(10.0, [10.5, 10.7, 11.0], 11.1)
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.2, 0.3])
    assert e2el == pytest.approx(1.1)
    with pytest.raises(ValueError):
        timings_from_chunks(0.0, [], 1.0)


def test_calculate_metrics() -> None:
    results = [
        RequestResult(
            success=True,
            prompt_len=10,
            output_tokens=5,
            ttft=0.1,
            itl=[0.1, 0.1, 0.1, 0.1],
            latency=0.5,
        ),
        RequestResult(
            success=True, prompt_len=20, output_tokens=3, ttft=0.3, itl=[0.2, 0.4], latency=0.9
        ),
        RequestResult(success=True, prompt_len=5, output_tokens=1, ttft=0.2, latency=0.2),
        RequestResult(success=False, error="HTTP 500"),
    ]
    m = calculate_metrics(
        results,
        duration=2.0,
        percentile_metrics=["ttft", "tpot", "itl"],
        metric_percentiles=[50, 99.9],
    )
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (0.5-0.1)/4 = 100 ms and (0.9-0.3)/2 = 300 ms; the one-token request has none.
    assert m["mean_tpot_ms"] == pytest.approx(200.0)
    assert m["p50_tpot_ms"] == pytest.approx(200.0)
    # ITL pools every gap: 0.1 x4, 0.2, 0.4.
    assert m["mean_itl_ms"] == pytest.approx(1000 * 1.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99.9_itl_ms"] == pytest.approx(400.0, rel=1e-2)
    assert m["mean_e2el_ms"] == pytest.approx(1000 * 1.6 / 3)
    assert "p99.9_e2el_ms" not in m  # e2el was not asked for percentiles
    empty = calculate_metrics([RequestResult()], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] == 0.0


def test_parse_metric_flags() -> None:
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    for bad in ("0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="percentile-metrics"):
        parse_metric_names("ttft,latency")


def test_arrival_times_are_seeded_poisson() -> None:
    a = arrival_times(2000, request_rate=4.0, seed=7)
    assert a == arrival_times(2000, request_rate=4.0, seed=7)
    assert a != arrival_times(2000, request_rate=4.0, seed=8)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.1)
    # Exponential gaps: the standard deviation equals the mean.
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.15)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0)


def test_synthetic_dataset_is_seeded_and_mixed() -> None:
    a = synthetic_dataset(8, 12, 5, image_ratio=0.5, num_images=1, image_size=24, seed=3)
    # A length range leaves the fixed-length requests' images and choices alone.
    c = synthetic_dataset(40, 12, 5, image_ratio=0.5, num_images=0, image_size=24, seed=3,
                          range_ratio=0.5)
    assert all(6 <= r.num_words <= 18 for r in c) and len({r.num_words for r in c}) > 5
    assert [len(r.prompt.split(": ", 1)[1].split()) for r in c] == [r.num_words for r in c]
    same = synthetic_dataset(40, 12, 5, image_ratio=0.5, num_images=0, image_size=24, seed=3,
                             range_ratio=0.5)
    assert [r.prompt for r in same] == [r.prompt for r in c]
    with pytest.raises(ValueError, match="range_ratio"):
        synthetic_dataset(2, 12, 5, image_ratio=0, num_images=0, image_size=24, seed=3,
                          range_ratio=1.0)
    b = synthetic_dataset(8, 12, 5, image_ratio=0.5, num_images=1, image_size=24, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.image_urls for r in a] == [r.image_urls for r in b]
    assert sum(1 for r in a if r.image_urls) == 4
    assert all(u.startswith("data:image/jpeg;base64,") for r in a for u in r.image_urls)
    chat = build_payload(a[0], "/v1/chat/completions", "m", ignore_eos=True)
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] is True
    text_req = next(r for r in a if not r.image_urls)
    assert build_payload(text_req, "/v1/completions", "m", True)["prompt"] == text_req.prompt
    with pytest.raises(ValueError, match="text only"):
        build_payload(next(r for r in a if r.image_urls), "/v1/completions", "m", True)


def test_sweep_plot_draws_every_series(tmp_path) -> None:
    """Each panel of the sweep PNG holds its series' colour, at heights that follow the
    values (the p99 line is above the median line where it is larger)."""
    from PIL import Image

    from vllm.entrypoints.cli.benchmark.sweep_plot import COLOURS, HEIGHT, WIDTH, plot_sweep

    runs = [{"request_rate": r, "median_ttft_ms": 10.0 * i + 5, "p99_ttft_ms": 40.0 * i + 20,
             "median_itl_ms": 7.0, "p99_itl_ms": 9.0 + i, "output_throughput": 100.0 * (i + 1)}
            for i, r in enumerate([1.0, 2.0, 4.0, "inf"])]
    path = plot_sweep(runs, tmp_path / "s.png")
    with Image.open(path) as png:
        img = png.convert("RGB")
    assert img.size == (3 * WIDTH, HEIGHT)

    def rows_of(colour, panel):
        return [y for x in range(panel * WIDTH, (panel + 1) * WIDTH) for y in range(HEIGHT)
                if img.getpixel((x, y)) == colour]

    for panel in range(3):
        assert rows_of(COLOURS[0], panel)
    median, p99 = rows_of(COLOURS[0], 0), rows_of(COLOURS[1], 0)
    assert p99 and min(p99) < min(median)  # higher values are drawn higher up


def test_serving_table_checks_the_targets(tmp_path) -> None:
    """tools/serving_table.py: throughput against prefill-first of the same workload, the ITL
    ratio and the eager decode steps counted from the /metrics snapshots around each run."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "serving_table", Path(__file__).resolve().parents[2] / "tools" / "serving_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def run(tag, tok_s, itl50, itl99, eager_after):
        (tmp_path / f"{tag}.json").write_text(json.dumps({
            "completed": 10, "output_throughput": tok_s, "median_ttft_ms": 200.0,
            "p99_ttft_ms": 900.0, "median_itl_ms": itl50, "p99_itl_ms": itl99}))
        metrics = ('vllm:cuda_graph_replays_total{{family="text",bucket="8"}} {}\n'
                   "vllm:eager_decode_steps_total {}\n")
        (tmp_path / f"{tag}.metrics.before.txt").write_text(metrics.format(5, 1))
        (tmp_path / f"{tag}.metrics.txt").write_text(metrics.format(105, 1 + eager_after))

    run("w1_prefill_first", 1000.0, 7.0, 350.0, 0)
    run("w1_chunked", 960.0, 12.0, 30.0, 0)
    run("w1_budget256", 900.0, 10.0, 40.0, 2)
    text = table.main(tmp_path)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "serving_summary.json")
                                                .read_text())["runs"]}
    assert rows["chunked"]["targets"] == {"1_throughput": True, "2_itl": True, "3_ttft": True,
                                          "4_graphs": True}
    assert rows["chunked"]["graph_replays"] == 100
    assert rows["budget256"]["targets"]["1_throughput"] is False  # 90% of prefill-first
    assert rows["budget256"]["targets"]["2_itl"] is False  # 4x the median
    assert rows["budget256"]["eager_decode_steps"] == 2
    assert rows["prefill_first"]["targets"]["2_itl"] is False
    assert "| w1 | chunked | 960 | 96% |" in text
