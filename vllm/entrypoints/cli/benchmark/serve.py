"""``vllm bench serve``: load an OpenAI-compatible server and measure TTFT, TPOT, ITL, E2EL.

Requests come from a seeded synthetic dataset mixing text-only and image requests
(``serve_client.py``), or from ``--dataset-name`` (``datasets.py``: ``random``, ``random-mm``,
or a local ShareGPT file). They are dispatched at Poisson (or gamma, ``--burstiness``) arrival
times for ``--request-rate`` requests/s (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight, each streamed over SSE and timed on arrival of every chunk.
Several rates (``--request-rate 1 2 4 inf``) run one after the other into one JSON, with a PNG
of TTFT, ITL and throughput against the rate (``sweep_plot.py``).
Metric definitions are in ``serve_metrics.py``. Only the server the user names is contacted
(loopback by default).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from vllm import envs
from vllm.entrypoints.cli.benchmark.common import args_record, write_json
from vllm.entrypoints.cli.benchmark.datasets import (
    DATASET_NAMES,
    IMAGE_RATIOS,
    build_requests,
    local_file,
)
from vllm.entrypoints.cli.benchmark.serve_client import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    build_payload,
    encode_payload,
    send_request,
)
from vllm.entrypoints.cli.benchmark.serve_metrics import (
    RequestResult,
    arrival_times,
    calculate_metrics,
    format_report,
    parse_metric_names,
    parse_percentiles,
)
from vllm.entrypoints.cli.benchmark.sweep_plot import plot_sweep

BACKEND_ENDPOINTS = {
    "openai-chat": CHAT_ENDPOINT,
    "openai": COMPLETIONS_ENDPOINT,
    "vllm": COMPLETIONS_ENDPOINT,
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The serving benchmark's flags (vLLM's names where vLLM has one)."""
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--backend",
        choices=sorted(BACKEND_ENDPOINTS),
        default=None,
        help="openai-chat: chat completions; openai/vllm: completions. Picks the "
        "default --endpoint.",
    )
    srv.add_argument(
        "--base-url",
        default=None,
        help="Server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port).",
    )
    srv.add_argument("--host", default="127.0.0.1", help="Server host.")
    srv.add_argument("--port", type=int, default=8000, help="Server port.")
    srv.add_argument(
        "--endpoint",
        default=None,
        help=f"API path: {CHAT_ENDPOINT} (default) or {COMPLETIONS_ENDPOINT}.",
    )
    srv.add_argument(
        "--model", default=None, help="Model name in requests; defaults to the first of /v1/models."
    )
    srv.add_argument(
        "--request-timeout", type=float, default=6 * 3600, help="Seconds a single request may take."
    )
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default=None,
        help="random: synthetic text; random-mm: synthetic text with noise images; sharegpt: "
        "a local ShareGPT file (--dataset-path). Default: random-mm with --image-ratio 0.5.",
    )
    data.add_argument(
        "--dataset-path", default=None, help="The dataset file (sharegpt); local files only."
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every sharegpt request (default: its answer's length in tokens).",
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="Requests to send.")
    data.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=128,
        help="Prompt length in words (about 1.3 tokens each).",
    )
    data.add_argument(
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="Draw each prompt's length uniformly from input-len * [1 - r, 1 + r] (0: fixed).",
    )
    data.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=128,
        help="max_tokens of each request.",
    )
    data.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send ignore_eos so every request generates --output-len tokens.",
    )
    data.add_argument(
        "--image-ratio",
        type=float,
        default=None,
        help="Fraction of requests with images (chat endpoint only; default 0.5, random 0, "
        "random-mm 1).",
    )
    data.add_argument(
        "--num-images",
        "--random-mm-base-items-per-request",
        dest="num_images",
        type=int,
        default=1,
        help="Images per image request.",
    )
    data.add_argument(
        "--image-size",
        type=int,
        default=560,
        help="Side in pixels of the square random-noise JPEG images.",
    )
    data.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Dataset and arrival-time seed (a sweep's i-th rate takes seed + i).",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="Requests per second (Poisson arrivals); inf sends all at once. Several values: "
        "a sweep, one run per rate, saved to one JSON and a PNG plot.",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the inter-arrival times (1 = Poisson).",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="At most this many requests in flight."
    )
    out = parser.add_argument_group("results")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="Metrics to report percentiles for, from ttft,tpot,itl,e2el.",
    )
    out.add_argument(
        "--metric-percentiles", default="99", help="Comma-separated percentiles, e.g. 50,90,99."
    )
    out.add_argument("--save-result", action="store_true", help="Save the results as JSON.")
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="Also save per-request lists (lengths, TTFTs, ITLs, send times, image counts, "
        "texts, errors).",
    )
    out.add_argument("--result-dir", default=None, help="Folder for the JSON (default: .).")
    out.add_argument(
        "--plot",
        default=None,
        help="PNG of a sweep (default: the sweep's JSON path with .png).",
    )
    out.add_argument("--result-filename", default=None, help="JSON file name.")
    out.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def _check_dataset(args: argparse.Namespace) -> None:
    """The dataset flags agree; ``image_ratio`` gets the dataset's default."""
    name = args.dataset_name
    if args.image_ratio is None:
        args.image_ratio = IMAGE_RATIOS.get(name, 0.0)
    if name == "sharegpt":
        local_file(args.dataset_path)
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ValueError("--sharegpt-output-len must be >= 1")
    elif args.dataset_path is not None:
        which = name or "the default"
        raise ValueError(f"--dataset-path is for --dataset-name sharegpt, not {which}")
    if name == "random" and args.image_ratio > 0:
        raise ValueError("--dataset-name random is text only; use random-mm for images")


def _check_args(args: argparse.Namespace) -> None:
    _check_dataset(args)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    if not 0.0 <= args.image_ratio <= 1.0:
        raise ValueError(f"--image-ratio must be in [0, 1], got {args.image_ratio}")
    if args.num_images < 0 or args.image_size < 1:
        raise ValueError("--num-images must be >= 0 and --image-size >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    _, api_url = resolve_urls(args)
    if not api_url.endswith("chat/completions") and args.image_ratio > 0 and args.num_images:
        raise ValueError(
            f"{api_url} takes text only: use --endpoint {CHAT_ENDPOINT} for image requests, "
            "or --image-ratio 0"
        )


def resolve_urls(args: argparse.Namespace) -> tuple[str, str]:
    """``(base_url, api_url)`` from --base-url or --host/--port and --endpoint/--backend."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or BACKEND_ENDPOINTS.get(args.backend or "", CHAT_ENDPOINT)
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    return base, base + endpoint


def _headers() -> dict[str, str]:
    key = envs.OPENAI_API_KEY
    return {"Authorization": f"Bearer {key}"} if key else {}


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id from ``GET /v1/models``."""
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=_headers())
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(
            f"Could not list models at {base_url}/v1/models ({e}); is the "
            "server running? Pass --model to skip discovery."
        ) from None


async def run_load(
    client: httpx.AsyncClient,
    api_url: str,
    bodies: list[bytes],
    num_images: list[int],
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float]:
    """Dispatches every body at its arrival time; returns the results and the wall time."""
    offsets = arrival_times(len(bodies), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(bodies), desc="Requests", dynamic_ncols=True)
    headers = _headers()

    async def one(i: int, start: float) -> RequestResult:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            result = await send_request(client, api_url, bodies[i], headers, num_images[i])
        else:
            async with limit:
                result = await send_request(client, api_url, bodies[i], headers, num_images[i])
        if bar is not None:
            bar.update(1)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, start) for i in range(len(bodies))))
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the dataset, checks the server with one request, runs the load, aggregates."""
    _check_args(args)
    percentile_metrics = parse_metric_names(args.percentile_metrics)
    metric_percentiles = parse_percentiles(args.metric_percentiles)
    base_url, api_url = resolve_urls(args)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment ever sees the traffic.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = args.model or await discover_model(client, base_url)
        requests = await build_requests(args, client, base_url, model, _headers())
        endpoint = api_url[len(base_url) :]
        bodies = [
            encode_payload(build_payload(r, endpoint, model, args.ignore_eos)) for r in requests
        ]
        counts = [len(r.image_urls) for r in requests]
        print(
            f"Model {model} at {api_url}: {len(bodies)} requests "
            f"({sum(1 for c in counts if c)} with images), request rate "
            f"{args.request_rate}, max concurrency {args.max_concurrency}"
        )
        test = await send_request(client, api_url, bodies[0], _headers(), counts[0])
        if not test.success:
            raise RuntimeError(
                f"The test request failed, so the benchmark did not start: {test.error}"
            )
        results, duration = await run_load(client, api_url, bodies, counts, args)
    metrics = calculate_metrics(results, duration, percentile_metrics, metric_percentiles)
    print(
        format_report(
            metrics, percentile_metrics, metric_percentiles, args.max_concurrency, args.request_rate
        )
    )
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        print(f"Error: {err}")
    return _result_record(args, model, api_url, metrics, results)


def _result_record(
    args: argparse.Namespace,
    model: str,
    api_url: str,
    metrics: dict[str, Any],
    results: list[RequestResult],
) -> dict[str, Any]:
    rate = args.request_rate
    record: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend or ("openai-chat" if api_url.endswith(CHAT_ENDPOINT) else "openai"),
        "api_url": api_url,
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": rate if rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_image_requests": sum(1 for r in results if r.num_images),
        **metrics,
        "args": args_record(args),
    }
    if args.save_detailed:
        record.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            # time.perf_counter() at each send: CLOCK_MONOTONIC on Linux, so it lines up with
            # timestamps taken by other processes on the same host (e.g. a server-side trace).
            send_times=[r.send_time for r in results],
            num_images=[r.num_images for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    return record


def result_path(args: argparse.Namespace, record: dict[str, Any]) -> Path:
    """--result-dir/--result-filename, or a name from backend, rate, concurrency and model."""
    name = args.result_filename
    if name is None:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(record["model_id"]).rstrip("/").split("/")[-1]
        name = (
            f"{record['backend']}-{record['request_rate']}qps{conc}-{model}-{record['date']}.json"
        )
    return Path(args.result_dir or ".") / name


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of ``vllm bench serve`` and ``benchmarks/benchmark_serving.py``."""
    rates = args.request_rate if isinstance(args.request_rate, list) else [args.request_rate]
    if len(rates) > 1:
        return sweep(args, rates)
    args.request_rate = rates[0]
    record = asyncio.run(benchmark(args))
    if args.save_result or args.result_filename:
        path = result_path(args, record)
        write_json(str(path), record)
        print(f"Wrote {path}")
    return record


def sweep(args: argparse.Namespace, rates: list[float]) -> dict[str, Any]:
    """One run per request rate, in the order given; one JSON (``runs``: each run's record)
    and a PNG plot, always written. Run ``i`` takes seed ``--seed + i``: each rate sends
    prompts and images of its own, so a server with prefix caching does not answer a later
    rate from the pages and images an earlier rate left cached."""
    wanted = parse_metric_names(args.percentile_metrics)
    args.percentile_metrics = ",".join(dict.fromkeys([*wanted, "ttft", "itl"]))
    pcts = parse_percentiles(args.metric_percentiles)
    args.metric_percentiles = ",".join(f"{p:g}" for p in sorted({*pcts, 50.0, 99.0}))
    runs = []
    for i, rate in enumerate(rates):
        run = argparse.Namespace(**{**vars(args), "request_rate": rate, "seed": args.seed + i})
        runs.append(asyncio.run(benchmark(run)))
    record = {
        "date": runs[0]["date"],
        "model_id": runs[0]["model_id"],
        "request_rates": [r["request_rate"] for r in runs],
        "runs": runs,
    }
    name = args.result_filename or f"sweep-{runs[0]['date']}.json"
    path = Path(args.result_dir or ".") / name
    write_json(str(path), record)
    plot = plot_sweep(runs, Path(args.plot) if args.plot else path.with_suffix(".png"))
    print(f"Wrote {path} and {plot}")
    print(sweep_table(runs))
    return record


def sweep_table(runs: list[dict[str, Any]]) -> str:
    """One line per rate: throughput, TTFT and ITL median / p99."""
    lines = ["rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms)"]
    for r in runs:
        lines.append(
            f"{r['request_rate']!s:>12} | {r['output_throughput']:12.1f} | "
            f"{r['median_ttft_ms']:8.1f} / {r['p99_ttft_ms']:8.1f} | "
            f"{r['median_itl_ms']:7.1f} / {r['p99_itl_ms']:7.1f}"
        )
    return "\n".join(lines)
