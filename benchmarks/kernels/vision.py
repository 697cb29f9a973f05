"""The vision tower's attention and the row-wise pieces of its layers (CUDA).

Attention over one image's 6,432 padded tokens x 16 heads x 80 (4 tiles of 1,608; 1,601 valid
per tile), per tile count: maskless (no padding rule), the old path (maskless + padding rows by
SDPA), two SDPA calls joined, the model's choice (``vision_attention``) and a dense padding
mask. Then the padding rows of a 4-tile image alone (28 queries over 6,404 valid keys): SDPA
(what the TTFT floor counts) against the split kernel, at its defaults or over a sweep of
tiles and split counts (``--padding-sweep``). Then, unless ``--attention-only``, the pieces of
a layer between two attention calls (o_proj, add + LayerNorm, fc1, exact GELU, fc2, QKV), each
chained over four layers' weights. Times are per call inside one CUDA graph.

    python -m benchmarks.kernels vision [--padding-sweep] [--attention-only] [--json PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import time_graph_us
from benchmarks.kernels.attention import Row, format_table, write_json
from vllm.attention.ops.triton_prefill import PrefillConfig
from vllm.attention.ops.vision_attention import (
    HALF_PADDING_TILE,
    padding_rows_attention,
    padding_rows_ranges,
    sdpa,
    vision_attention,
)
from vllm.model_executor.layers.fused_kernels import add_layer_norm

DTYPE = torch.bfloat16
VISION_TOKENS, VISION_HEADS, VISION_DIM, TILE_TOKENS = 6432, 16, 80, 1601
D, INTER, EPS, LAYERS = 1280, 5120, 1e-5, 4


def bench_attention() -> list[Row]:
    """The tower's attention per tile count, five ways (see the module docstring)."""
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
        valid = tiles * TILE_TOKENS

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
        add(
            "vision_attention (model)",
            lambda n=valid, r=ranges: vision_attention(q, k, v, n, r),
            note + (", split pad kernel" if ranges is not None else ", 2 calls"),
        )
        pad = torch.arange(length, device="cuda") >= valid
        mask = torch.zeros(1, 1, length, length, dtype=DTYPE, device="cuda")
        mask.masked_fill_(pad[:, None] & pad[None, :], torch.finfo(DTYPE).min)
        add(
            "vision sdpa dense mask",
            lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            note,
        )
    return rows


def bench_padding_rows(sweep: bool) -> list[Row]:
    """The padding rows of a 4-tile image alone: SDPA against the split kernel."""
    length, valid, h, d = VISION_TOKENS, 4 * TILE_TOKENS, VISION_HEADS, VISION_DIM
    q, k, v = (torch.randn(1, h, length, d, dtype=DTYPE, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    ranges = padding_rows_ranges(length, valid, q.device)
    flops = 4 * h * d * (length - valid) * valid
    cases = {
        "pad rows sdpa": (lambda: sdpa(q[:, :, valid:], k[:, :, :valid], v[:, :, :valid]), "cuDNN"),
        "pad rows split": (
            lambda: padding_rows_attention(q, k, v, out, valid, ranges),
            f"default {HALF_PADDING_TILE}",
        ),
    }
    if sweep:
        for tile in (
            (16, 64, 4, 2),
            (32, 64, 4, 2),
            (32, 128, 4, 2),
            (64, 64, 4, 3),
            (64, 128, 8, 3),
            (128, 64, 8, 3),
        ):
            for n in (8, 16, 32, 64):
                cfg = PrefillConfig(*tile)
                cases[f"pad rows split {n} {tile}"] = (
                    lambda cfg=cfg, n=n: padding_rows_attention(
                        q, k, v, out, valid, ranges, config=cfg, num_splits=n
                    ),
                    f"{n} splits, tile {tile}",
                )
    rows = []
    for name, (fn, note) in cases.items():
        us = time_graph_us([fn] * 20)
        rows.append(Row(name, 1, valid, us, tflops=flops / (us * 1e-6) / 1e12, note=note))
    return rows


def bench_layer_pieces(rows: int = VISION_TOKENS) -> list[Row]:
    """Each row-wise piece of a vision layer over ``rows`` rows, chained over 4 layers'
    weights (twice), us per call."""

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * shape[-1] ** -0.5).to(DTYPE)

    layers = [
        dict(
            wo=w(D, D),
            bo=w(D) * 0.1,
            ln2w=1 + 0.1 * w(D),
            ln2b=w(D) * 0.1,
            w1=w(INTER, D),
            b1=w(INTER) * 0.1,
            w2=w(D, INTER),
            b2=w(D) * 0.1,
            wqkv=w(3 * D, D),
        )
        for _ in range(LAYERS)
    ]
    attn, x, y = (torch.randn(rows, D, device="cuda").to(DTYPE) for _ in range(3))
    m = torch.randn(rows, INTER, device="cuda").to(DTYPE)
    qkv = torch.empty(rows, 3 * D, device="cuda", dtype=DTYPE)
    pieces = {
        "o_proj": lambda p: F.linear(attn, p["wo"], p["bo"]),
        "add_layer_norm": lambda p: add_layer_norm(x, p["ln2w"], p["ln2b"], EPS, attn),
        "fc1": lambda p: F.linear(y, p["w1"], p["b1"]),
        "gelu": lambda p: F.gelu(m),
        "gelu_inplace": lambda p: torch._C._nn.gelu_(m),
        "fc2": lambda p: F.linear(m, p["w2"], p["b2"]),
        "qkv": lambda p: torch.matmul(y, p["wqkv"].t(), out=qkv),
    }
    out = []
    for name, fn in pieces.items():
        us = time_graph_us([lambda p=p, fn=fn: fn(p) for p in layers * 2], replays=10)
        out.append(Row(f"layer {name}", 1, rows, us, note=f"{rows} rows"))
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the attention cases (and the layer pieces); prints the table."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--padding-sweep",
        action="store_true",
        help="sweep the padding-row kernel's tiles and split counts",
    )
    parser.add_argument("--attention-only", action="store_true", help="skip the layer pieces")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the vision benchmark needs a CUDA device")
    torch.manual_seed(0)
    rows = bench_attention() + bench_padding_rows(args.padding_sweep)
    if not args.attention_only:
        rows += bench_layer_pieces()
    print(format_table(rows))
    write_json(args.json, rows)
