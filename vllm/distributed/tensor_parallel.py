"""Which parameters a tensor-parallel rank holds a slice of, and along which dimension.

Megatron-style: the text decoder's q|k|v, gate|up, the cross layers' q and k|v, the embedding
and the LM head are split along their output rows (column-parallel: heads, MLP columns,
vocabulary rows), each checkpoint shard of a fused layer on its own; o_proj and down_proj along
their input columns (row-parallel: every rank's partial output is summed). Norms, the gates,
the vision tower and the projector are whole on every rank.

A loader that quantizes as it loads takes a split matrix whole (``takes_whole``) and keeps
its own part after, so it quantizes exactly as one rank does: FP8 takes row-parallel matrices
whole (a channel's scale is its whole row's), bitsandbytes every split matrix (its second-level
scales group 256 blocks of the whole matrix). A pre-quantized bitsandbytes matrix is sliced
with its block scales decoded to float32 (``bnb_codec.slice_4bit``).
"""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import TensorParallel
from vllm.model_executor.layers.quantization.bnb_codec import Packed4bit, slice_4bit

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


def rank_slice(param_name: str, tensor, tp: TensorParallel):
    """This rank's part of a checkpoint tensor (one shard of a fused layer, or a whole
    parameter; a tensor or a pre-quantized :class:`Packed4bit`) for ``param_name``; the tensor
    itself with one rank or for whole parameters (and for a per-tensor scale, one value for
    all rows)."""
    dim = split_dim(param_name)
    if tp.size == 1:
        return tensor
    if isinstance(tensor, Packed4bit):
        if dim is None:  # whole, in the float32-scale layout every rank's 4-bit layers hold
            return slice_4bit(tensor, 0, 0, tensor.state.shape[0])
        part = tp.part(tensor.state.shape[dim], f"{param_name} dimension {dim}")
        try:
            return slice_4bit(tensor, dim, tp.rank * part, part)
        except ValueError as e:
            raise ValueError(f"{param_name}: {e}") from e
    if dim is None or (param_name.endswith("_scale") and tensor.numel() == 1):
        return tensor
    part = tp.part(tensor.shape[dim], f"{param_name} dimension {dim}")
    return tensor.narrow(dim, tp.rank * part, part)


def takes_whole(loader: object, param_name: str) -> bool:
    """Whether ``loader`` takes ``param_name``'s checkpoint matrix whole and keeps this rank's
    part itself: every split matrix (``quantizes_whole_matrix``), or row-parallel ones with
    every column (``quantizes_whole_rows``)."""
    dim = split_dim(param_name)
    if dim is None:
        return False
    if getattr(loader, "quantizes_whole_matrix", False):
        return True
    return dim == 1 and bool(getattr(loader, "quantizes_whole_rows", False))


def rank_columns(tensor: torch.Tensor, width: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's ``width`` columns of a row-parallel matrix given whole."""
    if tensor.shape[-1] != width * tp.size:
        raise ValueError(f"{tensor.shape[-1]} columns for {tp.size} ranks of {width}")
    return tensor.narrow(-1, tp.rank * width, width)
