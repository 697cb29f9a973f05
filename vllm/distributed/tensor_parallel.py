"""Which parameters a tensor-parallel rank holds a slice of, and along which dimension.

Megatron-style: the text decoder's q|k|v, gate|up, the cross layers' q and k|v, the embedding
and the LM head are split along their output rows (column-parallel: heads, MLP columns,
vocabulary rows), each checkpoint shard of a fused layer on its own; o_proj and down_proj along
their input columns (row-parallel: every rank's partial output is summed). Norms, the gates,
the vision tower and the projector are whole on every rank.

A loader that quantizes as it loads takes a row-parallel matrix whole (``whole_rows``): a
channel's scale is the whole row's, as with one rank, and it keeps its own columns after.
"""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import TensorParallel

_ROWS = (
    ".self_attn.qkv_proj.weight",
    ".mlp.gate_up_proj.weight",
    ".cross_attn.q_proj.weight",
    ".cross_attn.kv_proj.weight",
    ".embed_tokens.weight",
    ".lm_head.weight",
)
_COLUMNS = (".self_attn.o_proj.weight", ".mlp.down_proj.weight", ".cross_attn.o_proj.weight")


def split_dim(param_name: str) -> int | None:
    """The dimension a parameter is split along (0: rows, 1: columns), None if whole. An FP8
    layer's ``weight_scale`` (one value per output row) follows its rows: split with a
    column-parallel weight, whole with a row-parallel one."""
    if not param_name.startswith("language_model."):
        return None
    if param_name.endswith("_scale"):
        return 0 if param_name.removesuffix("_scale").endswith(_ROWS) else None
    if param_name.endswith(_ROWS):
        return 0
    if param_name.endswith(_COLUMNS):
        return 1
    return None


def rank_slice(param_name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (one shard of a fused layer, or a whole
    parameter) for ``param_name``; the tensor itself with one rank or for whole parameters
    (and for a per-tensor scale, one value for all rows)."""
    dim = split_dim(param_name)
    if tp.size == 1 or dim is None or (param_name.endswith("_scale") and tensor.numel() == 1):
        return tensor
    part = tp.part(tensor.shape[dim], f"{param_name} dimension {dim}")
    return tensor.narrow(dim, tp.rank * part, part)


def whole_rows(loader: object, param_name: str) -> bool:
    """Whether ``loader`` takes ``param_name``'s matrix with every column (it quantizes each
    row and keeps this rank's columns itself, ``rank_columns``)."""
    return split_dim(param_name) == 1 and bool(getattr(loader, "quantizes_whole_rows", False))


def rank_columns(tensor: torch.Tensor, width: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's ``width`` columns of a row-parallel matrix given whole."""
    if tensor.shape[-1] != width * tp.size:
        raise ValueError(f"{tensor.shape[-1]} columns for {tp.size} ranks of {width}")
    return tensor.narrow(-1, tp.rank * width, width)
