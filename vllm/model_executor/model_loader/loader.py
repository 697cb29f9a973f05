"""Builds the model on its device and fills it from safetensors shards or with dummy weights.

Shards stream one tensor at a time (read to host, copied into its final, possibly fused,
parameter), so loading never holds a second copy of the model. Quantized checkpoints
(bitsandbytes 4-bit, ``bitsandbytes_loader.py``; compressed-tensors FP8, ``fp8_loader.py``)
load their matrices as they are stored; with ``--quantization bitsandbytes`` or ``fp8`` a
bf16 checkpoint's are quantized one tensor at a time as they stream.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.model_loader.bitsandbytes_loader import quantization_plan
from vllm.model_executor.model_loader.fp8_loader import fp8_plan
from vllm.model_executor.model_loader.quant_plan import (
    QuantPlan,
    initialize_dummy_quantized,
    quantized_linears,
    weight_memory,
)
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.model_executor.models.mllama_weights import WeightLoadError, load_weights
from vllm.transformers_utils.config import MllamaSpec

logger = init_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "dummy", "bitsandbytes")
GiB = 1 << 30


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint, checked against the index when there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                names = [n for n, s in weight_map.items() if model_dir / s == f]
                raise WeightLoadError(
                    f"{f}: shard listed in {INDEX_FILE} is missing (holds {names[0]!r}"
                    f"{f' and {len(names) - 1} more' if len(names) > 1 else ''})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files (use load_format='dummy' "
                              "to run with random weights)")
    return files


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yields (name, tensor, file) one tensor at a time; corrupt files raise with their name."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, handle.get_tensor(name), str(f)
        except SafetensorError as e:
            raise WeightLoadError(f"{f}: cannot read safetensors file ({e})") from e
        except OSError as e:
            raise WeightLoadError(f"{f}: cannot read file ({e})") from e


def _dummy_std(name: str, param: torch.Tensor) -> float:
    if param.dim() >= 2:
        fan_in = math.prod(param.shape[1:])
        return 1.0 / math.sqrt(fan_in)
    return 0.02


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for performance work: scaled normal matrices, norms near 1, non-zero
    gates (so images influence the text), deterministic for a seed on a given device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    quantized = {f"{n}.weight" for n in quantized_linears(model)}
    for name, p in model.named_parameters():
        if name in quantized:  # drawn dense and quantized: ``initialize_dummy_quantized``
            continue
        last = name.rsplit(".", 1)[-1]
        if last.endswith("gate") or last in ("gate_attn", "gate_ffn"):
            values = torch.rand(p.shape, generator=gen) * 1.5 + 0.25
        elif "norm" in name and last == "weight":
            values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif last == "bias" or "norm" in name:
            values = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            values = None
        if values is not None:
            p.copy_(values)
            continue
        # Large matrices: draw on the device in one call (fast for the 11B shape).
        dev_seed = seed * 1_000_003 + zlib.crc32(name.encode())
        dev_gen = torch.Generator(device=p.device).manual_seed(dev_seed)
        p.normal_(0.0, _dummy_std(name, p), generator=dev_gen)


def build_model(spec: MllamaSpec, dtype: torch.dtype, device: torch.device,
                max_position: int, quant_config: QuantizationConfig | None = None
                ) -> MllamaForConditionalGeneration:
    """The model's modules, allocated directly on ``device`` in ``dtype`` (the meta device
    allocates nothing), weights not loaded."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MllamaForConditionalGeneration(spec, max_position=max_position,
                                                   quant_config=quant_config)
    finally:
        torch.set_default_dtype(old_dtype)
    return model.eval()


def plan_quantization(model_dir: Path | None, load_format: str, quantization: str | None,
                      spec: MllamaSpec) -> QuantPlan:
    """The layers' quantization for a load (reads only config.json and, for bitsandbytes, the
    checkpoint's quant states)."""
    dummy = load_format == "dummy"
    if quantization in ("fp8", "compressed-tensors"):
        return fp8_plan(quantization, spec.quantization, dummy)
    if quantization is None or dummy:
        return quantization_plan(None, quantization)
    assert model_dir is not None
    return quantization_plan(safetensors_files(model_dir), quantization)


def get_model(spec: MllamaSpec, model_dir: Path | None, load_format: str, dtype: torch.dtype,
              device: torch.device, max_position: int, seed: int = 0,
              quantization: str | None = None) -> MllamaForConditionalGeneration:
    """Constructs the model directly on ``device`` in ``dtype`` and loads its weights.
    ``quantization``: None, ``bitsandbytes``, ``compressed-tensors`` or ``fp8`` (resolved from
    the flags and config.json)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "bitsandbytes" and quantization != "bitsandbytes":
        raise ValueError("load_format='bitsandbytes' needs quantization='bitsandbytes'")
    plan = plan_quantization(model_dir, load_format, quantization, spec)
    model = build_model(spec, dtype, device, max_position, plan.config)
    plan.check_built()
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
        initialize_dummy_quantized(model, seed)
        logger.info("Initialised dummy weights (seed %d)", seed)
    else:
        assert model_dir is not None
        files = safetensors_files(model_dir)
        weights = iterate_safetensors(files)
        with torch.no_grad():
            load_weights(model, plan.weights(weights), source=str(model_dir))
        logger.info("Loaded %d safetensors file(s) from %s", len(files), model_dir)
    model.post_load()
    _log_weight_memory(model, plan, dtype)
    return model


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 4 else f"{nbytes / (1 << 20):.2f} MiB"


def _log_weight_memory(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    """The weights' memory as stored (quantized layers with their scales)."""
    quantized, layers, rest = weight_memory(model)
    name = str(dtype).removeprefix("torch.")
    if plan.config is None:
        logger.info("Model weights: %s in %s", _size(rest), name)
        return
    logger.info("Model weights: %s (%s: %s in %d linear layers, scales included; %s "
                "in %s)", _size(quantized + rest), plan.config.describe(), _size(quantized),
                layers, _size(rest), name)
