"""Where the GPU waits during a one-image prefill (CUDA only).

    python -m benchmarks.profiling gaps --out /tmp/gaps

1. Traces the time to first token of one 4-tile image + 128 tokens (torch.profiler, Python
   stacks on), writes ``ttft_trace.json`` and lists the GPU idle gaps inside it: when each gap
   starts, how long it is, the kernel that ends it, how long after its launch call that kernel
   ran, and the innermost ``vllm/`` Python frame that launched it. A kernel that starts right
   after its launch call ends a host-bound gap. The same without Python stacks (which slow the
   host several-fold), totals only.
2. GPU time by kernel of that prefill, split into what the vision graph replays and what is
   launched eagerly.
3. Runs the same request with ``torch.cuda.set_sync_debug_mode("warn")`` and lists the
   synchronising calls it makes, by source line.
4. CUDA runtime calls and operators per bs=1 decode step (text-only, then one image), under
   the profiler (host times without it: ``python -m benchmarks.profiling host``).

Writes ``gaps.json`` under --out and prints the findings.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import EngineView, dummy_11b, make_prompt, sync
from vllm import LLM, SamplingParams

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _inner(events: list[dict], starts: list[float], ts: float) -> dict | None:
    """The latest-starting event of ``events`` (sorted by start) that contains ``ts``: the
    innermost one where events nest."""
    i = bisect.bisect_right(starts, ts) - 1
    for e in events[max(i - 5000, 0) : i + 1][::-1]:
        if e["ts"] + e.get("dur", 0) >= ts:
            return e
    return None


def gpu_gaps(trace_path: Path, min_gap_us: float = 5.0, top: int = 20) -> dict:
    """Idle gaps of the GPU in a chrome trace, each attributed to the launch that ends it."""
    ev = json.loads(trace_path.read_text())["traceEvents"]
    gpu = sorted(
        (e for e in ev if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"]
    )
    launches = {
        e["args"]["correlation"]: e
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    py = sorted(
        (e for e in ev if e.get("cat") == "python_function" and "vllm/" in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    ops = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    py_starts, op_starts = [e["ts"] for e in py], [e["ts"] for e in ops]
    cpu_ts = [
        e["ts"]
        for e in ev
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
    ]
    window = (min(cpu_ts), max(e["ts"] + e.get("dur", 0) for e in gpu)) if gpu else (0, 0)
    busy_end, busy, gaps = gpu[0]["ts"] if gpu else 0.0, 0.0, []
    lead = (gpu[0]["ts"] - window[0]) if gpu else 0.0
    for k in gpu:
        end = k["ts"] + k.get("dur", 0)
        if k["ts"] > busy_end:
            gap = k["ts"] - busy_end
            if gap >= min_gap_us:
                launch = launches.get(k.get("args", {}).get("correlation"))
                row = {
                    "at_ms": (busy_end - window[0]) / 1e3,
                    "gap_us": gap,
                    "kernel": k["name"][:70],
                }
                if launch is not None:
                    row["launch_to_start_us"] = k["ts"] - launch["ts"]
                    row["launch_call"] = launch["name"]
                    op = _inner(ops, op_starts, launch["ts"])
                    frame = _inner(py, py_starts, launch["ts"])
                    row["op"] = op["name"] if op else None
                    row["frame"] = frame["name"] if frame else None
                gaps.append(row)
            busy += end - k["ts"]
        else:
            busy += max(0.0, end - busy_end)
        busy_end = max(busy_end, end)
    total = sum(g["gap_us"] for g in gaps)
    return {
        "window_ms": (window[1] - window[0]) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "lead_ms": lead / 1e3,
        "gaps": len(gaps),
        "gap_ms": total / 1e3,
        "top": sorted(gaps, key=lambda g: -g["gap_us"])[:top],
    }


def kernel_tables(trace_path: Path, top: int = 15) -> dict[str, list[tuple[str, int, float]]]:
    """GPU time by kernel name, split into work replayed from CUDA graphs and work launched
    eagerly: {"graph" | "eager": [(name, calls, total us)]}, largest first."""
    ev = json.loads(trace_path.read_text())["traceEvents"]
    launch_name = {
        e["args"]["correlation"]: e["name"]
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    tables: dict[str, dict[str, list]] = {"graph": {}, "eager": {}}
    for e in ev:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        via = launch_name.get(e.get("args", {}).get("correlation"), "")
        row = tables["graph" if via.startswith("cudaGraphLaunch") else "eager"].setdefault(
            e["name"][:90], [0, 0.0]
        )
        row[0] += 1
        row[1] += e.get("dur", 0)
    return {
        k: sorted(((n, c, us) for n, (c, us) in t.items()), key=lambda r: -r[2])[:top]
        for k, t in tables.items()
    }


def runtime_calls(prof, steps: int) -> list[tuple[str, float, float]]:
    """(CUDA runtime/driver call or operator, calls per step, us per step), by time."""
    rows = [
        (e.key, e.count / steps, e.cpu_time_total / steps)
        for e in prof.key_averages()
        if e.key.startswith(("cuda", "cu", "aten::")) and e.cpu_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[2])[:15]


def trace_ttft(llm: LLM, out: Path) -> dict:
    """TTFT untraced (median of 3 after a warm-up), traced with and without Python stacks,
    the gaps of both traces, the kernel tables and the synchronising calls."""
    engine, view = llm.llm_engine, EngineView(llm)
    one = SamplingParams(temperature=0, max_tokens=1)
    processed = view.process(make_prompt(llm, True, 128, 99))

    def ttft(tag: str) -> float:
        view.add_processed(tag, processed, one)
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - t0) * 1e3

    plain = [ttft(f"w{i}") for i in range(4)][1:]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        traced = ttft("traced")
        sync()
    prof.export_chrome_trace(str(out / "ttft_trace.json"))
    report = {
        "ttft_ms": plain,
        "ttft_traced_ms": traced,
        "ttft_gaps": gpu_gaps(out / "ttft_trace.json"),
        "ttft_kernels": kernel_tables(out / "ttft_trace.json"),
    }
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        report["ttft_traced_nostack_ms"] = ttft("traced2")
        sync()
    prof.export_chrome_trace(str(out / "ttft_trace_nostack.json"))
    report["ttft_gaps_nostack"] = gpu_gaps(out / "ttft_trace_nostack.json")
    (out / "ttft_trace_nostack.json").unlink()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ttft("sync")
    torch.cuda.set_sync_debug_mode("default")
    report["sync_calls"] = Counter(
        f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    ).most_common(20)
    return report


def decode_calls(llm: LLM, image: bool, steps: int = 20) -> list[tuple[str, float, float]]:
    """Runtime calls per bs=1 decode step of one request, under the profiler."""
    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    engine.add_request("decode", make_prompt(llm, image, 512, 7), params)
    for _ in range(30):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    view.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    return runtime_calls(prof, steps)


def print_report(report: dict) -> None:
    """The findings, as text."""
    g = report["ttft_gaps"]
    print(
        f"TTFT {np.median(report['ttft_ms']):.2f} ms (traced {report['ttft_traced_ms']:.2f}); "
        f"window {g['window_ms']:.2f} ms, GPU busy {g['gpu_busy_ms']:.2f} ms, first kernel "
        f"after {g['lead_ms']:.2f} ms, {g['gaps']} gaps >= 5 us = {g['gap_ms']:.2f} ms"
    )
    for r in g["top"]:
        print(
            f"  at {r['at_ms']:7.2f} ms gap {r['gap_us']:8.1f} us -> {r['kernel'][:40]:40s} "
            f"launch->start {r.get('launch_to_start_us', float('nan')):8.1f} us "
            f"{r.get('op')} | {r.get('frame')}"
        )
    g2 = report["ttft_gaps_nostack"]
    print(
        f"without stacks: TTFT {report['ttft_traced_nostack_ms']:.2f} ms, window "
        f"{g2['window_ms']:.2f}, GPU busy {g2['gpu_busy_ms']:.2f}, first kernel after "
        f"{g2['lead_ms']:.2f} ms, {g2['gaps']} gaps = {g2['gap_ms']:.2f} ms; largest:"
    )
    for r in g2["top"][:8]:
        print(
            f"  at {r['at_ms']:7.2f} ms gap {r['gap_us']:8.1f} us -> {r['kernel'][:40]:40s} "
            f"launch->start {r.get('launch_to_start_us', float('nan')):8.1f} us {r.get('op')}"
        )
    for part, rows in report["ttft_kernels"].items():
        print(f"TTFT kernels {part}:")
        for name, calls, us in rows:
            print(f"  {us / 1e3:8.3f} ms {calls:5d} x {us / calls:8.1f} us  {name}")
    print("synchronising calls:", report["sync_calls"])
    for name in ("text", "image"):
        print(
            f"host calls per {name} decode step (calls, us):",
            [(k, round(c, 1), round(us, 1)) for k, c, us in report[f"calls_{name}"]],
        )


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the traces; writes gaps.json under ``--out`` and prints the findings."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gaps")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b()
    report = trace_ttft(llm, out)
    for name, image in (("text", False), ("image", True)):
        report[f"calls_{name}"] = decode_calls(llm, image)
    (out / "gaps.json").write_text(json.dumps(report, indent=1))
    print_report(report)
