"""FP8 test checkpoints, made by compressed-tensors from the tiny demo checkpoint.

compressed-tensors attaches an FP8 scheme to the model's linears (``apply_quantization_config``
with its preset schemes), the weight scales are computed with its own ``calculate_qparams``
from each row's min and max (what llm-compressor's minmax observer feeds it), and
``ModelCompressor`` compresses the model and writes the ``quantization_config`` block, as
llm-compressor's ``oneshot`` + ``save_pretrained`` do (quantization.md section 9; llm-compressor
itself pins an older transformers). The reference running such a folder is transformers with
``CompressedTensorsConfig(dequantize=True)`` (formerly ``run_compressed=False``): plain linears
on the decompressed weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.hf_runner import demo_path

# The demo folder's files other than the weights (tokenizer, chat template, processor).
_KEEP = (
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
# The published recipe's ignore list (RedHatAI Llama-3.2-*-Vision-Instruct-FP8-dynamic,
# recipe.yaml), in the hub layout its names were written for.
RECIPE_IGNORE = ["re:.*lm_head", "re:multi_modal_projector.*", "re:vision_model.*"]
# The same modules in transformers 5's in-memory names, which compressed-tensors matches.
_IN_MEMORY_IGNORE = ["re:.*lm_head", "re:.*multi_modal_projector", "re:.*vision_model\\..*"]


@dataclass(frozen=True)
class Variant:
    """How one test checkpoint is quantized."""

    name: str
    preset: str = "FP8_DYNAMIC"  # per-channel weights, dynamic per-token activations
    dtype: torch.dtype = torch.bfloat16  # the model's (and so the scales') dtype
    extra_ignore: tuple[str, ...] = ()  # in-memory names, besides the published layout's
    ignore: tuple[str, ...] | None = None  # instead of the published layout's
    # Write the recipe's regex list into config.json instead of the expanded names
    # compressed-tensors writes.
    recipe_ignore: bool = False


VARIANTS = {
    # The published checkpoints' layout and config.json: the ignore list expanded to names.
    "fp8-dynamic": Variant("fp8-dynamic"),
    # The same weights with the recipe's regex ignore list in config.json.
    "fp8-recipe": Variant("fp8-recipe", recipe_ignore=True),
    # One cross-attention layer (q, k|v, o) kept in bf16.
    "fp8-keep-cross": Variant(
        "fp8-keep-cross", extra_ignore=("re:model\\.language_model\\.layers\\.1\\.cross_attn\\..*",)
    ),
    # Per-tensor weight scales and static FP8 input scales (preset FP8), float32 scales.
    "fp8-tensor": Variant("fp8-tensor", preset="FP8", dtype=torch.float32),
    # Every linear but the LM head, the vision tower's (with biases) and the projector included.
    "fp8-all": Variant("fp8-all", ignore=("re:.*lm_head",)),
    # q_proj of one self-attention layer ignored, its k and v FP8: not servable fused.
    "fp8-partial": Variant(
        "fp8-partial", extra_ignore=("model.language_model.layers.0.self_attn.q_proj",)
    ),
}


def _calibrate(model: torch.nn.Module) -> None:
    """Weight scales from each row's (or the tensor's) min and max; input scales for static
    activation schemes from a fixed activation range (no calibration data is needed for
    weight-only serving)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight
        if scheme.weights.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale, zero_point = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        act = scheme.input_activations
        if act is not None and not act.dynamic:
            r = torch.tensor([-4.0, 4.0], dtype=w.dtype)
            s, _ = calculate_qparams(r[:1], r[1:], act)
            module.input_scale.data.copy_(s.reshape(module.input_scale.shape))
        module.quantization_status = QuantizationStatus.FROZEN


def make_checkpoint(dst: Path, variant: Variant, src: Path | None = None) -> Path:
    """Quantizes the tiny demo checkpoint (or ``src``) with compressed-tensors into ``dst``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import MllamaForConditionalGeneration

    src = src or demo_path()
    model = MllamaForConditionalGeneration.from_pretrained(str(src), dtype=variant.dtype)
    scheme = preset_name_to_scheme(variant.preset, ["Linear"])
    base = _IN_MEMORY_IGNORE if variant.ignore is None else list(variant.ignore)
    ignore = [*base, *variant.extra_ignore]
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    )
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    if variant.recipe_ignore:
        compressor.quantization_config.ignore = list(RECIPE_IGNORE)
    compressor.update_config(str(dst))
    for name in _KEEP:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def quantization_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def load_hf_fp8_model(path: Path, dtype: torch.dtype):
    """HF transformers running the folder decompressed: plain linears on fp8 x scale."""
    from transformers import CompressedTensorsConfig, MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(
        str(path), dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
