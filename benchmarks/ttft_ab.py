"""TTFT of one 4-tile image + 128 tokens (11B shape, dummy weights; CUDA only) with the cross
layers' vision K/V projected on a side stream and in line, alternating in one process.

    python benchmarks/ttft_ab.py --rounds 6 --out /tmp/ttft

Each round measures both settings (median of ``--iters`` prefills each, the order swapped
every round), so drift of the machine falls on both. Writes ``ttft_ab.json`` under --out and
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ttft")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = dummy_11b(8, 0.6, limit_mm_per_prompt={"image": 1})
    text = llm.llm_engine.runner.model.language_model.model
    processed = llm.llm_engine.process_inputs(make_prompt(llm, True, 128, 99))
    results: dict[str, list[float]] = {"side": [], "inline": []}
    for setting in ("side", "inline"):  # warm both (workspaces, allocator pools)
        text.cross_kv_side_stream = setting == "side"
        ttft_ms(llm, processed, 2)
    for r in range(args.rounds):
        order = ("side", "inline") if r % 2 == 0 else ("inline", "side")
        for setting in order:
            text.cross_kv_side_stream = setting == "side"
            results[setting].append(ttft_ms(llm, processed, args.iters))
        print(f"round {r}: side {results['side'][-1]:.2f} ms, "
              f"inline {results['inline'][-1]:.2f} ms", flush=True)
    text.cross_kv_side_stream = True
    summary = {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                   "rounds_ms": v} for k, v in results.items()}
    summary["gpu"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    summary["date"] = time.strftime("%Y-%m-%d")
    (out / "ttft_ab.json").write_text(json.dumps(summary, indent=1))
    print("setting   median   min      max   (ms, TTFT of one 4-tile image + 128 tokens)")
    for k in ("side", "inline"):
        s = summary[k]
        print(f"{k:8s} {s['median_ms']:7.2f} {s['min_ms']:7.2f} {s['max_ms']:7.2f}")


if __name__ == "__main__":
    main()
