"""The H200 performance report in one run: 11B Instruct shape, dummy bf16 weights.

Measures decode ms/step (batch 1..128; text-only, all-image (one 4-tile image each) and mixed;
graph vs eager; 512-token prompts), TTFT of one 4-tile image + 128 tokens split into vision /
projection / text prefill, host time per step, start-up time and memory split, capacity, and in
the same run the anchors (copy bandwidth, GEMV floors, TTFT component floors, HF transformers
generate()).

    python -m benchmarks.engine report --out benchmarks/results
    python -m benchmarks.engine report --smoke --out /tmp/r    # tiny model, CPU, no timings

Writes ``report.json`` and ``summary.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    EngineView,
    copy_bandwidth,
    dummy_11b,
    event_ms,
    make_prompt,
    noise_image,
    prefill_times_ms,
    sync,
    tiny_llm,
)
from benchmarks.engine.floors import gemv_floor, hf_generate_times, hf_model_from, ttft_floor
from vllm import LLM, SamplingParams

PROMPT_LEN = 512


def time_decode(llm: LLM, steps: int) -> tuple[float, float]:
    """(steady, from idle) wall ms per engine step (schedule + launch + sample + host work).

    steady: between the returns of two engine steps ``steps`` apart, with the pipeline kept
    full (a step returns once the step before it has finished on the GPU), so the period a
    busy server sees. from idle: the same run timed from a synchronised, idle GPU to the last
    step's completion, which also counts the first launch's host time (the measure before
    2026-11-29, kept for comparison).
    """
    engine = llm.llm_engine
    for _ in range(3):
        engine.step()
    sync()
    t_idle = time.perf_counter()
    for _ in range(2):  # refill the pipeline
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    t1 = time.perf_counter()
    sync()
    t_end = time.perf_counter()
    return (t1 - t0) / steps * 1e3, (t_end - t_idle) / (steps + 2) * 1e3


def host_per_step(llm: LLM, steps: int) -> tuple[float, float]:
    """(mean, median) host ms launching a step over ``steps`` steady steps (the runner's
    ``host_time_s``: inputs, graph launch, sampling set-up, result copy)."""
    engine, stats = llm.llm_engine, EngineView(llm).stats
    xs = []
    for _ in range(steps):
        before = stats.host_time_s
        engine.step()
        xs.append(stats.host_time_s - before)
    return float(np.mean(xs)) * 1e3, float(np.median(xs)) * 1e3


def replay_ms(llm: LLM, cross: bool, bs: int, iters: int = 20) -> float:
    """GPU time of the decode graph alone (replays on the current rows). A replay also
    advances the rows (greedy tokens, positions), so their state is restored afterwards."""
    view = EngineView(llm)
    if not torch.cuda.is_available():
        return float("nan")
    g, rows = view.decode_graph(cross, bs), view.rows
    saved = rows.tokens.clone(), rows.positions.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        rows.positions.copy_(saved[1])  # the same step each time (same KV lengths)
        g.replay()
    end.record()
    sync()
    rows.tokens.copy_(saved[0])
    rows.positions.copy_(saved[1])
    return start.elapsed_time(end) / iters


def decode_point(
    llm: LLM, mix: str, bs: int, steps: int, wbytes: int, host_steps: int, prompt_len: int
) -> dict:
    """One row of the decode grid: ``bs`` requests of kind ``mix``, timed with graphs and
    eager, then aborted."""
    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(bs):
        img = mix == "image" or (mix == "mixed" and i % 2 == 0)
        engine.add_request(f"{mix}-{bs}-{i}", make_prompt(llm, img, prompt_len, i), params)
    while view.waiting():
        engine.step()
    cross = mix != "text"
    graph_ms, graph_idle_ms = time_decode(llm, steps)
    host_ms, host_median_ms = host_per_step(llm, host_steps)
    gpu_ms = replay_ms(llm, cross, bs)
    kv = view.running_kv_bytes()
    with view.eager():
        eager0 = view.stats.eager_decode_steps
        eager_ms, _ = time_decode(llm, max(steps // 2, 4))
    # Deliberate eager steps are not fallbacks: kept out of the replay fraction.
    eager_steps = view.stats.eager_decode_steps - eager0
    view.abort_all()
    return {
        "mix": mix,
        "batch": bs,
        "graph_ms": graph_ms,
        "graph_ms_from_idle": graph_idle_ms,
        "gpu_ms": gpu_ms,
        "eager_ms": eager_ms,
        "eager_steps": eager_steps,
        "host_ms_per_step": host_ms,
        "host_ms_median": host_median_ms,
        "kv_bytes": kv,
        "weight_bytes": wbytes,
        "achieved_tb_s": (wbytes + kv) / (graph_ms / 1e3) / 1e12,
        "tokens_per_s": bs / (graph_ms / 1e3),
    }


def decode_grid(
    llm: LLM,
    batches: list[int],
    steps: int,
    weights: dict,
    host_steps: int = 100,
    prompt_len: int = PROMPT_LEN,
) -> list[dict]:
    """Every (mix, batch) point, text then image then mixed."""
    rows = []
    for mix in ("text", "image", "mixed"):
        for bs in batches:
            wbytes = weights["text" if mix == "text" else "cross"]
            r = decode_point(llm, mix, bs, steps, wbytes, host_steps, prompt_len)
            rows.append(r)
            print(
                f"decode {mix:6s} bs={bs:4d}: graph {r['graph_ms']:7.2f} ms (from idle "
                f"{r['graph_ms_from_idle']:6.2f}, gpu {r['gpu_ms']:6.2f}), "
                f"eager {r['eager_ms']:7.2f} ms, host {r['host_ms_per_step']:.3f} ms (median "
                f"{r['host_ms_median']:.3f})",
                flush=True,
            )
    return rows


def ttft_breakdown(llm: LLM, iters: int = 5) -> dict:
    """Median TTFT of one 4-tile image + 128 tokens, with the vision tower and projector
    timed alone (the rest is the text prefill and host work)."""
    view = EngineView(llm)
    processed = view.process(make_prompt(llm, True, 128, 99))
    times = prefill_times_ms(llm, processed, iters, "ttft")
    model = view.model
    pv, ar, tiles = view.image_inputs(processed, view.runner.device)

    def ev(fn) -> float:
        return event_ms(fn, iters) if torch.cuda.is_available() else float("nan")

    with torch.inference_mode():
        feats = model.vision_model(pv, ar, tiles)
        vision_ms = ev(lambda: model.vision_model(pv, ar, tiles))
        proj_ms = ev(lambda: model.multi_modal_projector(feats))
    return {
        "ttft_ms": float(np.median(times[1:])),
        "vision_ms": vision_ms,
        "projection_ms": proj_ms,
        "text_prefill_ms": float(np.median(times[1:])) - vision_ms - proj_ms,
    }


def add_floor_ratios(ttft: dict) -> None:
    """TTFT over its floor as defined, and over the floor with the split padding-row kernel."""
    ttft["over_floor"] = ttft["ttft_ms"] / ttft["floor"]["floor_ms"]
    ttft["over_floor_split_padding_rows"] = (
        ttft["ttft_ms"] / ttft["floor"]["floor_ms_split_padding_rows"]
    )


def hf_anchor(llm: LLM) -> dict:
    """HF transformers generate() on the same weights (the engine's cache and graphs freed)."""
    from transformers import AutoProcessor

    view = EngineView(llm)
    view.release_for_hf()
    path = view.model_path()
    hf = hf_model_from(view.model, path)
    proc = AutoProcessor.from_pretrained(path)
    return {f"bs{b}": hf_generate_times(hf, proc, noise_image(1120, 5), 128, b) for b in (1, 8)}


def parse_args(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    """The report's command line."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--host-steps",
        type=int,
        default=100,
        help="steady steps over which host time per step is measured",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script itself on the tiny model (no timings)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the whole report; writes report.json and summary.json under ``--out``."""
    args = parse_args(argv, prog)
    if args.smoke:
        return smoke(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    report["copy_tb_s"] = copy_bandwidth()
    t0 = time.perf_counter()
    llm = dummy_11b(max(batches), 0.6, limit_mm_per_prompt={"image": 1})
    view = EngineView(llm)
    report["startup_s"] = time.perf_counter() - t0
    report.update(view.startup())
    lo = view.layout
    per_req = -(-2048 // lo.block_size) + -(-6404 // lo.cross_block_size)
    report["capacity_4tile_2k"] = report["kv_pages"] // per_req
    model = view.model
    floors = {k: gemv_floor(model, 1, k == "cross") for k in ("cross", "text")}
    report["floor"] = floors
    weights = {k: v["bytes"] for k, v in floors.items()}
    print(
        f"copy {report['copy_tb_s']:.2f} TB/s; floors: cross {floors['cross']['ms']:.2f} ms, "
        f"text {floors['text']['ms']:.2f} ms",
        flush=True,
    )
    report["ttft"] = ttft_breakdown(llm)
    with torch.inference_mode():
        report["ttft"]["floor"] = ttft_floor(model, report["copy_tb_s"])
    add_floor_ratios(report["ttft"])
    report["decode"] = decode_grid(llm, batches, args.steps, weights, args.host_steps)
    stats = view.stats
    replays = sum(stats.graph_replays.values())
    fallbacks = stats.eager_decode_steps - sum(r["eager_steps"] for r in report["decode"])
    report["graph_replay_fraction"] = replays / max(replays + fallbacks, 1)
    if not args.skip_hf:
        report["hf"] = hf_anchor(llm)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    write_summary(report, out)


def smoke(args: argparse.Namespace) -> None:
    """Runs the measurement code paths on the tiny demo model on CPU."""
    llm = tiny_llm()
    weights = {"cross": 1, "text": 1}
    report = {
        "copy_tb_s": 1.0,
        "floor": {"cross": {"ms": 1.0}, "text": {"ms": 1.0}},
        "ttft": ttft_breakdown(llm, iters=1),
        "startup_s": 0,
        "capture_s": 0,
        "graph_memory_gib": 0,
        "kv_pages": 0,
        "capacity_4tile_2k": 0,
        "decode": decode_grid(llm, [1, 2, 4], 2, weights, 2, prompt_len=40),
        "graph_replay_fraction": 1.0,
    }
    with torch.inference_mode():
        report["ttft"]["floor"] = ttft_floor(EngineView(llm).model, 1.0)
    add_floor_ratios(report["ttft"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_summary(report, Path(args.out))


def summarize(report: dict) -> dict:
    """The figure of each target (``summary.json``)."""
    d = {(r["mix"], r["batch"]): r for r in report["decode"]}
    return {
        "decode_bs1_image_ms": d[("image", 1)]["graph_ms"],
        "floor_cross_ms": report["floor"]["cross"]["ms"],
        "decode_bs1_text_ms": d[("text", 1)]["graph_ms"],
        "floor_text_ms": report["floor"]["text"]["ms"],
        "ttft_image_ms": report["ttft"]["ttft_ms"],
        "ttft_over_component_floors": report["ttft"].get("over_floor"),
        "ttft_over_floors_split_padding_rows": report["ttft"].get("over_floor_split_padding_rows"),
        "bs64_mixed_bandwidth_fraction": (
            d[("mixed", 64)]["achieved_tb_s"] / report["copy_tb_s"] if ("mixed", 64) in d else None
        ),
        "graph_replay_fraction": report["graph_replay_fraction"],
        "hf_bs1_image_ms": report.get("hf", {}).get("bs1", {}).get("ms_per_step"),
        "copy_tb_s": report["copy_tb_s"],
    }


def write_summary(report: dict, out: Path) -> None:
    """Writes ``summary.json`` and prints the decode table, the summary and the start-up."""
    summary = summarize(report)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        "\n| mix | bs | graph ms | from idle | gpu ms | eager ms | host ms (median) | tok/s "
        "| TB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["decode"]:
        print(
            f"| {r['mix']} | {r['batch']} | {r['graph_ms']:.2f} | "
            f"{r['graph_ms_from_idle']:.2f} | {r['gpu_ms']:.2f} | "
            f"{r['eager_ms']:.2f} | {r['host_ms_per_step']:.3f} ({r['host_ms_median']:.3f}) | "
            f"{r['tokens_per_s']:.0f} | "
            f"{r['achieved_tb_s']:.2f} |"
        )
    print(json.dumps(summary, indent=1))
    print(
        json.dumps(
            {
                k: report.get(k)
                for k in (
                    "startup_s",
                    "capture_s",
                    "vision_capture_s",
                    "graph_memory_gib",
                    "kv_pages",
                    "capacity_4tile_2k",
                    "ttft",
                )
            },
            indent=1,
            default=str,
        )
    )
