"""The launch-gap analysis of ``python -m benchmarks.profiling gaps`` on a hand-built chrome
trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.profiling import gaps as trace_gaps


def x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_gaps_are_found_and_attributed(tmp_path: Path) -> None:
    events = [
        x("python_function", "vllm/worker/model_runner.py(10): launch", 0, 400),
        x("python_function", "vllm/worker/model_runner.py(20): _prefill", 5, 390),
        x("python_function", "torch/nn/modules/module.py(1): _call_impl", 6, 100),
        x("cpu_op", "aten::mm", 10, 20),
        x("cuda_runtime", "cudaLaunchKernel", 12, 5, correlation=1),
        x("kernel", "gemm", 20, 50, correlation=1),  # busy 20-70
        x("kernel", "overlapping", 60, 30, correlation=9),  # busy to 90, no gap
        x("cpu_op", "aten::add", 200, 10),
        x("cuda_runtime", "cudaLaunchKernel", 202, 5, correlation=2),
        x("kernel", "add", 210, 10, correlation=2),  # gap 90 -> 210 (120 us)
        x("kernel", "tail", 223, 7, correlation=3),  # gap 3 us: below the threshold
        {"ph": "i", "cat": "instant", "name": "ignored", "ts": 500},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    g = trace_gaps.gpu_gaps(path, min_gap_us=5.0)
    assert g["gaps"] == 1
    assert g["gap_ms"] == pytest.approx(0.120)
    assert g["gpu_busy_ms"] == pytest.approx((70 + 10 + 7) / 1e3)  # 20-90, 210-220, 223-230
    assert g["lead_ms"] == pytest.approx(0.010)  # first operator at 10 us, first kernel at 20
    top = g["top"][0]
    assert top["kernel"] == "add" and top["gap_us"] == pytest.approx(120)
    assert top["launch_to_start_us"] == pytest.approx(8)
    assert top["op"] == "aten::add"
    assert top["frame"] == "vllm/worker/model_runner.py(20): _prefill"


def test_kernel_tables_split_graph_and_eager(tmp_path: Path) -> None:
    events = [
        x("cuda_runtime", "cudaGraphLaunch", 0, 50, correlation=1),
        x("kernel", "attn", 60, 300, correlation=1),
        x("kernel", "attn", 360, 300, correlation=1),
        x("kernel", "gemm", 660, 100, correlation=1),
        x("cuda_runtime", "cudaLaunchKernel", 100, 5, correlation=2),
        x("kernel", "gemm", 760, 40, correlation=2),
        x("cuda_driver", "cuLaunchKernelEx", 110, 5, correlation=3),
        x("kernel", "rms", 800, 5, correlation=3),
        x("gpu_memcpy", "Memcpy HtoD", 805, 2),  # no launch record: eager
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = trace_gaps.kernel_tables(path)
    assert t["graph"] == [("attn", 2, 600.0), ("gemm", 1, 100.0)]
    assert t["eager"] == [("gemm", 1, 40.0), ("rms", 1, 5.0), ("Memcpy HtoD", 1, 2.0)]
