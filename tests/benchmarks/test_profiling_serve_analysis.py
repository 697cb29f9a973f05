"""``python -m benchmarks.profiling analyze`` on a hand-built result and step trace: chunk
times are rebuilt from send time + TTFT + ITLs, one engine stall shows up as one burst spanning
the slow step, and compiles during the load are listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.profiling import serve_analysis as analyze


def _case():
    # Two streams sent at t=100 s, tokens every 10 ms, except one 60 ms step at 100.3 s.
    steps, t = [], 100.0
    while t < 100.6:
        dur = 0.06 if abs(t - 100.3) < 1e-6 else 0.01
        steps.append([t, t + dur, 2, 0, 0, 1 if dur > 0.05 else 0, 0, 2])
        t = round(t + dur, 6)
    ends = [s[1] for s in steps]
    result = {"send_times": [100.0, 100.0], "ttfts": [ends[0] - 100.0] * 2,
              "itls": [[b - a for a, b in zip(ends, ends[1:], strict=False)]] * 2}
    trace = {"steps": steps, "events": [["jit", 99.0, 99.5, "early_kernel[...]"],
                                        ["jit", 100.3, 100.35, "late_kernel[...]"]]}
    return result, trace


def test_one_stall_is_one_burst() -> None:
    result, trace = _case()
    chunks = analyze.chunk_times(result)
    assert len(chunks) == 2 * (len(trace["steps"]) - 1)
    groups = analyze.bursts(chunks, threshold_ms=20)
    assert len(groups) == 1 and len(groups[0]) == 2
    assert groups[0][0][1] == pytest.approx(60.0)
    lines = analyze.report(result, trace, threshold_ms=20)
    assert "JIT compiles during the load: 1" in lines
    assert any("late_kernel" in s for s in lines) and not any("early_kernel" in s for s in lines)
    burst = next(s for s in lines if "ITLs up to" in s)
    assert "60.0-P-" in burst  # the slow step, flagged as a spread-prefill step


def test_launch_and_collect_columns() -> None:
    result, trace = _case()
    for row in trace["steps"]:  # the slow step spent 50 ms launching (a host stall)
        row += [0.05 if row[1] - row[0] > 0.05 else 0.001, 0.004]
    burst = next(s for s in analyze.report(result, trace, 20) if "ITLs up to" in s)
    assert "60.0-P-(r2 w0 L50.0 C4.0)" in burst


def test_admitted_tokens_and_allocator_columns() -> None:
    result, trace = _case()
    for row in trace["steps"]:
        slow = row[1] - row[0] > 0.05
        row += [0.001, 0.004, 300 if slow else 0, 2 if slow else 0, 0, 1 if slow else 0]
    lines = analyze.report(result, trace, 20)
    burst = next(s for s in lines if "ITLs up to" in s)
    assert "60.0-P-(r2 w0 L1.0 C4.0 A300 M2/F0/R1)" in burst
    assert "0.0 A" not in burst and "M0" not in burst  # quiet steps show neither


def test_by_length_splits_first_seen_from_repeated_lengths() -> None:
    # One stream decoding every 10 ms from t=0 with a 60 ms stall ending at 0.50 s; three
    # other requests' first tokens: 0.55 s (new length, the stall 50 ms before it), 1.0 s
    # (the same length again) and 1.5 s (new length, no stall before it).
    itls = [0.01] * 44 + [0.06] + [0.01] * 100
    result = {"send_times": [0.0, 0.0, 0.0, 0.0], "ttfts": [0.01, 0.55, 1.0, 1.5],
              "itls": [itls, [], [], []], "input_lens": [7, 200, 200, 300],
              "num_images": [0, 1, 1, 1]}
    lines = analyze.by_length(result, threshold_ms=20)
    assert "(3 distinct (length, images) of 4)" in lines[0]
    assert "first of its length: 3 requests, 1 above 20 ms" in lines[1]
    assert "repeated length: 1 requests, 0 above 20 ms" in lines[2]


def test_slow_host_calls_listed_and_tied_to_bursts() -> None:
    result, trace = _case()
    trace["events"] += [["slow", 100.305, 100.34, "scaled_dot_product_attention (1, 32, 201)"],
                        ["slow", 99.0, 99.1, "linear before the load"]]
    lines = analyze.report(result, trace, 20)
    assert "host calls over 1 ms during the load: 1 (35.0 ms), longest:" in lines
    burst = next(s for s in lines if "ITLs up to" in s)
    assert burst.endswith("| slow calls 35.0 ms: scaled_dot_product_attention")


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result, trace = _case()
    paths = [tmp_path / "result.json", tmp_path / "trace.json"]
    for path, obj in zip(paths, (result, trace), strict=True):
        path.write_text(json.dumps(obj))
    analyze.main([str(p) for p in paths] + ["--threshold-ms", "20"])
    out = capsys.readouterr().out
    assert "2 ITLs > 20 ms in 1 bursts" in out and "JIT compiles during the load: 1" in out
    with pytest.raises(SystemExit):  # neither a trace nor --by-length
        analyze.main([str(paths[0])])
