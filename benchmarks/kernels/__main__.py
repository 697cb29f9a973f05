"""Kernel microbenchmarks at the 11B shapes (CUDA), timed inside CUDA graphs.

python -m benchmarks.kernels COMMAND [options]
"""

from __future__ import annotations

from benchmarks.common import dispatch

COMMANDS = {
    "attention": (
        "benchmarks.kernels.attention",
        "paged self / cross decode (% of copy bandwidth) and prefill attention",
    ),
    "vision": (
        "benchmarks.kernels.vision",
        "the vision tower's attention per tile count, its padding rows, layer pieces",
    ),
    "gemm": (
        "benchmarks.kernels.gemm",
        "decode-sized GEMMs: cuBLAS, cuBLASLt, Triton skinny GEMM (+ SiLU epilogue)",
    ),
    "nf4": (
        "benchmarks.kernels.nf4",
        "the 4-bit linears of a text layer: Triton NF4 GEMM vs bf16 vs bitsandbytes",
    ),
    "fp8": (
        "benchmarks.kernels.fp8",
        "the FP8 linears of a text layer: Triton FP8 GEMM vs bf16, scratch, _scaled_mm",
    ),
    "sass": (
        "benchmarks.kernels.sass",
        "instruction mix of the FP8 / NF4 GEMMs' K loop in sm_90 SASS (built on the host)",
    ),
    "launch": (
        "benchmarks.kernels.launch",
        "host cost of launching a CUDA graph against its number of kernel nodes",
    ),
    "argmax": (
        "benchmarks.kernels.argmax",
        "greedy argmax over the vocabulary: torch.argmax vs the split Triton kernel",
    ),
    "allreduce": (
        "benchmarks.kernels.allreduce",
        "a tensor-parallel decode step's collectives (NCCL in a CUDA graph, N GPUs)",
    ),
    "decode-tune": (
        "benchmarks.kernels.decode_tune",
        "grid search of the paged decode kernels' knobs (segment or combine)",
    ),
}

if __name__ == "__main__":
    dispatch("python -m benchmarks.kernels", __doc__.splitlines()[0], COMMANDS)
