"""bitsandbytes 4-bit weights: pre-quantized checkpoints, quantization at load, dummy weights.

A pre-quantized checkpoint (transformers + bitsandbytes ``save_pretrained``) stores for each
quantized ``X.weight`` the packed uint8 ``X.weight`` and ``X.weight.absmax``,
``X.weight.quant_map``, ``X.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``: the JSON
with blocksize and shape) and, with double quantization, ``X.weight.nested_absmax`` and
``X.weight.nested_quant_map``. A tensor is quantized exactly when its quant-state entry exists
(skip lists differ between checkpoints), so the quant states are read first, alone (a few
hundred bytes each), and decide every layer's format before the model is built; the stream of
tensors is then regrouped into one :class:`Packed4bit` per quantized matrix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm.model_executor.layers.quantization.bitsandbytes import BitsAndBytesConfig
from vllm.model_executor.layers.quantization.bnb_codec import (
    Packed4bit,
    QuantState4bit,
    code_table,
    parse_quant_state,
)
from vllm.model_executor.model_loader.quant_plan import QuantPlan, Weights
from vllm.model_executor.models.mllama_weights import WeightLoadError, linear_entry

QUANT_STATE = ".quant_state.bitsandbytes__"
# A quantized matrix's entries besides its packed ``X.weight`` (suffixes of ``X.weight``).
_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
_NESTED_PARTS = (".nested_absmax", ".nested_quant_map")


def scan_quant_states(files: list[Path]) -> dict[str, QuantState4bit]:
    """Checkpoint weight name -> its quant state, from the ``quant_state`` entries only."""
    from safetensors import safe_open

    states: dict[str, QuantState4bit] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if QUANT_STATE not in name:
                    continue
                base, quant_type = name.split(QUANT_STATE, 1)
                payload = handle.get_tensor(name).numpy().tobytes()
                try:
                    states[base] = parse_quant_state(payload, quant_type)
                except ValueError as e:
                    raise WeightLoadError(f"{f}: tensor {name!r}: {e}") from e
    return states


def prequantized_config(states: dict[str, QuantState4bit]) -> BitsAndBytesConfig:
    """The config giving each linear layer the format its checkpoint matrices have."""
    layers: dict[str, dict[str | None, QuantState4bit]] = {}
    for name, state in states.items():
        if not name.endswith(".weight"):
            raise WeightLoadError(f"quantized tensor {name!r} is not a weight")
        prefix, shard = linear_entry(name)
        layers.setdefault(prefix, {})[shard] = state
    return BitsAndBytesConfig(checkpoint=layers)


def quantization_plan(files: list[Path] | None, quantization: str | None) -> QuantPlan:
    """``quantization`` is the engine's method (None or ``bitsandbytes``); ``files`` the
    checkpoint's shards (None: dummy weights). A checkpoint with quant states is loaded as it
    is; one without is quantized as it streams (NF4, blocksize 64, double quantization); dummy
    weights take the same layout (every linear 4-bit but the LM head)."""
    if quantization is None:
        return QuantPlan()
    if quantization != "bitsandbytes":
        raise ValueError(f"quantization {quantization!r} is not supported (bitsandbytes)")
    states = scan_quant_states(files) if files else {}
    if states:
        config = prequantized_config(states)
        return QuantPlan(
            config,
            stream=functools.partial(group_quantized, states=states),
            check=functools.partial(check_claimed, config),
        )
    return QuantPlan(BitsAndBytesConfig())


def check_claimed(config: BitsAndBytesConfig) -> None:
    """Every quantized checkpoint layer must have become a 4-bit linear layer."""
    stray = config.unclaimed()
    if stray:
        raise WeightLoadError(
            f"the checkpoint quantizes {stray[:4]}{' ...' if len(stray) > 4 else ''}, which "
            "are not linear layers of this model (only linear layers are served 4-bit)"
        )


def _split(name: str, states: dict[str, QuantState4bit]) -> tuple[str, str] | None:
    """(quantized weight name, part) for an entry of a quantized matrix; None otherwise."""
    if name in states:
        return name, ""
    if QUANT_STATE in name:
        return name.split(QUANT_STATE, 1)[0], "quant_state"
    for part in _PARTS:
        if name.endswith(part):
            base = name[: -len(part)]
            if base not in states:
                raise WeightLoadError(
                    f"tensor {name!r}: bitsandbytes statistics of {base!r}, "
                    "which has no quant_state entry"
                )
            return base, part
    return None


def _assemble(
    name: str, state: QuantState4bit, parts: dict[str, torch.Tensor], file: str
) -> Packed4bit:
    """One :class:`Packed4bit` from a matrix's checkpoint entries, checked."""
    packed = parts[""]
    if packed.dtype != torch.uint8:
        raise WeightLoadError(
            f"{file}: tensor {name!r} is {packed.dtype}: only uint8 storage "
            "(bnb_4bit_quant_storage='uint8') is supported"
        )
    table = code_table(state.quant_type)
    quant_map = parts[".quant_map"].float().reshape(-1)
    if quant_map.shape != table.shape or not torch.equal(quant_map, table):
        raise WeightLoadError(
            f"{file}: tensor {name!r}.quant_map is not the standard {state.quant_type} table"
        )
    if not state.nested:
        return Packed4bit(state, packed, parts[".absmax"])
    offset = torch.tensor(state.offset, dtype=torch.float32)
    return Packed4bit(
        state,
        packed,
        parts[".absmax"],
        parts[".nested_absmax"].float(),
        parts[".nested_quant_map"].float(),
        offset,
    )


def group_quantized(
    weights: Weights, states: dict[str, QuantState4bit]
) -> Iterator[tuple[str, torch.Tensor | Packed4bit, str]]:
    """Passes plain tensors through and yields each quantized matrix once all its entries
    were read, as ``(X.weight, Packed4bit, file)``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor, file in weights:
        split = _split(name, states)
        if split is None:
            yield name, tensor, file
            continue
        base, part = split
        parts = pending.setdefault(base, {})
        parts[part] = tensor
        if set(parts) >= _required(states[base]):
            del pending[base]
            yield base, _assemble(base, states[base], parts, file), file
    for base, parts in sorted(pending.items()):
        missing = sorted(_required(states[base]) - set(parts))
        shown = [f"{base}{p}" if p != "quant_state" else f"{base}{QUANT_STATE}..." for p in missing]
        raise WeightLoadError(f"quantized weight {base!r} is missing {shown}")


def _required(state: QuantState4bit) -> set[str]:
    parts = {"", "quant_state", ".absmax", ".quant_map"}
    return parts | set(_NESTED_PARTS) if state.nested else parts
