"""The model's whole context: start-up with no flags, TTFT of long prompts and decode at long
context against their floors (11B Instruct shape, dummy bf16 weights, one H200).

The engine is built as ``vllm serve demo/mllama-11b --load-format dummy`` builds it, with no
other flag (chunked prefill, the 2048-token budget, max_model_len 131072), and its start-up
split (load, vision graphs, profile, decode graphs, warm-up) is recorded. Then, one request at
a time, greedy:

- TTFT of a prompt of N tokens (8k, 32k, 64k, 128k; text, and with one 4-tile image first),
  the median of ``--iters`` after a warm-up one, against its floor: 2 x the linear
  parameters each text token goes through x N at cuBLAS's measured bf16 rate (the self
  layers; with an image also the cross layers, which a text-only prompt skips), plus causal
  self-attention over N at SDPA's measured rate, plus (image case) the vision tower: 2 x the
  parameters the vision tokens go through (vision tower, projector, cross K/V) x their count
  at the same GEMM rate and each encoder layer's attention over the image's tokens (all its
  tiles, padding left out) at SDPA's measured rate. The text tokens' cross-attention to the
  image is not in the floor. Limit: 1.3 x the floor.
- decode ms/step at bs=1 with N tokens of context (8k, 32k, 128k) against the measured
  short-context step plus the request's KV bytes at the measured read bandwidth. Limit: 1.2x.

With ``--profile DIR`` the first image prompt's TTFT is also run once under torch.profiler
(after its timed runs): ``DIR/ttft_<N>_image.txt`` lists its kernels by total CUDA time, with
the step count and the GPU's busy time against the wall time.

    python -m benchmarks.engine long-context --out /tmp/long_context.json [--profile DIR]
    python -m benchmarks.engine long-context --smoke --out /tmp/lc.json   # tiny model, CPU
    python -m benchmarks.engine long-context --lengths '' --kv-cache-dtype fp8   # FP8 KV decode
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import EngineView, fastest_sdpa, make_prompt, prefill_times_ms, sync
from vllm import LLM, SamplingParams

TTFT_LIMIT = 1.3
DECODE_LIMIT = 1.2


def _timed_ms(fn, iters: int) -> float:
    """Median wall ms of ``iters`` calls after one warm-up call, synchronized."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def gemm_flops_per_s(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """cuBLAS's (torch.matmul's) rate on an n x n x n product in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _timed_ms(lambda: a @ b, 5)
    return 2 * n**3 / (ms * 1e-3)


def sdpa_ms(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    causal: bool = True,
) -> float:
    """One layer's self-attention over ``tokens`` (SDPA, grouped keys expanded)."""
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return _timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 3)


def vision_attention_ms(spec, tokens: int, device: torch.device, dtype: torch.dtype) -> float:
    """The vision tower's attention for one image of ``tokens`` tokens: every encoder layer
    (local and global) attends over all of them, at SDPA's rate without a mask (its fastest
    kernel, as the image-prefill floor of ``floors.py`` takes it)."""
    v = spec.vision
    heads = v.attention_heads
    with fastest_sdpa():
        one = sdpa_ms(tokens, heads, heads, v.head_dim, device, dtype, causal=False)
    return one * (v.num_hidden_layers + v.num_global_layers)


def read_gb_s(device: torch.device, gib: float) -> float:
    """Read bandwidth: bytes of a float32 sum / its median time."""
    x = torch.randn(int(gib * (1 << 28)), device=device)
    ms = _timed_ms(lambda: x.sum(), 10)
    return x.nbytes / (ms * 1e-3) / 1e9


def linear_params(module: torch.nn.Module) -> int:
    """Weights of the matrix products a token goes through (2-D parameters, embeddings out)."""
    return sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2 and "embed" not in n)


def ttft_floor_ms(
    model,
    spec,
    tokens: int,
    vision_tokens: int,
    gemm_rate: float,
    attention_ms: float,
    vision_attention: float = 0.0,
) -> float:
    """The linears each token goes through at ``gemm_rate`` plus causal self-attention
    (``attention_ms`` a self layer). A text-only prompt skips the cross layers; with an image
    their K/V projections (and the vision tower, the projector) run on the vision tokens, the
    rest of them on the text, and the tower's attention (``vision_attention`` ms) is added."""
    layers = model.language_model.model.layers
    cross = set(spec.text.cross_attention_layers)
    per_text = per_vision = 0
    for i, layer in enumerate(layers):
        if i not in cross:
            per_text += linear_params(layer)
        elif vision_tokens:
            kv = linear_params(layer.cross_attn.kv_proj)
            per_text += linear_params(layer) - kv
            per_vision += kv
    if vision_tokens:
        per_vision += linear_params(model.vision_model) + linear_params(model.multi_modal_projector)
    gemm = 2 * (per_text * tokens + per_vision * vision_tokens)
    attention = (len(layers) - len(cross)) * attention_ms
    return gemm / gemm_rate * 1e3 + attention + (vision_attention if vision_tokens else 0.0)


def decode_ms_per_step(llm: LLM, n_tokens: int, steps: int) -> float:
    """Median ms per step of one request's decode with ``n_tokens`` of prompt (the steps after
    its first token, i.e. once its prefill is done)."""
    engine, view = llm.llm_engine, EngineView(llm)
    processed = view.process(make_prompt(llm, False, n_tokens, 7))
    view.add_processed(
        f"decode-{n_tokens}-{time.perf_counter_ns()}",
        processed,
        SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True),
    )
    started = False
    while not started and engine.has_unfinished_requests():
        started = any(o.outputs[0].token_ids for o in engine.step())
    times = []
    while engine.has_unfinished_requests():
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times = times[1:-1] or times  # the first may still overlap the prefill, the last drains
    return sorted(times)[len(times) // 2]


def profile_ttft(llm: LLM, processed, path: Path) -> None:
    """One TTFT of ``processed`` under torch.profiler: kernels by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=1)
    view.add_processed(f"profile-{time.perf_counter_ns()}", processed, params)
    sync()
    steps = 0
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync()
    wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    head = f"{steps} steps, wall {wall:.1f} ms (profiled), kernels {busy:.1f} ms\n"
    table = prof.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40
    )
    path.write_text(head + table)
    print(head, end="")


def no_flag_llm(model: str, smoke: bool, kv_cache_dtype: str = "auto") -> LLM:
    """The engine `vllm serve MODEL --load-format dummy` builds: EngineArgs' serving defaults
    (chunked prefill, the 2048-token budget, the model's whole context), with
    ``--kv-cache-dtype`` if given. The smoke run caps the context and the batch for the CPU."""
    kwargs = dict(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=64) if smoke else {}
    return LLM(
        model=model,
        load_format="dummy",
        enable_chunked_prefill=True,
        kv_cache_dtype=kv_cache_dtype,
        **kwargs,
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, short contexts")
    ap.add_argument("--profile", default=None, help="directory for the profiled image TTFT")
    ap.add_argument("--lengths", default=None, help="TTFT prompt lengths (default 8k-128k)")
    ap.add_argument("--decode-lengths", default=None, help="decode contexts ('' for none)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2")
    args = ap.parse_args(argv)
    if args.smoke:
        model, ttft_lens, decode_lens, iters, steps = "demo/mllama-tiny", (256, 512), (256,), 1, 4
        short = 32
    else:
        model, ttft_lens, decode_lens = (
            "demo/mllama-11b",
            (8192, 32768, 65536, 131072),
            (8192, 32768, 131072),
        )
        iters, steps, short = args.iters, args.decode_steps, 128
    if args.lengths is not None:
        ttft_lens = tuple(int(n) for n in args.lengths.split(",") if n)
    if args.decode_lengths is not None:
        decode_lens = tuple(int(n) for n in args.decode_lengths.split(",") if n)
    llm = no_flag_llm(model, args.smoke, args.kv_cache_dtype)
    engine, view = llm.llm_engine, EngineView(llm)
    cfg = engine.config
    spec, device, dtype = cfg.model_config.spec, engine.runner.device, cfg.model_config.dtype
    startup = engine.startup_times
    out: dict = {
        "model": model,
        "kv_cache_dtype": cfg.cache_config.kv_cache_dtype,
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "startup_s": {**startup.parts(), "total": startup.total},
    }
    print(startup.describe())

    t = spec.text
    gemm_rate = gemm_flops_per_s(device, dtype, 1024 if args.smoke else 8192)
    out["gemm_tflops"] = gemm_rate / 1e12
    vision_tokens = 4 * spec.vision.tokens_per_tile
    vision_attn = vision_attention_ms(spec, vision_tokens, device, dtype)
    out["vision_attention_ms"] = vision_attn
    rows = []
    for n in ttft_lens:
        n = min(n, cfg.model_config.max_model_len - 8)
        attn = sdpa_ms(n, t.num_attention_heads, t.num_key_value_heads, t.head_dim, device, dtype)
        for image in (False, True):
            processed = view.process(make_prompt(llm, image, n, n))
            ms = prefill_times_ms(llm, processed, iters, "ttft")
            if image and args.profile and n == ttft_lens[0]:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                profile_ttft(llm, processed, Path(args.profile) / f"ttft_{n}_image.txt")
            ttft = sorted(ms[1:])[len(ms[1:]) // 2]
            floor = ttft_floor_ms(
                view.model, spec, n, vision_tokens if image else 0, gemm_rate, attn, vision_attn
            )
            rows.append(
                {
                    "tokens": n,
                    "image": image,
                    "ttft_ms": ttft,
                    "floor_ms": floor,
                    "ratio": ttft / floor,
                    "ok": ttft <= TTFT_LIMIT * floor,
                }
            )
            print(
                f"TTFT {n:>7} tokens{' + 4-tile image' if image else ''}: {ttft:9.1f} ms, "
                f"floor {floor:9.1f} ms, {ttft / floor:.2f}x (limit {TTFT_LIMIT}x)"
            )
    out["ttft"] = rows

    bandwidth = read_gb_s(device, 0.25 if args.smoke else 4.0)
    out["read_gb_s"] = bandwidth
    decode_ms_per_step(llm, short, steps)  # first uses of the decode path
    base = decode_ms_per_step(llm, short, steps)
    out["decode_short_ms"] = base
    drows = []
    for n in decode_lens:
        n = min(n, cfg.model_config.max_model_len - steps - 4)
        ms = decode_ms_per_step(llm, n, steps)
        kv = view.layout.pages_for_tokens(n) * view.layout.page_bytes
        floor = base + kv / (bandwidth * 1e9) * 1e3
        drows.append(
            {
                "context": n,
                "ms_per_step": ms,
                "floor_ms": floor,
                "ratio": ms / floor,
                "ok": ms <= DECODE_LIMIT * floor,
            }
        )
        print(
            f"decode bs=1 at {n:>7} tokens: {ms:7.2f} ms/step, floor {floor:7.2f} ms "
            f"({base:.2f} + {kv / 2**30:.2f} GiB of KV at {bandwidth:.0f} GB/s), "
            f"{ms / floor:.2f}x (limit {DECODE_LIMIT}x)"
        )
    out["decode"] = drows
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
