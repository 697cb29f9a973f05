"""``vllm bench latency``: the latency of one batch, end to end, plus its decode step time.

Each iteration runs ``LLM.generate``'s loop (add the requests, step the engine until all
finish) on the same ``--batch-size`` prompts of exactly ``--input-len`` tokens (images first)
and ``--output-len`` forced output tokens (``ignore_eos``, greedy). A second set of
iterations with ``max_tokens=1`` measures the time to first token of the batch, so the time
per decode step is free of prefill:

    decode_ms_per_step = (avg_latency - avg_ttft) / (output_len - 1)

The model runner's counters over the timed full-length iterations show whether decode ran
from CUDA graphs (``graph_replays`` by family/bucket) or eagerly, and how much host time each
prefill and each decode step took to launch (attributed step by step).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.entrypoints.cli.benchmark.common import (
    LATENCY_PERCENTILES,
    RunnerSnapshot,
    add_image_args,
    args_record,
    check_image_args,
    check_lengths,
    decode_weight_bytes,
    engine_info,
    make_llm,
    percentiles,
    synthetic_prompts,
    write_json,
)
from vllm.sampling_params import RequestOutputKind, SamplingParams

_request_counter = itertools.count()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark flags (vLLM's names) plus every engine flag."""
    from vllm.engine.arg_utils import EngineArgs

    parser.add_argument(
        "--input-len", type=int, default=32, help="Prompt length in tokens (image tokens included)."
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="Generated tokens per sequence (EOS ignored)."
    )
    parser.add_argument("--batch-size", type=int, default=8, help="Prompts per batch.")
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument(
        "--num-iters-warmup", type=int, default=10, help="Untimed iterations before measuring."
    )
    parser.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize outputs (leaves detokenization out of the measured time).",
    )
    parser.add_argument(
        "--output-json",
        type=str,
        default=None,
        help="Write the results and arguments to this JSON file.",
    )
    add_image_args(parser)
    EngineArgs.add_cli_args(parser)


def _check_args(args: argparse.Namespace) -> None:
    check_image_args(args)
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


@dataclass
class HostSplit:
    """Host (launch) time of the model runner's steps, split by step kind."""

    prefill_s: float = 0.0
    prefill_steps: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0


def generate(
    llm: Any, prompts: list[dict[str, Any]], params: SamplingParams, split: HostSplit
) -> list[Any]:
    """``LLM.generate`` without the progress bar, stepping the engine itself so each step's
    runner host time can be attributed to prefill or decode (``split`` accumulates it)."""
    engine = llm.llm_engine
    stats = engine.runner.stats
    p = params.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    ids = [f"bench-latency-{next(_request_counter)}" for _ in prompts]
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, p)
    except Exception:
        engine.abort_request(ids)
        raise
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        host0, prefills0, steps0 = stats.host_time_s, stats.prefill_steps, stats.steps
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        host = stats.host_time_s - host0
        if stats.prefill_steps > prefills0:
            split.prefill_s += host
            split.prefill_steps += 1
        elif stats.steps > steps0:
            split.decode_s += host
            split.decode_steps += 1
    return [finished[rid] for rid in ids]


def _time_runs(
    llm: Any,
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    warmup: int,
    iters: int,
    label: str,
) -> tuple[list[float], RunnerSnapshot, HostSplit]:
    """``warmup`` untimed then ``iters`` timed generate calls: seconds for each timed call, and
    the runner counters and host-time split of the timed calls only."""
    for _ in range(warmup):
        generate(llm, prompts, params, HostSplit())
    before = RunnerSnapshot.take(llm)
    split = HostSplit()
    times = []
    for i in range(iters):
        start = time.perf_counter()
        outputs = generate(llm, prompts, params, split)
        times.append(time.perf_counter() - start)
        if i == 0:
            _check_lengths(outputs, params)
        print(f"{label} iteration {i + 1}/{iters}: {times[-1] * 1000:.2f} ms", flush=True)
    return times, RunnerSnapshot.take(llm).since(before), split


def _check_lengths(outputs: list[Any], params: SamplingParams) -> None:
    """Each sequence must have produced exactly max_tokens (ignore_eos), else the numbers lie."""
    for out in outputs:
        for c in out.outputs:
            if len(c.token_ids) != params.max_tokens:
                raise RuntimeError(
                    f"a sequence produced {len(c.token_ids)} tokens, expected "
                    f"{params.max_tokens} (finish_reason={c.finish_reason})"
                )


def _runner_record(delta: RunnerSnapshot, split: HostSplit) -> dict[str, Any]:
    """Counters and host time of the timed full-length runs."""
    return {
        "graph_replays": delta.graph_replays,
        "graph_replays_total": sum(delta.graph_replays.values()),
        "eager_decode_steps": delta.eager_decode_steps,
        "prefill_steps": delta.prefill_steps,
        "decode_steps": delta.decode_steps,
        "host_time_s": delta.host_time_s,
        "host_ms_per_step": 1000 * delta.host_time_s / max(delta.steps, 1),
        "host_ms_per_prefill_step": 1000 * split.prefill_s / max(split.prefill_steps, 1),
        "host_ms_per_decode_step": 1000 * split.decode_s / max(split.decode_steps, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark and returns the JSON record (also printed as a summary)."""
    _check_args(args)
    llm = make_llm(args)
    info = engine_info(llm)
    check_lengths(args, info)
    seed = args.seed if args.seed is not None else 0
    prompts = synthetic_prompts(
        llm, [args.num_images] * args.batch_size, args.input_len, args.image_size, seed
    )
    common = {
        "n": args.n,
        "temperature": 0.0,
        "ignore_eos": True,
        "detokenize": not args.disable_detokenize,
    }
    full = SamplingParams(max_tokens=args.output_len, **common)
    first = SamplingParams(max_tokens=1, **common)

    ttfts, _, _ = _time_runs(llm, prompts, first, args.num_iters_warmup, args.num_iters, "TTFT")
    latencies, delta, split = _time_runs(
        llm, prompts, full, args.num_iters_warmup, args.num_iters, "Latency"
    )
    return _record(args, info, llm, latencies, ttfts, _runner_record(delta, split))


def _record(
    args: argparse.Namespace,
    info: dict[str, Any],
    llm: Any,
    latencies: list[float],
    ttfts: list[float],
    runner: dict[str, Any],
) -> dict[str, Any]:
    avg_latency = float(np.mean(latencies))
    avg_ttft = float(np.mean(ttfts))
    decode_s = (avg_latency - avg_ttft) / (args.output_len - 1) if args.output_len > 1 else None
    weight_bytes = decode_weight_bytes(llm)
    num_seqs = args.batch_size * args.n
    return {
        "avg_latency": avg_latency,
        "latencies": latencies,
        "percentiles": percentiles(latencies, LATENCY_PERCENTILES),
        "avg_ttft": avg_ttft,
        "ttft_latencies": ttfts,
        "ttft_percentiles": percentiles(ttfts, LATENCY_PERCENTILES),
        "decode_ms_per_step": 1000 * decode_s if decode_s is not None else None,
        # Both derived numbers need a positive step time; noise can make a short run's
        # latency - ttft non-positive, and then they are left out rather than nonsense.
        "decode_tokens_per_second": num_seqs / decode_s if decode_s and decode_s > 0 else None,
        "output_tokens_per_second": num_seqs * args.output_len / avg_latency,
        "decode_weight_bytes": weight_bytes,
        "decode_weight_bandwidth_gb_s": (
            weight_bytes / decode_s / 1e9 if decode_s and decode_s > 0 else None
        ),
        "runner": runner,
        "engine": info,
        "args": args_record(args),
    }


def _print_summary(rec: dict[str, Any]) -> None:
    print(f"Avg latency: {rec['avg_latency']:.4f} s")
    for p, v in rec["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} s")
    print(f"Avg time to first token (batch): {rec['avg_ttft'] * 1000:.2f} ms")
    if rec["decode_tokens_per_second"] is not None:
        print(
            f"Decode: {rec['decode_ms_per_step']:.3f} ms/step, "
            f"{rec['decode_tokens_per_second']:.1f} tokens/s, weights read at "
            f"{rec['decode_weight_bandwidth_gb_s']:.1f} GB/s"
        )
    elif rec["decode_ms_per_step"] is not None:
        print(
            f"Decode: {rec['decode_ms_per_step']:.3f} ms/step (not positive: the run is too "
            "short or too noisy to separate decode from prefill; raise --output-len)"
        )
    r = rec["runner"]
    print(
        f"Runner (timed runs): {r['graph_replays_total']} graph replays "
        f"{r['graph_replays']}, {r['eager_decode_steps']} eager decode steps, host "
        f"{r['host_ms_per_decode_step']:.3f} ms/decode step, "
        f"{r['host_ms_per_prefill_step']:.3f} ms/prefill step"
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of ``vllm bench latency`` and ``benchmarks/benchmark_latency.py``."""
    rec = run(args)
    _print_summary(rec)
    if args.output_json:
        write_json(args.output_json, rec)
        print(f"Wrote {args.output_json}")
    return rec
