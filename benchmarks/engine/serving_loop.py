"""Closed-loop engine benchmark of inter-token latency with image arrivals (no HTTP server).

Keeps ``--concurrency`` requests in flight (a new one as each finishes), ``--image-ratio`` of
them with one 4-tile image, and records every step the engine launches (kind, batch, prompt
tokens, wall time) and the arrival time of every token. Prints TTFT and ITL percentiles,
the ITL / median ratio at p99, the graph-replay fraction and a per-kind step summary; the
JSON (``--out``) keeps the step trace. Scheduler flags pass through with the server's
defaults (``--no-enable-chunked-prefill`` is the prefill-first baseline).

    python -m benchmarks.engine serving-loop --load-format dummy --dtype bfloat16 --out s.json
    python -m benchmarks.engine serving-loop --smoke          # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import numpy as np

from benchmarks.common import EngineView, launch_record, make_prompt
from vllm import LLM, SamplingParams

PCT = [50, 90, 99]


def parse_args(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    """The command line (engine flags pass through; ``--smoke`` shrinks the run)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo/mllama-11b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    # The server's defaults (the LLM class alone would prefill first); None: the engine's.
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                    default=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--encoder-layers-per-step", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-ratio", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, small run (CPU)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.max_model_len, args.max_num_seqs = "demo/mllama-tiny", 256, 8
        args.concurrency, args.num_requests, args.input_len, args.output_len = 4, 8, 24, 6
    return args


def trace_steps(view: EngineView) -> list[dict]:
    """Records each launched step: what it carried (``launch_record``) and its host time."""
    steps: list[dict] = []

    def traced_launch(launch):
        def run(out):
            t0 = time.perf_counter()
            handle = launch(out)
            steps.append({"t": t0, "host_ms": (time.perf_counter() - t0) * 1e3,
                          **launch_record(out)})
            return handle

        return run

    view.wrap_runner("launch", traced_launch)
    return steps


def closed_loop(llm: LLM, args: argparse.Namespace, templates: list, params) -> tuple:
    """Runs the load; returns (request start times, token arrival times, start, duration s)."""
    engine, view = llm.llm_engine, EngineView(llm)
    kinds = np.random.default_rng(0).random(args.num_requests) < args.image_ratio
    sent = done = 0
    start: dict[str, float] = {}
    token_times: dict[str, list[float]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    t_begin = time.perf_counter()
    while done < args.num_requests:
        while sent < args.num_requests and sent - done < args.concurrency:
            rid = str(sent)
            view.add_processed(rid, templates[int(kinds[sent])], params)
            start[rid] = time.perf_counter()
            sent += 1
        for o in engine.step():
            now = time.perf_counter()
            n = len(o.outputs[0].token_ids)
            token_times[o.request_id] += [now] * (n - seen[o.request_id])
            seen[o.request_id] = n
            if o.finished:
                done += 1
    return start, token_times, t_begin, time.perf_counter() - t_begin


def step_summary(steps: list[dict], t_begin: float) -> dict:
    """Wall ms per step (to the next launch) by kind, with or without encoder work."""
    for i in range(len(steps) - 1):
        steps[i]["wall_ms"] = (steps[i + 1]["t"] - steps[i]["t"]) * 1e3
    by_kind = defaultdict(list)
    for s in steps[:-1]:
        by_kind[(s["kind"], s["encoder"] > 0)].append(s["wall_ms"])
    for s in steps:
        s["t"] -= t_begin
    return {
        f"{k}{'+encoder' if e else ''}": {
            "count": len(v),
            "wall_ms_p50": float(np.median(v)),
            "wall_ms_max": float(max(v)),
        }
        for (k, e), v in sorted(by_kind.items())
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the closed loop; prints the result (``--out`` also writes it with the trace)."""
    args = parse_args(argv, prog)
    names = ("enable_chunked_prefill", "max_num_batched_tokens", "encoder_layers_per_step")
    kw = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        **kw,
    )
    engine, view = llm.llm_engine, EngineView(llm)
    steps = trace_steps(view)
    templates = [
        view.process(make_prompt(llm, img, args.input_len, 7 + img)) for img in (False, True)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, processed in enumerate(templates):  # warm-up: one request of each kind, alone
        view.add_processed(f"warm{i}", processed, params)
        while engine.has_unfinished_requests():
            engine.step()
    steps.clear()
    stats = view.stats
    replays0 = sum(stats.graph_replays.values()) + stats.eager_decode_steps
    eager0 = stats.eager_decode_steps
    start, token_times, t_begin, duration = closed_loop(llm, args, templates, params)
    ttft = [(token_times[r][0] - start[r]) * 1e3 for r in start]
    itl = np.concatenate([np.diff(token_times[r]) * 1e3 for r in start])
    decodes = sum(stats.graph_replays.values()) + stats.eager_decode_steps - replays0
    result = {
        "args": vars(args),
        "duration_s": duration,
        "output_tok_s": args.num_requests * args.output_len / duration,
        "ttft_ms": dict(zip(map(str, PCT), np.percentile(ttft, PCT).tolist(), strict=True)),
        "itl_ms": dict(zip(map(str, PCT), np.percentile(itl, PCT).tolist(), strict=True)),
        "graph_replay_fraction": 1 - (stats.eager_decode_steps - eager0) / max(decodes, 1),
        "images_encoded_ahead": stats.images_encoded_ahead,
    }
    result["p99_over_median_itl"] = result["itl_ms"]["99"] / result["itl_ms"]["50"]
    result["steps"] = step_summary(steps, t_begin)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**result, "trace": steps}, f, indent=1)
    print(json.dumps(result, indent=1))
