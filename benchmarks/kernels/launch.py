"""Host cost of launching a CUDA graph against its number of kernel nodes (CUDA).

Graphs of 64-768 tiny kernels; host microseconds of one ``CUDAGraph.replay()`` and the GPU time
of the replay, median of 30. Run it in a fresh process (each command is one): once
torch.profiler has run in a process, its CUDA tracing stays attached and a graph launch costs
~0.2-0.5 us per node more (``--after-profiler`` measures that, after one profiled region).

    python -m benchmarks.kernels launch [--after-profiler] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

NODES = (64, 128, 256, 512, 768)


def graph_launch_cost(nodes: int, t: torch.Tensor, reps: int = 30) -> dict:
    """Median host and GPU microseconds of replaying a graph of ``nodes`` tiny kernels."""
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            t.add_(1.0)
    g.replay()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        g.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return {
        "nodes": nodes,
        "host_us": round(statistics.median(host), 1),
        "gpu_us": round(statistics.median(gpu), 1),
    }


def profile_once() -> None:
    """One torch.profiler region over a small kernel (what leaves the tracing attached)."""
    x = torch.zeros(256, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        x.add_(1.0)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Prints host and GPU microseconds per graph size."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--after-profiler", action="store_true", help="run one torch.profiler region first"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the launch benchmark needs a CUDA device")
    if args.after_profiler:
        profile_once()
    t = torch.zeros(256, device="cuda")
    rows = []
    for nodes in NODES:
        rows.append(graph_launch_cost(nodes, t))
        print(
            f"graph of {nodes:4d} tiny kernels: host launch {rows[-1]['host_us']:7.1f} us,"
            f" GPU {rows[-1]['gpu_us']:7.1f} us",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "after_profiler": args.after_profiler,
                    "graph_launch": rows,
                },
                f,
                indent=1,
            )
