"""Checkpoint names -> parameters of :class:`MllamaForConditionalGeneration`.

Accepted layouts: the hub checkpoint names (``language_model.model.layers.N...``,
``language_model.lm_head.weight``, ``vision_model...``, ``multi_modal_projector...``) and the
transformers 5 in-memory names (``model.language_model...``, ``lm_head.weight``,
``model.vision_model...``, ``model.multi_modal_projector...``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.distributed.parallel_state import get_tp
from vllm.distributed.tensor_parallel import rank_slice, takes_whole
from vllm.model_executor.layers.linear import MergedLinear, WeightShapeError, default_weight_loader

# transformers-5 in-memory prefix -> hub prefix (order matters: longest first).
_V5_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

# Checkpoint sub-name -> (fused parameter sub-name, shard id).
_FUSED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", "gate"),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", "up"),
    (".cross_attn.k_proj.", ".cross_attn.kv_proj.", "k"),
    (".cross_attn.v_proj.", ".cross_attn.kv_proj.", "v"),
)


class WeightLoadError(ValueError):
    """A checkpoint cannot be loaded: names the file and the tensor at fault."""


def to_hub_name(name: str) -> str:
    """Normalises a checkpoint tensor name to the hub layout."""
    for v5, hub in _V5_PREFIXES:
        if name.startswith(v5):
            return hub + name[len(v5):]
    return name


def to_param_name(hub_name: str) -> tuple[str, str | None]:
    """Hub tensor name -> (parameter name, shard id or None)."""
    for src, dst, shard in _FUSED:
        if src in hub_name:
            return hub_name.replace(src, dst), shard
    return hub_name, None


def linear_entry(name: str) -> tuple[str, str | None]:
    """A checkpoint weight's name (either layout, ``...q_proj.weight``) -> (the prefix of the
    linear layer holding it, its shard id): ``(...self_attn.qkv_proj, "q")``."""
    param, shard = to_param_name(to_hub_name(name))
    return param.removesuffix(".weight"), shard


def checkpoint_modules(prefix: str, shard: str | None) -> tuple[str, str]:
    """The checkpoint module a layer's shard comes from, as (hub name, transformers-5 name):
    ``(language_model.model.layers.0.self_attn.qkv_proj, "k")`` ->
    ``(language_model.model.layers.0.self_attn.k_proj,
    model.language_model.layers.0.self_attn.k_proj)``."""
    dotted = prefix + "."
    if shard is not None:
        for src, dst, sid in _FUSED:
            if sid == shard and dst in dotted:
                dotted = dotted.replace(dst, src)
                break
    v5 = dotted
    for v5_prefix, hub in _V5_PREFIXES:
        if dotted.startswith(hub):
            v5 = v5_prefix + dotted[len(hub):]
            break
    return dotted[:-1], v5[:-1]


def expected_checkpoint_entries(model: nn.Module) -> set[tuple[str, str | None]]:
    """Every (parameter, shard) pair a complete checkpoint must provide (a fused layer's
    parameters with a loader, its weight and any scales, come one tensor per shard)."""
    fused_owner = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MergedLinear):
            for p_name, p in mod.named_parameters(recurse=False):
                if hasattr(p, "weight_loader"):
                    fused_owner[f"{mod_name}.{p_name}"] = tuple(mod.shards)
    entries: set[tuple[str, str | None]] = set()
    for name, _ in model.named_parameters():
        shards = fused_owner.get(name)
        if shards is None:
            entries.add((name, None))
        else:
            entries.update((name, s) for s in shards)
    return entries


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor, str]],
                 source: str) -> None:
    """Streams ``(name, tensor, file)`` triples into the model's (fused) parameters.

    Raises :class:`WeightLoadError` naming the file and tensor on an unknown name or a shape
    mismatch, and naming the missing tensors once every file was read.
    """
    params = dict(model.named_parameters())
    expected = expected_checkpoint_entries(model)
    tp = get_tp()  # with several ranks each takes its slice (``tensor_parallel.py``)
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor, file in weights:
        param_name, shard = to_param_name(to_hub_name(name))
        param = params.get(param_name)
        if param is None or (param_name, shard) not in expected:
            raise WeightLoadError(f"{file}: unexpected tensor {name!r} (no matching parameter)")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            part = tensor if takes_whole(loader, param_name) else rank_slice(param_name, tensor, tp)
            loader(param, part, shard)
        except WeightShapeError as e:
            raise WeightLoadError(f"{file}: tensor {name!r}: {e}") from e
        loaded.add((param_name, shard))
    missing = sorted(f"{n}" + (f" [{s}]" if s else "") for n, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8
                                          else "")
        raise WeightLoadError(f"{source}: checkpoint is missing {len(missing)} tensors: {shown}")
