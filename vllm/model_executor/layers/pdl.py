"""Programmatic dependent launch (Hopper and later) for the decode step's Triton kernels.

A kernel launched with ``launch_pdl`` may start before the kernel ahead of it in the stream has
finished: once every program of that kernel has called ``launch_dependents`` (or exited), this
kernel's programs are placed on free SMs. They must not touch anything the kernels before them
write until ``wait`` returns, which is when the previous kernel has completed and its writes are
visible (and so, transitively, every kernel before it). CUDA graph capture keeps these launches
as programmatic edges, so a replayed decode step overlaps each kernel's start with the end of
the one before.

The rules every kernel taking a ``PDL`` constexpr follows:

- ``begin`` (or ``launch_dependents`` then ``wait``) before its first load of activations,
  caches, tables or workspaces and before its first store;
- before ``wait`` it reads only what no kernel writes during a step: a GEMM's weights, which
  it prefetches into L2 (``prefetch_rows``) so their first tiles are on the way while the
  previous kernel drains — the point of it, since a decode step is mostly weight reads.

``launch_pdl`` is passed only with ``PDL`` set (``launch_options``): on a GPU of compute
capability 9.0 and up, compiled (never under Triton's interpreter). Kernels launched without
it run exactly as before: ``wait`` returns at once and ``launch_dependents`` is a hint.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from vllm import envs

# The size of one L2 prefetch (a cache line).
LINE_BYTES = 128


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are compiled and launched with dependent launch."""
    if device.type != "cuda" or envs.TRITON_INTERPRET or not envs.VLLM_PDL:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


# Where a GEMM lets the next kernel start: 1 at its start, 2 after its K loop.
GEMM_TRIGGER = int(os.environ.get("VLLM_PDL_TRIGGER", "1"))
# Bytes of each weight row a GEMM program prefetches.
PREFETCH_LIMIT = int(os.environ.get("VLLM_PDL_PREFETCH", "1024"))


def launch_options(device: torch.device) -> dict:
    """``PDL`` and ``launch_pdl`` for a kernel call on ``device`` (both off or both on)."""
    on = enabled(device)
    return {"PDL": GEMM_TRIGGER, "launch_pdl": True} if on else {"PDL": 0}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Lets the next kernel's programs start (once every program here has called it)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def trigger_early(PDL: tl.constexpr):
    """A GEMM's ``launch_dependents`` at its start (``GEMM_TRIGGER`` 1)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def trigger_late(PDL: tl.constexpr):
    """A GEMM's ``launch_dependents`` after its K loop (``GEMM_TRIGGER`` 2)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Returns once the previous kernel has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def begin(PDL: tl.constexpr):
    """``launch_dependents`` then ``wait``: the start of a kernel with nothing to prefetch."""
    launch_dependents(PDL)
    wait(PDL)


@triton.jit
def prefetch_rows(row_ptrs, BYTES: tl.constexpr, PDL: tl.constexpr):
    """Prefetches ``BYTES`` bytes from each of ``row_ptrs`` (byte addresses of rows, in
    bounds for that many bytes) into L2, one cache line an instruction; nothing is waited
    for and no register is written. ``BYTES`` below a line prefetches nothing."""
    if PDL and BYTES >= 128:
        lines: tl.constexpr = BYTES // 128
        offsets = tl.arange(0, lines) * 128
        ptrs = row_ptrs.to(tl.pointer_type(tl.int8))[:, None] + offsets[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


def prefetch_bytes(row_bytes: int) -> int:
    """The bytes a GEMM program prefetches of each weight row it reads (``row_bytes`` of
    them): the largest power of two <= both it and ``PREFETCH_LIMIT``, 0 below a line."""
    b = 1 << max(0, min(row_bytes, PREFETCH_LIMIT).bit_length() - 1)
    return b if b >= LINE_BYTES else 0
