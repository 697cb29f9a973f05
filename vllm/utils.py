"""Small helpers shared across the package."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Host values -> a device tensor without blocking the host.

    A copy from pageable memory makes PyTorch synchronise the whole stream (it would wait for
    the step still running on the GPU), so CUDA copies go through pinned memory. The caching
    pinned allocator keeps each buffer alive until its copy has run.
    """
    cpu = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return cpu.to(dtype)
    return cpu.to(dtype).pin_memory().to(device, non_blocking=True)
