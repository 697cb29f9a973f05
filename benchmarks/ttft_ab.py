"""TTFT of one 4-tile image + 128 tokens (11B shape, dummy weights; CUDA only) with the side
stream off, used for the cross layers' K/V only, and also for the text layers before the first
cross layer (the default), alternating in one process.

    python benchmarks/ttft_ab.py --rounds 6 --out /tmp/ttft

Each round measures every setting (median of ``--iters`` prefills each, the order rotated
every round), so drift of the machine falls on all. Writes ``ttft_ab.json`` under --out and
prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_report import dummy_11b, make_prompt

from vllm import SamplingParams


def ttft_ms(llm, processed, iters: int) -> float:
    """Median wall time from adding the request to its first token, over ``iters`` runs."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for i in range(iters):
        engine.add_request(f"t{time.monotonic_ns()}_{i}", None, params, processed=processed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def trace_one(llm, processed) -> dict:
    """GPU span of one prefill step, kernel time per stream, and the time two kernels ran at
    once (sum of kernel times minus the length of their union), in ms."""
    from torch.profiler import ProfilerActivity, profile

    ttft_ms(llm, processed, 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ttft_ms(llm, processed, 1)
    spans = sorted((e.time_range.start, e.time_range.end, e.device_resource_id)
                   for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end
                   > e.time_range.start)
    per_stream: dict[str, float] = {}
    union, cur_s, cur_e = 0.0, None, None
    for s, e, stream in spans:
        per_stream[str(stream)] = per_stream.get(str(stream), 0.0) + (e - s) / 1e3
        if cur_e is None or s > cur_e:
            union += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        union += cur_e - cur_s
    total = sum(per_stream.values())
    return {"span_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0,
            "busy_ms": union / 1e3, "kernel_ms": total, "overlap_ms": total - union / 1e3,
            "per_stream_ms": {k: round(v, 3) for k, v in per_stream.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ttft")
    ap.add_argument("--trace", action="store_true",
                    help="then profile one prefill per setting (last: the profiler slows every "
                         "later launch in the process) and report per-stream kernel time and "
                         "how much of it overlapped")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b(8, 0.6, limit_mm_per_prompt={"image": 1})
    text = llm.llm_engine.runner.model.language_model.model
    processed = llm.llm_engine.process_inputs(make_prompt(llm, True, 128, 99))
    settings = {"off": (False, False, False), "kv": (True, False, False),
                "kv+early": (True, True, False), "kv+early+prio": (True, True, True)}
    results: dict[str, list[float]] = {k: [] for k in settings}

    def use(name: str) -> None:
        (text.cross_kv_side_stream, text.early_layers_side_stream,
         text.high_priority_text) = settings[name]

    names = list(settings)
    for name in names:  # warm all (workspaces, allocator pools)
        use(name)
        ttft_ms(llm, processed, 2)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            use(name)
            results[name].append(ttft_ms(llm, processed, args.iters))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in results.items()),
              flush=True)
    traces = {}
    for name in names if args.trace else ():
        use(name)
        traces[name] = trace_one(llm, processed)
        print(f"trace {name}: {traces[name]}", flush=True)
    use("kv+early")
    summary = {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                   "rounds_ms": v} for k, v in results.items()}
    summary["trace"] = traces
    summary["gpu"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    summary["date"] = time.strftime("%Y-%m-%d")
    (out / "ttft_ab.json").write_text(json.dumps(summary, indent=1))
    print("setting   median   min      max   (ms, TTFT of one 4-tile image + 128 tokens)")
    for k in names:
        s = summary[k]
        print(f"{k:8s} {s['median_ms']:7.2f} {s['min_ms']:7.2f} {s['max_ms']:7.2f}")


if __name__ == "__main__":
    main()
