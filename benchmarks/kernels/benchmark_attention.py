"""Microbenchmark of the Triton attention kernels on CUDA, with achieved memory bandwidth.

Shapes are Llama 3.2 11B's (32 query / 8 KV heads of 128, bf16): paged self decode (page 16)
over batch x KV length, cross decode (page 64) over 6,404 vision tokens; for reference, the
vision tower's attention (6,432 tokens x 16 heads x 80) three ways and causal / ranged prefill.

Decode is timed as CUDA-graph replays of back-to-back calls, each on the next layer of a page
pool whose working set is several times the L2 (as a decode step walks its layers), so
Python's launch overhead is excluded and K/V are not served from L2. The copy bandwidth is
measured in the same run (bytes read + written); each decode row reports its fraction of it,
counting the bytes of K/V read plus the query read and the output written.

    python benchmarks/kernels/benchmark_attention.py [--quick] [--sweep] [--json PATH]
        [--num-segments 64 --block-n 64 --min-chunk 128 --num-warps 4 --num-stages 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from vllm.attention.ops import sdpa as sdpa_ops
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_prefill import (
    PrefillConfig,
    default_prefill_config,
    ranged_cross_attention,
    split_count,
)
from vllm.attention.ops.vision_attention import (
    HALF_PADDING_TILE,
    padding_rows_attention,
    padding_rows_ranges,
    sdpa,
    vision_attention,
)

HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
SELF_PAGE, CROSS_PAGE, CROSS_LEN = 16, 64, 6404
VISION_TOKENS, VISION_HEADS, VISION_DIM = 6432, 16, 80


@dataclass
class Row:
    """One measured point; bandwidth columns are None where the kernel is compute-bound."""

    kernel: str
    batch: int
    kv_len: int
    time_us: float
    gb_per_s: float | None = None
    pct_of_copy: float | None = None
    tflops: float | None = None
    note: str = ""


def copy_bandwidth_gb_s() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / median time."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of fp32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    gb_s = 2 * src.nbytes / (ms * 1e-3) / 1e9
    return gb_s


def time_graph_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Median microseconds per call of one CUDA graph that runs ``calls`` back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for fn in calls[: min(len(calls), 2)]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(samples)


def bench_decode(
    kind: str, batch: int, kv_len: int, page: int, cfg: DecodeConfig, copy_gb_s: float
) -> Row:
    """Paged decode over ``batch`` sequences of ``kv_len`` tokens, pages scattered at random."""
    torch.cuda.empty_cache()  # hand the previous point's pool back before allocating this one
    elt = torch.empty((), dtype=DTYPE).element_size()
    pages_per_seq = math.ceil(kv_len / page)
    num_pages = batch * pages_per_seq + 1  # + the null page
    layer_bytes = num_pages * 2 * HKV * page * HEAD_DIM * elt
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    layers = max(1, min(64, math.ceil(4 * l2 / layer_bytes)))
    pool = torch.empty(num_pages, layers, 2, HKV, page, HEAD_DIM, dtype=DTYPE, device="cuda")
    pool.normal_()  # random data, never zeros
    perm = torch.randperm(num_pages - 1, device="cuda")[: batch * pages_per_seq] + 1
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5

    def call(layer: int) -> Callable[[], object]:
        kc, vc = pool[:, layer, 0], pool[:, layer, 1]
        return lambda: paged_decode_attention(query, kc, vc, tables, seq_lens, scale, config=cfg)

    n_calls = max(layers, 16)
    us = time_graph_us([call(i % layers) for i in range(n_calls)])
    nbytes = batch * kv_len * 2 * HKV * HEAD_DIM * elt + 2 * query.nbytes
    gb_s = nbytes / (us * 1e-6) / 1e9
    return Row(kind, batch, kv_len, us, gb_s, 100 * gb_s / copy_gb_s, note=f"{layers} layers")


def bench_vision() -> list[Row]:
    """The vision tower's attention per tile count: maskless (no padding rule), the old path
    (maskless + padding rows by SDPA), two SDPA calls joined, the model's choice
    (``vision_attention``), and a dense padding mask."""
    length, h, d = VISION_TOKENS, VISION_HEADS, VISION_DIM
    qkv = torch.randn(1, length, 3 * h * d, dtype=DTYPE, device="cuda")
    q, k, v = (t.view(1, length, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
    full_flops = 4 * h * d * length * length
    rows = []

    def add(name: str, fn: Callable[[], object], note: str) -> None:
        us = time_graph_us([fn] * 10)
        rows.append(Row(name, 1, length, us, tflops=full_flops / (us * 1e-6) / 1e12, note=note))

    add("vision sdpa maskless", lambda: sdpa(q, k, v), "no padding")
    for tiles in (4, 3, 2, 1):
        valid = tiles * 1601

        def split(n: int = valid) -> torch.Tensor:
            out_valid = sdpa(q[:, :, :n], k, v)
            out_pad = sdpa(q[:, :, n:], k[:, :, :n], v[:, :, :n])
            return torch.cat((out_valid.transpose(1, 2), out_pad.transpose(1, 2)), dim=1)

        def fixup(n: int = valid) -> torch.Tensor:
            out = sdpa(q, k, v)
            out[:, :, n:] = sdpa(q[:, :, n:], k[:, :, :n], v[:, :, :n])
            return out

        ranges = padding_rows_ranges(length, valid, q.device)
        note = f"{tiles} tiles, {valid} valid"
        add("vision sdpa 2-call split", split, note)
        add("vision maskless + pad rows", fixup, note)
        add("vision_attention (model)",
            lambda n=valid, r=ranges: vision_attention(q, k, v, n, r),
            note + (", split pad kernel" if ranges is not None else ", 2 calls"))
        pad = torch.arange(length, device="cuda") >= valid
        mask = torch.zeros(1, 1, length, length, dtype=DTYPE, device="cuda")
        mask.masked_fill_(pad[:, None] & pad[None, :], torch.finfo(DTYPE).min)
        add("vision sdpa dense mask",
            lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m), note)
    return rows


def bench_padding_rows(sweep: bool) -> list[Row]:
    """The padding rows of a 4-tile image alone (28 queries over 6,404 valid keys): SDPA (what
    the floor counts) against the split kernel, at its defaults or over a sweep of tiles and
    split counts."""
    length, valid, h, d = VISION_TOKENS, 4 * 1601, VISION_HEADS, VISION_DIM
    q, k, v = (torch.randn(1, h, length, d, dtype=DTYPE, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    ranges = padding_rows_ranges(length, valid, q.device)
    flops = 4 * h * d * (length - valid) * valid
    cases = {"pad rows sdpa": (lambda: sdpa(q[:, :, valid:], k[:, :, :valid], v[:, :, :valid]),
                               "cuDNN"),
             "pad rows split": (lambda: padding_rows_attention(q, k, v, out, valid, ranges),
                                f"default {HALF_PADDING_TILE}")}
    if sweep:
        for tile in ((16, 64, 4, 2), (32, 64, 4, 2), (32, 128, 4, 2), (64, 64, 4, 3),
                     (64, 128, 8, 3), (128, 64, 8, 3)):
            for n in (8, 16, 32, 64):
                cfg = PrefillConfig(*tile)
                cases[f"pad rows split {n} {tile}"] = (
                    lambda cfg=cfg, n=n: padding_rows_attention(q, k, v, out, valid, ranges,
                                                                config=cfg, num_splits=n),
                    f"{n} splits, tile {tile}")
    rows = []
    for name, (fn, note) in cases.items():
        us = time_graph_us([fn] * 20)
        rows.append(Row(name, 1, valid, us, tflops=flops / (us * 1e-6) / 1e12, note=note))
    return rows


def bench_prefill() -> list[Row]:
    """Causal 8k-token GQA prefill (SDPA) and ranged cross prefill (Triton vs SDPA)."""
    rows = []
    n = 8192
    q = torch.randn(n, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(n, HKV, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in range(2))
    scale = HEAD_DIM**-0.5
    causal_flops = 2 * HQ * HEAD_DIM * n * n  # half of the 4 * H * D * n^2 of a full square
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    cases = {
        "prefill causal sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        ),
    }
    for name, fn in cases.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
        rows.append(Row(name, 1, n, ms * 1e3, tflops=causal_flops / (ms * 1e-3) / 1e12))
    vk, vv = (torch.randn(CROSS_LEN, HKV, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in "kv")
    kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (vk, vv))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = default_prefill_config(DTYPE)
    for t in (16, 128, 256, 512, 1024):  # short and one image prompt's text; long ones
        vq = torch.randn(t, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
        ranges = torch.tensor([[0, CROSS_LEN]] * t, dtype=torch.int32, device="cuda")
        qt = vq.transpose(0, 1).unsqueeze(0)
        auto = split_count(t, HQ, CROSS_LEN, sms, cfg)
        cases = {
            "prefill ranged cross triton": lambda vq=vq, r=ranges: ranged_cross_attention(
                vq, vk, vv, r, scale),
            "prefill cross sdpa": lambda qt=qt: F.scaled_dot_product_attention(
                qt, kt, vt, scale=scale, enable_gqa=True
            ),
            # What the back-end's SDPA path runs (zero-filled output, one call per run).
            "prefill cross sdpa runs": lambda vq=vq, t=t: sdpa_ops.ranged_cross_attention(
                vq, vk, vv, [(0, t, 0, CROSS_LEN)], scale),
        }
        for n in sorted({2, 4, 8, auto} - {1}):
            cases[f"prefill ranged cross triton/{n} splits"] = (
                lambda vq=vq, r=ranges, n=n: ranged_cross_attention(vq, vk, vv, r, scale,
                                                                    num_splits=n))
        flops = 4 * HQ * HEAD_DIM * t * CROSS_LEN
        for name, fn in cases.items():
            ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            rows.append(Row(name, 1, CROSS_LEN, ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12,
                            note=f"{t} queries"))
    return rows


def sweep(base: DecodeConfig, copy_gb_s: float) -> list[Row]:
    """One knob at a time around ``base`` on the three headline decode points."""
    variants = [base]
    for field, values in (
        ("num_segments", (16, 32, 128)),
        ("block_n", (32, 128)),
        ("min_chunk", (256, 512)),
        ("num_warps", (2, 8)),
        ("num_stages", (1, 3)),
    ):
        for value in values:
            changes = {field: value}
            if field == "block_n":
                changes["min_chunk"] = max(base.min_chunk, value)
            variants.append(dataclasses.replace(base, **changes))
    rows = []
    for cfg in variants:
        tag = (
            f"seg={cfg.num_segments} bn={cfg.block_n} mc={cfg.min_chunk} "
            f"w={cfg.num_warps} st={cfg.num_stages}"
        )
        for kind, batch, length, page in (
            ("cross decode", 1, CROSS_LEN, CROSS_PAGE),
            ("self decode", 64, 4096, SELF_PAGE),
            ("self decode", 1, 32768, SELF_PAGE),
        ):
            row = bench_decode(kind, batch, length, page, cfg, copy_gb_s)
            row.note = tag
            rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = f"{'kernel':<30} {'batch':>5} {'kv_len':>7} {'time us':>10} {'GB/s':>8} "
    head += f"{'% copy':>7} {'TFLOP/s':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.kernel:<30} {r.batch:>5} {r.kv_len:>7} {r.time_us:>10.1f} "
            f"{f(r.gb_per_s, '8.0f')} {f(r.pct_of_copy, '6.1f')}% "
            f"{f(r.tflops, '8.1f')}  {r.note}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--sweep", action="store_true", help="sweep decode knobs one at a time")
    parser.add_argument("--json", type=str, default=None, help="also write the rows here")
    parser.add_argument("--prefill-only", action="store_true", help="the prefill cases only")
    parser.add_argument("--vision-only", action="store_true",
                        help="the vision tower's attention and its padding rows only")
    parser.add_argument("--padding-sweep", action="store_true",
                        help="sweep the padding-row kernel's tiles and split counts")
    defaults = DecodeConfig()
    for field in ("num_segments", "block_n", "min_chunk", "num_warps", "num_stages"):
        parser.add_argument(
            f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field)
        )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_attention.py needs a CUDA device")
    cfg = DecodeConfig(
        num_segments=args.num_segments,
        block_n=args.block_n,
        min_chunk=args.min_chunk,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
    )
    torch.manual_seed(0)
    copy_gb_s = copy_bandwidth_gb_s()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gb_s:.0f} GB/s; {cfg}")
    batches, lengths = (
        ((1, 64), (4096,)) if args.quick else ((1, 8, 32, 64, 128), (512, 4096, 32768))
    )
    rows = []
    if args.vision_only:
        rows = bench_vision() + bench_padding_rows(args.padding_sweep)
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
        return
    if args.prefill_only:
        print(format_table(bench_prefill()))
        return
    for length in lengths:
        for batch in batches:
            rows.append(bench_decode("self decode", batch, length, SELF_PAGE, cfg, copy_gb_s))
    for batch in (1, 32) if args.quick else (1, 8, 32, 64):
        rows.append(bench_decode("cross decode", batch, CROSS_LEN, CROSS_PAGE, cfg, copy_gb_s))
    if not args.quick:
        rows += bench_prefill()
    rows += bench_vision() + bench_padding_rows(False)
    if args.sweep:
        rows += sweep(cfg, copy_gb_s)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "copy_gb_s": copy_gb_s,
                    "config": dataclasses.asdict(cfg),
                    "device": torch.cuda.get_device_name(),
                    "rows": [dataclasses.asdict(r) for r in rows],
                },
                fh,
                indent=1,
            )
    print(format_table(rows))


if __name__ == "__main__":
    main()
