"""Where the host time of a bs=1 decode step goes, on the 11B shape (CUDA only).

    python -m benchmarks.profiling host --out /tmp/host [--steps 300]

No torch.profiler runs in this process (once it has, its CUDA tracing adds ~0.2 us per kernel
node to every later graph launch), so these are the engine's own host times:

1. Per-step distributions over steady decode (text-only and one-image requests, ``--repeats``
   runs each) of the runner's launch (what its ``host_time_s`` counts), the graph replay call
   inside it and the rest, in three modes: ``default``; ``frozen`` (``gc.freeze()`` first);
   ``idle`` (the GPU drained after each step, so no launch waits on a full queue). Garbage
   collections during the run and inside a launch are counted and timed.
2. A cProfile of ``--cprofile-steps`` engine steps of a text-only request
   (``host_cprofile.txt``, by own time).
3. The replay call's host time with the GPU idle and with one or two replays already queued,
   and the same graph launched by ``cudaGraphLaunch`` directly (no torch wrapper).

Writes ``host_profile.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import EngineView, dummy_11b, make_prompt, sync
from vllm import LLM, SamplingParams

MODES = ("default", "frozen", "idle")


def summary_us(xs: list[float]) -> dict:
    """n, mean, median, p90 and max of durations given in seconds, in microseconds."""
    xs = sorted(xs)
    return {
        "n": len(xs),
        "mean_us": statistics.fmean(xs) * 1e6,
        "median_us": statistics.median(xs) * 1e6,
        "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6,
        "max_us": xs[-1] * 1e6,
    }


class StepTimer:
    """Times the runner's launch and every CUDAGraph.replay; times garbage collections."""

    def __init__(self, view: EngineView) -> None:
        self.launch: list[float] = []
        self.replay: list[float] = []
        self.gc_in_launch = self.collections = 0
        self.gc_s = 0.0
        self._in_launch, self._gc_start = False, 0.0
        orig_replay = torch.cuda.CUDAGraph.replay

        def wrap_launch(launch):
            def timed(out):
                self._in_launch = True
                t = time.perf_counter()
                try:
                    return launch(out)
                finally:
                    self.launch.append(time.perf_counter() - t)
                    self._in_launch = False

            return timed

        def replay(graph):
            t = time.perf_counter()
            orig_replay(graph)
            self.replay.append(time.perf_counter() - t)

        view.wrap_runner("launch", wrap_launch)
        torch.cuda.CUDAGraph.replay = replay
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            self.gc_in_launch += self._in_launch
        else:
            self.gc_s += time.perf_counter() - self._gc_start
            self.collections += 1

    def reset(self) -> None:
        self.launch.clear()
        self.replay.clear()
        self.gc_in_launch = self.collections = 0
        self.gc_s = 0.0


def steady_steps(llm: LLM, timer: StepTimer, image: bool, steps: int, seed: int, mode: str) -> dict:
    """One request decoding ``steps`` steady steps, timed in ``mode``."""
    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    engine.add_request(f"r{seed}", make_prompt(llm, image, 512, seed), params)
    for _ in range(8):  # prefill, then into steady decode
        engine.step()
    sync()
    if mode == "frozen":
        gc.collect()
        gc.freeze()
    timer.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
        if mode == "idle":
            sync()
    wall = (time.perf_counter() - t0) / steps
    sync()
    if mode == "frozen":
        gc.unfreeze()
    view.abort_all()
    rest = [a - b for a, b in zip(timer.launch, timer.replay, strict=True)]
    return {
        "mode": mode,
        "image": image,
        "launch": summary_us(timer.launch),
        "replay": summary_us(timer.replay),
        "rest": summary_us(rest),
        "gc_in_launch": timer.gc_in_launch,
        "collections": timer.collections,
        "gc_ms": timer.gc_s * 1e3,
        "step_wall_us": wall * 1e6,
    }


def cprofile_steps(llm: LLM, steps: int) -> str:
    """cProfile of ``steps`` engine steps of one text-only request, by own time."""
    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    engine.add_request("cprofile", make_prompt(llm, False, 512, 99), params)
    for _ in range(8):
        engine.step()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    sync()
    view.abort_all()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    return text.getvalue()


def replay_vs_queue(graph: torch.cuda.CUDAGraph, reps: int = 30) -> dict:
    """Host time of ``graph.replay()`` with 0, 1 or 2 replays queued ahead of it."""
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
        res[f"queued_{depth}"] = summary_us(xs)
    torch.cuda.synchronize()
    return res


def _cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def direct_vs_replay(graph: torch.cuda.CUDAGraph, reps: int = 30) -> dict:
    """Host time of ``graph.replay()`` vs ``cudaGraphLaunch`` on its executable (one replay
    queued ahead of each, as in steady decode), alternating."""
    rt = _cudart()
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
    return {k: summary_us(v) for k, v in times.items()}


def print_tables(report: dict) -> None:
    """The per-run launch table and the replay tables, as markdown."""
    print(
        "\n| run | launch mean / median / p90 / max us | replay median | rest median "
        "| GCs (in launch, ms) | step us |"
    )
    print("|---|---|---|---|---|---|")
    for r in report["steady"]:
        la = r["launch"]
        print(
            f"| {r['mode']} {'image' if r['image'] else 'text'} | {la['mean_us']:.0f} / "
            f"{la['median_us']:.0f} / {la['p90_us']:.0f} / {la['max_us']:.0f} | "
            f"{r['replay']['median_us']:.0f} | {r['rest']['median_us']:.0f} | "
            f"{r['collections']} ({r['gc_in_launch']}, {r['gc_ms']:.2f}) | "
            f"{r['step_wall_us']:.0f} |"
        )
    print("\n| replay host us (median) | idle | 1 queued | 2 queued |\n|---|---|---|---|")
    for fam, r in report["replay_vs_queue"].items():
        print(
            f"| {fam} bs=1 | "
            + " | ".join(f"{r[k]['median_us']:.0f}" for k in ("queued_0", "queued_1", "queued_2"))
            + " |"
        )
    for fam, r in report["direct_vs_replay"].items():
        if r:
            print(
                f"| {fam} bs=1, 1 queued: replay() {r['replay']['median_us']:.0f}, "
                f"cudaGraphLaunch {r['direct']['median_us']:.0f} | | |"
            )


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs every measurement; writes host_profile.json under ``--out``."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/host")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2, help="runs per (mode, request kind)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cprofile-steps", type=int, default=200)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b()
    view = EngineView(llm)
    timer = StepTimer(view)
    runs = []
    for mode in args.modes.split(","):
        for i in range(args.repeats):
            for image in (False, True):
                runs.append(steady_steps(llm, timer, image, args.steps, 10 * i + image, mode))
                print(
                    f"{mode} run {i} image={image}: launch median "
                    f"{runs[-1]['launch']['median_us']:.0f} us",
                    flush=True,
                )
    (out / "host_cprofile.txt").write_text(cprofile_steps(llm, args.cprofile_steps))
    view.park_graph_rows()  # padding rows only: the replays below write nowhere
    report = {
        "steady": runs,
        "replay_vs_queue": {
            fam: replay_vs_queue(view.decode_graph(fam == "cross", 1)) for fam in ("text", "cross")
        },
        "direct_vs_replay": {
            fam: direct_vs_replay(view.decode_graph(fam == "cross", 1)) for fam in ("text", "cross")
        },
    }
    (out / "host_profile.json").write_text(json.dumps(report, indent=1))
    print_tables(report)
