"""FP8 weights: compressed-tensors checkpoints, quantization at load, dummy weights.

A compressed-tensors ``float-quantized`` checkpoint stores for each quantized ``X.weight`` the
float8_e4m3fn matrix and ``X.weight_scale`` (per channel [N, 1], or per tensor); static
activation schemes add ``X.input_scale``, which this engine drops (activations are not
quantized). Which layers are FP8 is decided from config.json's ``quantization_config`` (its
targets and ``ignore`` list) before the model is built; each tensor's dtype and shape are then
checked by the layer that receives it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.compressed_tensors import parse_compressed_tensors
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.model_loader.quant_plan import QuantPlan, Weights
from vllm.model_executor.models.mllama_weights import WeightLoadError
from vllm.transformers_utils.config import QuantSpec

logger = init_logger(__name__)

_ACTIVATION_SCALES = (".input_scale", ".input_zero_point")


def drop_activation_scales(weights: Weights) -> Iterator[tuple[str, object, str]]:
    """Passes the tensors through but the static activation scales (weight-only numerics) and
    the all-zero weight zero points some versions of compressed-tensors wrote (symmetric)."""
    dropped = 0
    for name, tensor, file in weights:
        if name.endswith(_ACTIVATION_SCALES):
            dropped += 1
            continue
        if name.endswith(".weight_zero_point"):
            if torch.count_nonzero(tensor):
                raise WeightLoadError(
                    f"{file}: tensor {name!r}: non-zero weight zero points (asymmetric FP8) "
                    "are not supported; symmetric FP8 weights are"
                )
            continue
        yield name, tensor, file
    if dropped:
        logger.info(
            "Dropped %d static activation scales (input_scale): FP8 weights run weight-only, "
            "activations stay unquantized",
            dropped,
        )


def fp8_plan(quantization: str, checkpoint: QuantSpec | None, dummy: bool) -> QuantPlan:
    """``quantization``: ``compressed-tensors`` (the checkpoint's scheme) or ``fp8`` (per-channel
    FP8 quantized as the tensors stream). Dummy weights take the published layout either way."""
    if quantization == "compressed-tensors" and not dummy:
        if checkpoint is None or checkpoint.method != "compressed-tensors":
            raise ValueError(
                "quantization='compressed-tensors' needs a compressed-tensors quantization_config"
                " in config.json"
            )
        scheme = parse_compressed_tensors(checkpoint.config)
        return QuantPlan(Fp8Config(scheme), stream=drop_activation_scales)
    return QuantPlan(Fp8Config())
