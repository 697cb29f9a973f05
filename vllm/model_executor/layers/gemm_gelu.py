"""``gelu(x @ W^T + b)`` as one Triton GEMM with the exact (erf) GELU in its epilogue.

The vision tower's MLP runs ``fc1`` ([tokens, 1280] x [1280, 5120] for the 11B) and then GELU
over its [tokens, 5120] bf16 output: on the H200 that separate pass reads and writes 66 MB per
layer per 4-tile image (45 us, 40 layers: 1.8 ms of the time to first token). Here the bias and
GELU are applied to the float32 accumulator before the single rounding to the output dtype, so
the intermediate never makes a round trip through memory. Torch rounds twice (the GEMM's
output, then GELU's), so the two can differ by one ulp of the output dtype; the fused value is
the closer one to the exact result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclass(frozen=True)
class GemmGeluConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # row tiles visited together, so their weight tiles stay in L2
    num_warps: int = 8
    num_stages: int = 3
    # Tiles through tensor-memory-accelerator descriptors (Hopper and later) instead of
    # pointer loads; ``persistent``: one program per SM walking the tiles.
    tma: bool = False
    persistent: bool = False


DEFAULT_CONFIG = GemmGeluConfig()


@triton.jit
def _gelu_exact(acc):
    return acc * 0.5 * (1.0 + tl.math.erf(acc * 0.7071067811865476))


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a linear tile index, GROUP_M row tiles at a time."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _gemm_bias_gelu_tma_kernel(x_desc, w_desc, y_desc, b_ptr, M: tl.constexpr,
                               N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                               TRIPS: tl.constexpr):
    # Shapes are compile-time (one compile per token count: the vision graphs have one each);
    # program p runs tiles p, p + NUM_PROGRAMS, ... (TRIPS of them at most).
    tiles_m: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    for i in range(TRIPS):
        tile = tl.program_id(0) + i * NUM_PROGRAMS
        if tile < tiles_m * tiles_n:
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range((K + BLOCK_K - 1) // BLOCK_K):
                a = x_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N],
                         _gelu_exact(acc).to(y_desc.dtype))


@triton.jit
def _gemm_bias_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_y,
                           K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - kt * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _gelu_exact(acc)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                config: GemmGeluConfig | None = None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias))`` (exact GELU) for x [..., K] with unit stride in
    its last dim, weight [N, K] and bias [N] (CUDA, or Triton's interpreter on CPU)."""
    cfg = config or DEFAULT_CONFIG
    n, k = weight.shape
    assert x.shape[-1] == k and bias.shape == (n,), (x.shape, weight.shape, bias.shape)
    x2 = x.reshape(-1, k)
    assert x2.stride(-1) == 1 and weight.stride(-1) == 1
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return y.view(*x.shape[:-1], n)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.tma and _tma_ok(x2, weight, y):
        programs = tiles
        if cfg.persistent:
            programs = min(tiles, _num_sms(x.device))
        _gemm_bias_gelu_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]), bias, M=m, N=n, K=k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, NUM_PROGRAMS=programs, TRIPS=triton.cdiv(tiles, programs),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _gemm_bias_gelu_kernel[(tiles,)](
            x2, weight, bias, y, m, n, x2.stride(0), weight.stride(0), y.stride(0), K=k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], n)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Descriptors need 16-byte aligned bases and row strides (and unit inner stride)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
