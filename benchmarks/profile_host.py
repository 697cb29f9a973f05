"""Where the host time of a bs=1 decode step goes, on the 11B shape (CUDA only).

    python benchmarks/profile_host.py --out /tmp/host

1. Per-step distributions over steady decode (text-only and one-image requests, twice each):
   the launch (what the runner's ``host_time_s`` counts), the graph replay call inside it and
   the rest; Python garbage collections that fell inside a launch; a cProfile of the launches
   of a text-only run (``launch_cprofile.txt``).
2. The decode graphs' kernels per forward (torch profiler on the captured function, eager;
   run last).
3. The replay call's host time with the GPU idle and with one or two replays already queued,
   and the same graph launched by ``cudaGraphLaunch`` directly (no torch wrapper).
4. A chain of N tiny kernels in one graph: host launch time per node, idle and busy GPU.

Writes ``host_profile.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from run_report import dummy_11b, make_prompt

from vllm import LLM, SamplingParams


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "mean_us": statistics.fmean(xs) * 1e6,
            "median_us": statistics.median(xs) * 1e6,
            "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6, "max_us": xs[-1] * 1e6}


class StepTimer:
    """Wraps the runner's launch and CUDAGraph.replay; records garbage collections."""

    def __init__(self, runner) -> None:
        self.launch: list[float] = []
        self.replay: list[float] = []
        self.gc_in_launch = 0
        self._in_launch = False
        orig_launch = runner.launch
        orig_replay = torch.cuda.CUDAGraph.replay

        def launch(out):
            self._in_launch = True
            t = time.perf_counter()
            try:
                return orig_launch(out)
            finally:
                self.launch.append(time.perf_counter() - t)
                self._in_launch = False

        def replay(graph):
            t = time.perf_counter()
            orig_replay(graph)
            self.replay.append(time.perf_counter() - t)

        def on_gc(phase, info):
            if phase == "start" and self._in_launch:
                self.gc_in_launch += 1

        runner.launch = launch
        torch.cuda.CUDAGraph.replay = replay
        gc.callbacks.append(on_gc)

    def reset(self) -> None:
        self.launch.clear()
        self.replay.clear()
        self.gc_in_launch = 0


def _profiled(fn, prof: cProfile.Profile):
    def wrapped(*args):
        prof.enable()
        try:
            return fn(*args)
        finally:
            prof.disable()
    return wrapped


def steady_steps(llm: LLM, timer: StepTimer, image: bool, steps: int, seed: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    engine.add_request(f"r{seed}", make_prompt(llm, image, 512, seed), params)
    for _ in range(8):  # prefill, then into steady decode
        engine.step()
    torch.cuda.synchronize()
    timer.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    engine.abort_request(list(engine.scheduler.requests))
    rest = [a - b for a, b in zip(timer.launch, timer.replay, strict=True)]
    return {"launch": summary(timer.launch), "replay": summary(timer.replay),
            "rest": summary(rest), "gc_in_launch": timer.gc_in_launch,
            "step_wall_us": wall * 1e6}


def kernels_per_forward(llm: LLM) -> dict:
    graphs = llm.llm_engine.runner.graphs
    out = {}
    for family in ("text", "cross"):
        graphs.forward(1, family)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.forward(1, family)
            torch.cuda.synchronize()
        names = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                names[e.name[:80]] += 1
        out[family] = {"total": sum(names.values()), "by_name": dict(names.most_common())}
    return out


def replay_vs_queue(graph: torch.cuda.CUDAGraph, reps: int = 30) -> dict:
    res = {}
    for depth in (0, 1, 2):
        xs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            for _ in range(depth):
                graph.replay()
            t = time.perf_counter()
            graph.replay()
            xs.append(time.perf_counter() - t)
        res[f"queued_{depth}"] = summary(xs)
    torch.cuda.synchronize()
    return res


def direct_vs_replay(graph: torch.cuda.CUDAGraph, reps: int = 30) -> dict:
    """Host time of ``graph.replay()`` vs ``cudaGraphLaunch`` on its executable (one replay
    queued ahead of each, as in steady decode), alternating."""
    import ctypes

    rt = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if rt is None:
        return {}
    rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    exec_ = ctypes.c_void_p(graph.raw_cuda_graph_exec())
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    times: dict[str, list[float]] = {"replay": [], "direct": []}
    for _ in range(reps):
        for kind in times:
            torch.cuda.synchronize()
            graph.replay()
            t = time.perf_counter()
            if kind == "replay":
                graph.replay()
            else:
                assert rt.cudaGraphLaunch(exec_, stream) == 0
            times[kind].append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return {k: summary(v) for k, v in times.items()}


def chain_launch(n: int, reps: int = 30) -> dict:
    x = torch.zeros(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    return {"n": n, **{k: v["median_us"] for k, v in replay_vs_queue(g, reps).items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/host")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b()
    runner = llm.llm_engine.runner
    report: dict = {}
    timer = StepTimer(runner)
    runs = []
    for i in range(2):
        for image in (False, True):
            r = steady_steps(llm, timer, image, args.steps, seed=10 * i + image)
            r.update(image=image)
            runs.append(r)
            print(f"run {i} image={image}: launch mean {r['launch']['mean_us']:.0f} "
                  f"median {r['launch']['median_us']:.0f} p90 {r['launch']['p90_us']:.0f} "
                  f"max {r['launch']['max_us']:.0f} us; replay median "
                  f"{r['replay']['median_us']:.0f}; rest median {r['rest']['median_us']:.0f}; "
                  f"gc in launch {r['gc_in_launch']}; step {r['step_wall_us']:.0f} us",
                  flush=True)
    prof = cProfile.Profile()
    runner.launch = _profiled(runner.launch, prof)
    steady_steps(llm, timer, False, 200, seed=99)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    (out / "launch_cprofile.txt").write_text(text.getvalue())
    report["steady"] = runs
    graphs = runner.graphs
    graphs.static_rows.fill_(graphs.null_row)  # padding rows only: writes nowhere
    graphs._uploaded_rows = None
    report["replay_vs_queue"] = {
        fam: replay_vs_queue(graphs.graphs[(fam, 1)]) for fam in ("text", "cross")}
    report["direct_vs_replay"] = {
        fam: direct_vs_replay(graphs.graphs[(fam, 1)]) for fam in ("text", "cross")}
    report["chain"] = [chain_launch(n) for n in (50, 200, 400, 800)]
    # Last: the profiler's CUDA tracing may leave overhead behind on later launches.
    report["kernels"] = kernels_per_forward(llm)
    (out / "host_profile.json").write_text(json.dumps(report, indent=1))

    print("\n| family | kernels per bs=1 forward |")
    print("|---|---|")
    for fam, k in report["kernels"].items():
        print(f"| {fam} | {k['total']} |")
    print("\n| replay host us (median) | idle | 1 queued | 2 queued |")
    print("|---|---|---|---|")
    for fam, r in report["replay_vs_queue"].items():
        print(f"| {fam} bs=1 | " + " | ".join(f"{r[k]['median_us']:.0f}" for k in
                                             ("queued_0", "queued_1", "queued_2")) + " |")
    for fam, r in report["direct_vs_replay"].items():
        if r:
            print(f"| {fam} bs=1, 1 queued: replay() {r['replay']['median_us']:.0f}, "
                  f"cudaGraphLaunch {r['direct']['median_us']:.0f} | | |")
    for c in report["chain"]:
        print(f"| chain of {c['n']} | {c['queued_0']:.0f} | {c['queued_1']:.0f} | "
              f"{c['queued_2']:.0f} |")


if __name__ == "__main__":
    main()
