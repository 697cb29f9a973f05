"""compressed-tensors ``quantization_config`` blocks: which schemes are served, and which
checkpoint modules each applies to.

The served scheme is FP8 e4m3 weights with one scale per output channel or per tensor
(``format: float-quantized``; RedHatAI's ``FP8_DYNAMIC`` checkpoints and ``FP8``'s weights),
run weight-only: input activations, dynamic per token or static per tensor, are not quantized
(``input_scale`` tensors are read and dropped). Anything else is refused with what is served.

Matching follows compressed-tensors: a target or ignore entry is either ``re:PATTERN``
(``re.match`` on the module name), an exact module name, or ``Linear`` (every linear layer; no
other class names). The names are the unfused modules of the checkpoint (``q_proj``, not the
engine's ``qkv_proj``), matched in both name layouts (the hub's ``language_model.model.*`` and
transformers 5's ``model.language_model.*``), since lists are written in either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SERVED = (
    "FP8 e4m3 weights (compressed-tensors format 'float-quantized': weights type float, "
    "num_bits 8, symmetric, strategy 'channel' or 'tensor'), with input activations "
    "unquantized or FP8 (served weight-only: activations stay in --dtype)"
)
_FORMATS = ("float-quantized",)
_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class Fp8Group:
    """One config group: its targets and its weights' scale strategy."""

    targets: tuple[str, ...]
    strategy: str  # "channel" ([N, 1] scales) or "tensor" (one scale)


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """The served part of a compressed-tensors block: its FP8 groups and its ignore list."""

    groups: tuple[Fp8Group, ...]
    ignore: tuple[str, ...]

    def strategy_for(self, names: Iterable[str]) -> str | None:
        """The scale strategy of the checkpoint module known by ``names`` (its names in each
        layout), or None when it is ignored or no group targets it (it stays in --dtype)."""
        names = tuple(names)
        if any(matches(entry, names) for entry in self.ignore):
            return None
        for group in self.groups:
            if any(matches(t, names) for t in group.targets):
                return group.strategy
        return None


def matches(entry: str, names: Iterable[str]) -> bool:
    """Whether a target/ignore entry names a linear module known by ``names``."""
    if entry == "Linear":
        return True
    if entry.startswith("re:"):
        pattern = entry[3:]
        return any(re.match(pattern, n) is not None for n in names)
    return entry in names


def _fail(what: str) -> ValueError:
    return ValueError(f"compressed-tensors quantization_config: {what}; supported: {SERVED}")


def _check_weights(name: str, w: Any, fmt: str | None) -> str:
    if not isinstance(w, Mapping):
        raise _fail(f"config group {name!r} quantizes no weights")
    kind = (w.get("type"), w.get("num_bits"))
    if kind != ("float", 8):
        raise _fail(f"config group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights")
    strategy = w.get("strategy")
    if strategy not in _STRATEGIES:
        raise _fail(f"config group {name!r} has weight strategy {strategy!r}")
    if not w.get("symmetric", True) or w.get("dynamic", False):
        raise _fail(f"config group {name!r} has asymmetric or dynamic weights")
    if w.get("group_size") is not None or w.get("block_structure") is not None:
        raise _fail(f"config group {name!r} has grouped or block weight scales")
    if fmt not in _FORMATS:
        raise _fail(f"config group {name!r} is stored in format {fmt!r}")
    return str(strategy)


def _check_activations(name: str, a: Any) -> None:
    if a is None:
        return
    if not isinstance(a, Mapping) or (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise _fail(f"config group {name!r} quantizes input activations as {a!r}")


def _check_targets(name: str, targets: Any) -> tuple[str, ...]:
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _fail(f"config group {name!r} has no list of targets")
    for t in targets:
        if t != "Linear" and not t.startswith("re:") and "." not in t and t[:1].isupper():
            raise ValueError(
                f"compressed-tensors quantization_config: config group {name!r} targets the "
                f"class {t!r}; supported targets: 'Linear', module names and 're:' patterns"
            )
    return tuple(targets)


def parse_compressed_tensors(block: Mapping[str, Any]) -> CompressedTensorsScheme:
    """The served scheme of a compressed-tensors block (config.json ``quantization_config``);
    raises ValueError naming the field and what is supported for anything else."""
    groups_raw = block.get("config_groups")
    if not isinstance(groups_raw, Mapping) or not groups_raw:
        raise _fail("config_groups is missing or empty")
    sparsity = block.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _fail(f"sparsity_config {sparsity.get('format')!r} is set")
    if block.get("kv_cache_scheme") is not None:
        raise ValueError(
            "compressed-tensors quantization_config: kv_cache_scheme is set (an FP8 KV cache "
            "with checkpoint scales), which is not supported: checkpoint KV scales are not "
            "loaded (--kv-cache-dtype fp8 runs an FP8 KV cache with scale 1.0 on a checkpoint "
            "without kv_cache_scheme)"
        )
    if block.get("transform_config"):
        raise _fail("transform_config is set (rotated weights)")
    groups = []
    for name, g in groups_raw.items():
        if not isinstance(g, Mapping):
            raise _fail(f"config group {name!r} is not an object")
        if g.get("output_activations") is not None:
            raise _fail(f"config group {name!r} quantizes output activations")
        fmt = g.get("format") or block.get("format")
        strategy = _check_weights(name, g.get("weights"), fmt)
        _check_activations(name, g.get("input_activations"))
        groups.append(Fp8Group(_check_targets(name, g.get("targets")), strategy))
    ignore = block.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _fail("ignore is not a list of module names and 're:' patterns")
    return CompressedTensorsScheme(tuple(groups), tuple(ignore))
