"""Greedy sampling's row argmax over the 11B vocabulary (float32 logits): torch.argmax against
the two-kernel Triton reduction (CUDA), at several tile sizes. Times are per call inside a CUDA
graph of 20 calls (what a decode graph pays), median of 20 replays; every variant is checked
against torch.argmax.

    python -m benchmarks.kernels argmax
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import time_graph_us
from vllm.model_executor.layers.triton_argmax import argmax_rows

VOCAB = 128256
CALLS = 20


def graph_us(fn) -> float:
    return time_graph_us([fn] * CALLS, replays=20)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Prints, per batch, torch.argmax and the Triton argmax at each tile size."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the argmax benchmark needs a CUDA device")
    for batch in (1, 8, 64):
        x = torch.randn(batch, VOCAB, device="cuda")
        ref = x.argmax(dim=-1)
        out = torch.empty_like(ref)
        row = [f"batch {batch:3d}: torch.argmax {graph_us(lambda x=x: x.argmax(dim=-1)):6.1f} us"]
        for block in (1024, 2048, 4096, 8192):
            assert torch.equal(argmax_rows(x, block=block), ref)
            us = graph_us(lambda x=x, o=out, b=block: argmax_rows(x, out=o, block=b))
            row.append(f"triton/{block} {us:6.1f} us")
        print(", ".join(row), flush=True)
