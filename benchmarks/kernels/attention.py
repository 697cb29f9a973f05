"""The Triton paged decode attention kernels and the prefill attention, with achieved bandwidth.

Shapes are Llama 3.2 11B's (32 query / 8 KV heads of 128, bf16): paged self decode (page 16)
over batch x KV length, cross decode (page 64) over 6,404 vision tokens; causal 8k prefill
(SDPA) and the ranged cross prefill over 6,404 vision tokens (Triton, unsplit and split over
keys, against SDPA). The vision tower's attention is ``python -m benchmarks.kernels vision``.

Decode is timed as CUDA-graph replays of back-to-back calls, each on the next layer of a page
pool whose working set is several times the L2 (as a decode step walks its layers), so
Python's launch overhead is excluded and K/V are not served from L2. The copy bandwidth is
measured in the same run (bytes read + written); each decode row reports its fraction of it,
counting the bytes of K/V read plus the query read and the output written.

    python -m benchmarks.kernels attention [--quick] [--prefill-only] [--row-chunks]
        [--json PATH]
        [--num-segments 64 --block-n 64 --min-chunk 128 --num-warps 4 --num-stages 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth_gb_s, time_graph_us
from vllm.attention.ops import sdpa as sdpa_ops
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_prefill import (
    default_prefill_config,
    ranged_cross_attention,
    split_count,
)

HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
SELF_PAGE, CROSS_PAGE, CROSS_LEN = 16, 64, 6404


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


def bench_decode(
    kind: str,
    batch: int,
    kv_len: int,
    page: int,
    cfg: DecodeConfig,
    copy_gb_s: float,
    chunk: str = "",
) -> Row:
    """Paged decode over ``batch`` sequences of ``kv_len`` tokens, pages scattered at random.

    ``chunk``: the rows are one row chunk instead (one sequence's pages; self: lengths
    ``kv_len .. kv_len + batch - 1``, cross: all ``kv_len``), read row by row ("alone") or
    with the page-sharing ids of the decode graphs ("served"). Their bandwidth counts the
    sequence's K/V once, so it shows what sharing the reads buys."""
    torch.cuda.empty_cache()  # hand the previous point's pool back before allocating this one
    elt = torch.empty((), dtype=DTYPE).element_size()
    causal = chunk and kind.startswith("self")
    seqs = 1 if chunk else batch
    pages_per_seq = math.ceil((kv_len + (batch if causal else 0)) / page)
    num_pages = seqs * pages_per_seq + 1  # + the null page
    layer_bytes = num_pages * 2 * HKV * page * HEAD_DIM * elt
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    layers = max(1, min(64, math.ceil(4 * l2 / layer_bytes)))
    pool = torch.empty(num_pages, layers, 2, HKV, page, HEAD_DIM, dtype=DTYPE, device="cuda")
    pool.normal_()  # random data, never zeros
    perm = torch.randperm(num_pages - 1, device="cuda")[: seqs * pages_per_seq] + 1
    tables = perm.view(seqs, pages_per_seq).to(torch.int32).expand(batch, -1).contiguous()
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    if causal:
        seq_lens += torch.arange(batch, dtype=torch.int32, device="cuda")
    kv_ids = torch.zeros(batch, dtype=torch.int32, device="cuda") if chunk == "served" else None
    query = torch.randn(batch, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5

    def call(layer: int) -> Callable[[], object]:
        kc, vc = pool[:, layer, 0], pool[:, layer, 1]
        return lambda: paged_decode_attention(
            query, kc, vc, tables, seq_lens, scale, config=cfg, kv_ids=kv_ids
        )

    n_calls = max(layers, 16)
    us = time_graph_us([call(i % layers) for i in range(n_calls)])
    nbytes = seqs * int(seq_lens.max()) * 2 * HKV * HEAD_DIM * elt + 2 * query.nbytes
    gb_s = nbytes / (us * 1e-6) / 1e9
    note = f"{layers} layers" + (f", row chunk {chunk}" if chunk else "")
    return Row(kind, batch, kv_len, us, gb_s, 100 * gb_s / copy_gb_s, note=note)


def bench_row_chunks(cfg: DecodeConfig, copy_gb_s: float) -> list[Row]:
    """A chat turn's new tokens as rows of the decode graph (issue #30's second turn: 50 new
    tokens over about 1,000 cached ones and one 4-tile image), read alone and served; the
    served case also at 8 and 16 rows a program (a 32- and 64-row tile)."""
    rows = []
    for kind, kv_len, page in (("self decode", 1024, SELF_PAGE),
                               ("cross decode", CROSS_LEN, CROSS_PAGE)):
        for n in (16, 50, 128):
            rows.append(bench_decode(kind, n, kv_len, page, cfg, copy_gb_s, chunk="alone"))
            for r in (0, 8, 16):
                c = dataclasses.replace(cfg, rows=r)
                row = bench_decode(kind, n, kv_len, page, c, copy_gb_s, chunk="served")
                row.note += f" (rows {r or 'auto'})"
                rows.append(row)
    return rows


def _bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def bench_prefill() -> list[Row]:
    """Causal 8k-token GQA prefill (SDPA) and ranged cross prefill (Triton vs SDPA)."""
    n = 8192
    q = torch.randn(n, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(n, HKV, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in range(2))
    scale = HEAD_DIM**-0.5
    causal_flops = 2 * HQ * HEAD_DIM * n * n  # half of the 4 * H * D * n^2 of a full square
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    ms = _bench_ms(
        lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )
    )
    rows = [Row("prefill causal sdpa", 1, n, ms * 1e3, tflops=causal_flops / (ms * 1e-3) / 1e12)]
    for t in (16, 128, 256, 512, 1024):  # short and one image prompt's text; long ones
        rows += bench_cross_prefill(t, scale)
    return rows


def bench_cross_prefill(t: int, scale: float) -> list[Row]:
    """``t`` queries over 6,404 vision keys: Triton unsplit and at several key splits (the
    back-end's automatic count among them), SDPA, and SDPA as the back-end runs it."""
    vk, vv = (torch.randn(CROSS_LEN, HKV, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in "kv")
    kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (vk, vv))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    vq = torch.randn(t, HQ, HEAD_DIM, dtype=DTYPE, device="cuda")
    ranges = torch.tensor([[0, CROSS_LEN]] * t, dtype=torch.int32, device="cuda")
    qt = vq.transpose(0, 1).unsqueeze(0)
    auto = split_count(t, HQ, CROSS_LEN, sms, default_prefill_config(DTYPE))
    cases = {
        "prefill ranged cross triton": lambda: ranged_cross_attention(vq, vk, vv, ranges, scale),
        "prefill cross sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, scale=scale, enable_gqa=True
        ),
        # What the back-end's SDPA path runs (zero-filled output, one call per run).
        "prefill cross sdpa runs": lambda: sdpa_ops.ranged_cross_attention(
            vq, vk, vv, [(0, t, 0, CROSS_LEN)], scale
        ),
    }
    for n in sorted({2, 4, 8, auto} - {1}):
        cases[f"prefill ranged cross triton/{n} splits"] = lambda n=n: ranged_cross_attention(
            vq, vk, vv, ranges, scale, num_splits=n
        )
    flops = 4 * HQ * HEAD_DIM * t * CROSS_LEN
    rows = []
    for name, fn in cases.items():
        ms = _bench_ms(fn)
        rows.append(
            Row(
                name, 1, CROSS_LEN, ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12, note=f"{t} queries"
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""

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


def write_json(path: str | None, rows: list[Row], **extra: object) -> None:
    """The rows (and ``extra`` fields) as JSON, with the device name."""
    if path:
        with open(path, "w") as fh:
            json.dump(
                {
                    **extra,
                    "device": torch.cuda.get_device_name(),
                    "rows": [dataclasses.asdict(r) for r in rows],
                },
                fh,
                indent=1,
            )


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        num_segments=args.num_segments,
        block_n=args.block_n,
        min_chunk=args.min_chunk,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the decode points (and the prefill unless ``--quick``); prints the table."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few decode points only")
    parser.add_argument("--prefill-only", action="store_true", help="the prefill cases only")
    parser.add_argument("--row-chunks", action="store_true",
                        help="a row chunk's rows read alone and served together only")
    parser.add_argument("--json", type=str, default=None, help="also write the rows here")
    defaults = DecodeConfig()
    for field in ("num_segments", "block_n", "min_chunk", "num_warps", "num_stages"):
        parser.add_argument(
            f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field)
        )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA device")
    cfg = decode_config(args)
    torch.manual_seed(0)
    if args.prefill_only:
        rows = bench_prefill()
        print(format_table(rows))
        write_json(args.json, rows)
        return
    copy_gb_s = copy_bandwidth_gb_s()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gb_s:.0f} GB/s; {cfg}")
    if args.row_chunks:
        rows = bench_row_chunks(cfg, copy_gb_s)
        print(format_table(rows))
        write_json(args.json, rows, copy_gb_s=copy_gb_s, config=dataclasses.asdict(cfg))
        return
    batches, lengths = (
        ((1, 64), (4096,)) if args.quick else ((1, 8, 32, 64, 128), (512, 4096, 32768))
    )
    rows = [
        bench_decode("self decode", batch, length, SELF_PAGE, cfg, copy_gb_s)
        for length in lengths
        for batch in batches
    ]
    for batch in (1, 32) if args.quick else (1, 8, 32, 64):
        rows.append(bench_decode("cross decode", batch, CROSS_LEN, CROSS_PAGE, cfg, copy_gb_s))
    if not args.quick:
        rows += bench_prefill()
    print(format_table(rows))
    write_json(args.json, rows, copy_gb_s=copy_gb_s, config=dataclasses.asdict(cfg))
