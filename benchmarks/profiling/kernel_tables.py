"""Kernel tables of the 11B decode step and of a one-image prefill, under torch.profiler (CUDA).

    python -m benchmarks.profiling kernels --out /tmp/profile [--decode-batch 64]

Writes, sorted by total CUDA time: ``prefill.txt`` (one 4-tile image + 128 tokens, then its
host operations by CPU time with their Python stacks), ``decode_graph.txt`` and
``decode_eager.txt`` (5 decode steps at ``--decode-batch``, alternating image / text requests),
and ``forward_kernels.json`` (kernels per bs=1 decode forward of the text and cross graphs, by
name). Once the profiler has run, its CUDA tracing slows every later graph launch of the
process, so host times come from ``python -m benchmarks.profiling host``, not from here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import EngineView, dummy_11b, make_prompt, sync
from vllm import LLM, SamplingParams


def table(prof, rows: int = 30) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def profile_prefill(llm: LLM, processed, params, out: Path) -> None:
    """The prefill of one image request, after a warm-up request of the same prompt."""
    engine, view = llm.llm_engine, EngineView(llm)
    view.add_processed("warm", processed, params)
    for _ in range(4):
        engine.step()
    engine.abort_request("warm")
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        view.add_processed("p", processed, params)
        engine.step()  # the prefill
        sync()
    host = prof.key_averages(group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=25)
    (out / "prefill.txt").write_text(table(prof) + "\n\nHost, by CPU time:\n" + host)


def profile_decode(llm: LLM, batch: int, params, out: Path) -> None:
    """Five decode steps at ``batch`` with graphs, then five eager."""
    engine, view = llm.llm_engine, EngineView(llm)
    for i in range(1, batch):
        engine.add_request(f"b{i}", make_prompt(llm, i % 2 == 0, 512, 10 + i), params)
    for _ in range(3 + batch):  # prefill steps until every request decodes
        engine.step()
    for name in ("decode_graph", "decode_eager"):
        with view.eager() if name == "decode_eager" else contextlib.nullcontext():
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine.step()
                sync()
        (out / f"{name}.txt").write_text(table(prof, 40))


def kernels_per_forward(llm: LLM) -> dict:
    """Kernels one bs=1 decode forward launches, per graph family (run eagerly, rows parked
    on the padding row so nothing is written)."""
    view = EngineView(llm)
    view.abort_all()
    view.park_graph_rows()
    out = {}
    for family in ("text", "cross"):
        view.graph_forward(1, family)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            view.graph_forward(1, family)
            sync()
        names = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                names[e.name[:80]] += 1
        out[family] = {"total": sum(names.values()), "by_name": dict(names.most_common())}
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the profiles; writes the tables under ``--out`` and prints them."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/profile")
    ap.add_argument(
        "--decode-batch",
        type=int,
        default=1,
        help="profile decode at this batch (alternating image / text requests)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b(max(8, args.decode_batch))
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    processed = EngineView(llm).process(make_prompt(llm, True, 128, 3))
    profile_prefill(llm, processed, params, out)
    profile_decode(llm, args.decode_batch, params, out)
    forward = kernels_per_forward(llm)
    (out / "forward_kernels.json").write_text(json.dumps(forward, indent=1))
    for f in ("prefill", "decode_graph", "decode_eager"):
        print(f"===== {f}")
        print((out / f"{f}.txt").read_text()[:12000])
    print("\n| family | kernels per bs=1 forward |\n|---|---|")
    for fam, k in forward.items():
        print(f"| {fam} | {k['total']} |")
