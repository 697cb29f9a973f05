"""Kernel-level profile of the 11B decode step and of a one-image prefill (CUDA only).

    python benchmarks/profile_step.py --out /tmp/profile

Prints, per phase, the kernels sorted by total CUDA time (torch.profiler), the prefill's host
operations sorted by CPU time (with their Python stacks), and a cProfile of the host work of
50 decode steps (``decode_host.txt``), at batch size 1 unless ``--decode-batch`` says otherwise.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vllm import SamplingParams


def table(prof, rows: int = 30) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/profile")
    ap.add_argument("--decode-batch", type=int, default=1,
                    help="profile decode at this batch (alternating image / text requests)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import run_report as rr

    llm = rr.dummy_11b(max(8, args.decode_batch))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    prompt = rr.make_prompt(llm, True, 128, 3)
    processed = engine.process_inputs(prompt)
    engine.add_request("warm", None, params, processed=processed)
    for _ in range(4):
        engine.step()
    engine.abort_request("warm")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        engine.add_request("p", None, params, processed=processed)
        engine.step()  # the prefill
        torch.cuda.synchronize()
    host = prof.key_averages(group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=25)
    (out / "prefill.txt").write_text(table(prof) + "\n\nHost, by CPU time:\n" + host)
    for i in range(1, args.decode_batch):
        engine.add_request(f"b{i}", rr.make_prompt(llm, i % 2 == 0, 512, 10 + i), params)
    for _ in range(3 + args.decode_batch):  # prefill steps until every request decodes
        engine.step()
    runner = engine.runner
    for name, graphs in (("decode_graph", runner.graphs), ("decode_eager", None)):
        saved, runner.graphs = runner.graphs, graphs
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        runner.graphs = saved
        (out / f"{name}.txt").write_text(table(prof, 40))
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(50):
        engine.step()
    prof_host.disable()
    text = io.StringIO()
    pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(35)
    (out / "decode_host.txt").write_text(text.getvalue())
    for f in ("prefill", "decode_graph", "decode_eager", "decode_host"):
        print(f"===== {f}")
        print((out / f"{f}.txt").read_text()[:12000])


if __name__ == "__main__":
    main()
