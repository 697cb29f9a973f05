"""The tensor-parallel group of this process: its rank and size, and the collectives the model
runs (sums of row-parallel outputs, gathers of vocabulary shards).

With one rank (the default, and every engine today) the collectives are no-ops that return
their input, so the single-GPU path runs exactly as before. With more, ``init_tensor_parallel``
joins a ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU) and every rank holds
its slice of the model: attention and MLP split Megatron-style by heads and columns
(``tensor_parallel.py`` says which parameter splits along which dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """A process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def part(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, columns, vocabulary rows)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not divide over {self.size} ranks")
        return total // self.size


_TP = TensorParallel()


def get_tp() -> TensorParallel:
    return _TP


def init_tensor_parallel(
    size: int,
    rank: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300,
    device: torch.device | None = None,
) -> TensorParallel:
    """Joins the process group of ``size`` ranks as ``rank`` (``init_method``: a
    ``tcp://host:port`` or ``file://`` rendezvous) and makes it this process's group. A
    collective that waits longer than ``timeout_s`` for a peer raises instead of hanging (a
    peer that exited fails it at once). With ``device`` (this rank's GPU) the NCCL
    communicator is created here, eagerly, so that no decode-graph capture is the first
    collective."""
    global _TP
    if size > 1:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        extra = {"device_id": device} if backend == "nccl" and device is not None else {}
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
            **extra,
        )
    _TP = TensorParallel(rank, size)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``x`` (in place; a no-op with one rank)."""
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
