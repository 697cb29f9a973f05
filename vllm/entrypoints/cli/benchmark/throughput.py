"""``vllm bench throughput``: offline throughput over many synthetic requests.

``--num-prompts`` requests of exactly ``--input-len`` prompt tokens and ``--output-len`` forced
output tokens (``ignore_eos``) go to ``LLM.generate`` at once; the engine schedules them as it
would any offline batch. A seeded ``--image-ratio`` fraction of them carries ``--num-images``
random-noise images of ``--image-size`` pixels. Reports requests/s, total tokens/s (prompt +
output) and output tokens/s over the wall time of the run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from vllm.entrypoints.cli.benchmark.common import (
    RunnerSnapshot,
    add_image_args,
    args_record,
    check_image_args,
    check_lengths,
    engine_info,
    make_llm,
    synthetic_prompts,
    write_json,
)
from vllm.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark flags (vLLM's names) plus every engine flag."""
    from vllm.engine.arg_utils import EngineArgs

    parser.add_argument(
        "--num-prompts", type=int, default=1000, help="Number of requests to process."
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="Prompt length in tokens (image tokens included).",
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="Output tokens per request (EOS ignored)."
    )
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument(
        "--num-warmup-prompts",
        type=int,
        default=4,
        help="Requests run once before timing (kernel compilation and caches "
        "outside the measurement); 0 to skip.",
    )
    parser.add_argument(
        "--disable-detokenize", action="store_true", help="Do not detokenize outputs."
    )
    parser.add_argument(
        "--output-json",
        type=str,
        default=None,
        help="Write the results and arguments to this JSON file.",
    )
    add_image_args(parser, ratio=True)
    EngineArgs.add_cli_args(parser)


def images_per_request(
    num_prompts: int, num_images: int, image_ratio: float, seed: int
) -> list[int]:
    """``round(image_ratio * num_prompts)`` requests get ``num_images`` images, chosen by a
    seeded permutation; the rest get none."""
    with_images = round(image_ratio * num_prompts) if num_images else 0
    chosen = np.random.default_rng(seed).permutation(num_prompts)[:with_images]
    counts = [0] * num_prompts
    for i in chosen:
        counts[int(i)] = num_images
    return counts


def _check_args(args: argparse.Namespace) -> None:
    check_image_args(args)
    for name in ("num_prompts", "input_len", "output_len", "n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_warmup_prompts < 0:
        raise ValueError(f"--num-warmup-prompts must be >= 0, got {args.num_warmup_prompts}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark and returns the JSON record."""
    _check_args(args)
    llm = make_llm(args)
    info = engine_info(llm)
    check_lengths(args, info)
    seed = args.seed if args.seed is not None else 0
    counts = images_per_request(args.num_prompts, args.num_images, args.image_ratio, seed)
    prompts = synthetic_prompts(llm, counts, args.input_len, args.image_size, seed)
    params = SamplingParams(
        n=args.n,
        temperature=0.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=not args.disable_detokenize,
    )
    if args.num_warmup_prompts:
        # Both kinds of request, if there are both, so both graph families run once.
        warm = sorted(range(len(prompts)), key=lambda i: counts[i])
        picks = {warm[0], warm[-1], *range(min(args.num_warmup_prompts, len(prompts)))}
        llm.generate([prompts[i] for i in sorted(picks)], params, use_tqdm=False)

    before = RunnerSnapshot.take(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    delta = RunnerSnapshot.take(llm).since(before)

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "num_image_requests": sum(1 for c in counts if c),
        "num_images": sum(counts),
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "runner": {
            "graph_replays": delta.graph_replays,
            "graph_replays_total": sum(delta.graph_replays.values()),
            "eager_decode_steps": delta.eager_decode_steps,
            "prefill_steps": delta.prefill_steps,
            "decode_steps": delta.decode_steps,
            "host_time_s": delta.host_time_s,
            "host_ms_per_step": 1000 * delta.host_time_s / max(delta.steps, 1),
        },
        "engine": info,
        "args": args_record(args),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of ``vllm bench throughput`` and ``benchmarks/benchmark_throughput.py``."""
    rec = run(args)
    print(
        f"Throughput: {rec['requests_per_second']:.2f} requests/s, "
        f"{rec['tokens_per_second']:.2f} total tokens/s, "
        f"{rec['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(
        f"Requests: {rec['num_requests']} ({rec['num_image_requests']} with images, "
        f"{rec['num_images']} images); prompt tokens {rec['total_prompt_tokens']}, output "
        f"tokens {rec['total_output_tokens']}, {rec['elapsed_time']:.2f} s"
    )
    r = rec["runner"]
    print(
        f"Runner: {r['prefill_steps']} prefill steps, {r['decode_steps']} decode steps "
        f"({r['graph_replays_total']} graph replays, {r['eager_decode_steps']} eager)"
    )
    if args.output_json:
        write_json(args.output_json, rec)
        print(f"Wrote {args.output_json}")
    return rec
