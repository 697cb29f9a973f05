"""Quantized weights against bf16 in one run: decode ms/step per batch (text-only and one 4-tile
image per request), the time of the step's linears alone, TTFT of one 4-tile image + 128 tokens,
load time, weight memory and the fraction of decode steps replayed from graphs.

Each format is an engine on dummy weights of the real shapes (``--model demo/mllama-11b`` or
``demo/mllama-90b``), built, measured and freed in turn. "Linear time" is one CUDA graph calling
every linear a decode step runs (each layer's q|k|v, o, the MLP with its SiLU epilogue, the
lm_head; the cross-attention layers' too with an image) on ``bs`` rows, through the engine's own
kernel tables at that bucket: the step minus its linears is the non-linear time the quantized
formats' targets are stated against.

    python -m benchmarks.engine quant --formats bf16,bitsandbytes --batches 1,4,16,64,128,256
    python -m benchmarks.engine quant --formats bf16,bf16@fp8,fp8,fp8@fp8   # FP8 KV cache too
    python -m benchmarks.engine quant --smoke      # tiny model on CPU: the script runs

A format is a weight format, optionally ``@`` a ``--kv-cache-dtype`` (``fp8@fp8``: FP8 weights
and an FP8 KV cache; without ``@`` the cache is ``auto``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common import (
    EngineView,
    is_cross_layer,
    make_prompt,
    prefill_times_ms,
    read_bandwidth_gb_s,
    sync,
)
from benchmarks.engine.report import replay_ms, time_decode
from vllm import LLM, SamplingParams
from vllm.forward_context import set_forward_context
from vllm.worker.memory import requests_that_fit

QUANTIZATION = {"bf16": None, "bitsandbytes": "bitsandbytes", "fp8": "fp8"}


def _stored_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def decode_modules(model: torch.nn.Module, with_cross: bool) -> list[torch.nn.Module]:
    """What a decode step multiplies by: per text layer its attention projections (q only for
    cross attention: its K/V come from the cache) and its MLP; then the lm_head."""
    mods: list[torch.nn.Module] = []
    for layer in model.language_model.model.layers:
        cross = is_cross_layer(layer)
        if cross and not with_cross:
            continue
        attn = layer.cross_attn if cross else layer.self_attn
        mods += [attn.q_proj if cross else attn.qkv_proj, attn.o_proj, layer.mlp]
    return mods


def weight_bytes(model: torch.nn.Module, with_cross: bool) -> dict:
    """Bytes a decode step reads as stored: the linears (4-bit or FP8 with their scales) and
    the lm_head (bf16 in every format here)."""
    head = model.language_model.lm_head
    return {
        "linears": sum(_stored_bytes(m) for m in decode_modules(model, with_cross)),
        "lm_head": _stored_bytes(head),
    }


def linear_ms(llm: LLM, bs: int, with_cross: bool, replays: int = 10) -> float:
    """GPU ms of one graph running every decode linear once on ``bs`` rows (NaN off CUDA)."""
    if not torch.cuda.is_available():
        return float("nan")
    view = EngineView(llm)
    model = view.model
    buckets = sorted(llm.llm_engine.config.compilation_config.cuda_graph_sizes)
    bucket = buckets.index(bs)
    hidden = model.language_model.model.embed_tokens.weight.shape[1]
    dtype = model.language_model.lm_head.weight.dtype
    dev = view.runner.device
    mods = [*decode_modules(model, with_cross), model.language_model.lm_head]
    x = torch.randn(bs, hidden, device=dev, dtype=dtype) * 0.1

    def run() -> None:
        with set_forward_context(None, row_bucket=bucket):
            for m in mods:
                m(x)

    with torch.inference_mode():
        run()
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        sync()
    del g
    return start.elapsed_time(end) / replays


def decode_point(llm: LLM, mix: str, bs: int, steps: int, prompt_len: int = 512) -> dict:
    """``bs`` requests of kind ``mix``, decode timed with graphs."""
    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(bs):
        engine.add_request(
            f"{mix}-{bs}-{i}", make_prompt(llm, mix == "image", prompt_len, i), params
        )
    while view.waiting():
        engine.step()
    cross = mix == "image"
    eager0 = view.stats.eager_decode_steps
    replays0 = sum(view.stats.graph_replays.values())
    step_ms, _ = time_decode(llm, steps)
    point = {
        "mix": mix,
        "batch": bs,
        "step_ms": step_ms,
        "gpu_ms": replay_ms(llm, cross, bs),
        "replayed": sum(view.stats.graph_replays.values()) - replays0,
        "eager": view.stats.eager_decode_steps - eager0,
    }
    view.abort_all()
    point["linear_ms"] = linear_ms(llm, bs, cross)
    return point


def ttft_ms(llm: LLM, iters: int = 5) -> float:
    """Median TTFT of one 4-tile image + 128 tokens (first call dropped)."""
    processed = EngineView(llm).process(make_prompt(llm, True, 128, 99))
    times = prefill_times_ms(llm, processed, iters, "ttft")
    return sorted(times[1:])[len(times[1:]) // 2]


def run_format(name: str, args: argparse.Namespace) -> dict:
    weights, _, kv = name.partition("@")
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype="bfloat16",
        quantization=QUANTIZATION[weights],
        kv_cache_dtype=kv or "auto",
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches),
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    result: dict = {
        "format": name,
        "kv_cache_dtype": kv or "auto",
        "engine_start_s": time.perf_counter() - t0,
    }
    view = EngineView(llm)
    model = view.model
    result["bytes_text"] = weight_bytes(model, False)
    result["bytes_image"] = weight_bytes(model, True)
    result["weight_gib"] = _stored_bytes(model) / (1 << 30)
    pages = view.engine.block_manager.pool.num_pages
    vision = view.engine.config.model_config.spec.vision
    # Capacity: requests of 2048 tokens with one 4-tile image that the KV pool holds at once.
    result["kv_pages"] = pages - 1
    result["capacity_4tile_2k"] = requests_that_fit(
        view.layout, pages, 2048, 4 * vision.tokens_per_tile
    )
    result["decode"] = []
    for mix in ("text", "image"):
        for bs in args.batches:
            p = decode_point(llm, mix, bs, args.steps, args.prompt_len)
            result["decode"].append(p)
            print(
                f"{name:12s} {mix:5s} bs={bs:3d}: step {p['step_ms']:7.2f} ms (gpu "
                f"{p['gpu_ms']:7.2f}), linears {p['linear_ms']:7.2f} ms, eager {p['eager']}",
                flush=True,
            )
    result["ttft_ms"] = ttft_ms(llm)
    print(f"{name:12s} TTFT 4-tile + 128: {result['ttft_ms']:.1f} ms", flush=True)
    del llm, model, view  # the view holds the engine too: all go before the next one
    gc.collect()
    torch.cuda.empty_cache()
    return result


def targets(results: list[dict], read_gb_s: float, frac: float) -> list[dict]:
    """Each quantized format's bs=1 step against the bf16 non-linear time + its bytes at
    ``frac`` of the read bandwidth (the lm_head at 0.9)."""
    base = {(p["mix"], p["batch"]): p for p in results[0]["decode"]}
    rows = []
    for r in results[1:]:
        for p in r["decode"]:
            b = base[(p["mix"], p["batch"])]
            nbytes = r["bytes_image" if p["mix"] == "image" else "bytes_text"]
            nonlinear = b["gpu_ms"] - b["linear_ms"]
            floor = (
                nonlinear
                + nbytes["linears"] / (frac * read_gb_s * 1e6)
                + nbytes["lm_head"] / (0.9 * read_gb_s * 1e6)
            )
            rows.append(
                {
                    "format": r["format"],
                    "mix": p["mix"],
                    "batch": p["batch"],
                    "step_ms": p["step_ms"],
                    "bf16_step_ms": b["step_ms"],
                    "vs_bf16": p["step_ms"] / b["step_ms"],
                    "nonlinear_ms": nonlinear,
                    "target_ms": floor if p["batch"] == 1 else None,
                    "linear_pct_read": 100
                    * (nbytes["linears"] + nbytes["lm_head"])
                    / (p["linear_ms"] * read_gb_s * 1e6),
                }
            )
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo/mllama-11b")
    ap.add_argument("--formats", default="bf16,bitsandbytes")
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--target-fraction", type=float, default=0.75, help="of read bandwidth")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:  # the tiny model on CPU: every code path, no meaningful times
        args.model, args.batches, args.steps = "demo/mllama-tiny", [1], 3
        args.max_model_len, args.prompt_len = 512, 64
    elif not torch.cuda.is_available():
        raise SystemExit("the quantization benchmark needs a CUDA device (or --smoke)")
    formats = args.formats.split(",")  # bf16 first: the targets are held against it
    read = read_bandwidth_gb_s() if torch.cuda.is_available() else float("nan")
    results = [run_format(f, args) for f in formats]
    table = targets(results, read, args.target_fraction) if formats[0] == "bf16" else []
    report = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "read_gb_s": read,
        "model": args.model,
        "results": results,
        "targets": table,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"read bandwidth {read:.0f} GB/s")
    print("format       mix   bs   step ms  bf16 ms  ratio  target  lin%read")
    for t in table:
        tgt = f"{t['target_ms']:6.2f}" if t["target_ms"] is not None else "     -"
        print(
            f"{t['format']:12s} {t['mix']:5s} {t['batch']:3d} {t['step_ms']:8.2f} "
            f"{t['bf16_step_ms']:8.2f} {t['vs_bf16']:6.2f} {tgt} {t['linear_pct_read']:6.1f}"
        )
    for r in results:
        print(
            f"{r['format']:12s} TTFT {r['ttft_ms']:.1f} ms, weights {r['weight_gib']:.2f} GiB, "
            f"start {r['engine_start_s']:.0f} s, {r['kv_pages']} KV pages: "
            f"{r['capacity_4tile_2k']} concurrent 4-tile 2k-token requests"
        )


if __name__ == "__main__":
    main()
