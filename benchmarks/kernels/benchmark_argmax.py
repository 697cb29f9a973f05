"""Greedy sampling's row argmax over the 11B vocabulary (float32 logits): torch.argmax against
the one-kernel Triton reduction (CUDA). Prints the median time per call at batch 1, 8 and 64
and checks that both give the same indices.

    python benchmarks/kernels/benchmark_argmax.py
"""

from __future__ import annotations

import torch
import triton

from vllm.model_executor.layers.triton_argmax import argmax_rows

VOCAB = 128256


def main() -> None:
    for batch in (1, 8, 64):
        x = torch.randn(batch, VOCAB, device="cuda")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        t_torch = triton.testing.do_bench(lambda x=x: x.argmax(dim=-1), warmup=10, rep=200,
                                          return_mode="median")
        t_triton = triton.testing.do_bench(lambda x=x: argmax_rows(x), warmup=10, rep=200,
                                           return_mode="median")
        print(f"batch {batch:3d}: torch.argmax {t_torch * 1e3:6.1f} us, "
              f"triton {t_triton * 1e3:6.1f} us (same indices)")


if __name__ == "__main__":
    main()
