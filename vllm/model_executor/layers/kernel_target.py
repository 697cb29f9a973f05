"""Kernels are chosen once, when the model is loaded: per layer, and per row bucket for linears.

``select_kernels(model, target)`` walks the model and lets every layer that has a choice
(``KernelSelecting``) take it for ``target``: the Triton kernels written here, or plain torch.
Linear layers build a table with one kernel per decode row bucket (the decode graph sizes) and
one last entry for any other row count (prefill, the vision tower); the forward reads the step's
bucket index from the forward context (``vllm.forward_context.row_bucket``) and indexes the table.
Nothing is looked up or imported per call, and graph capture records exactly the kernels an
eager step at the same bucket runs.

Layers default to their torch kernels at construction, so a model built without a selection (a
test's reference) runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class KernelTarget:
    """What the kernels are chosen for.

    ``fused``: the Triton kernels (on CUDA; on CPU only under Triton's interpreter, in tests).
    ``row_buckets``: the decode batch sizes the runner runs (ascending); kernel tables have one
    entry per bucket, then one for any row count.
    """

    device: torch.device
    fused: bool
    row_buckets: tuple[int, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def uses_fused_kernels(device: torch.device) -> bool:
    """The one decision of which kernel family runs: Triton's on CUDA, torch's elsewhere.
    (Tests of the fused path on CPU replace this function.)"""
    return device.type == "cuda"


def kernel_target(device: torch.device, row_buckets: tuple[int, ...]) -> KernelTarget:
    return KernelTarget(device, uses_fused_kernels(device), tuple(sorted(row_buckets)))


@runtime_checkable
class KernelSelecting(Protocol):
    """A layer with a choice of kernels."""

    def select_kernels(self, target: KernelTarget) -> None: ...


def select_kernels(model: nn.Module, target: KernelTarget) -> None:
    """Lets every layer of ``model`` choose its kernels for ``target`` (before any capture)."""
    for module in model.modules():
        if isinstance(module, KernelSelecting):
            module.select_kernels(target)
