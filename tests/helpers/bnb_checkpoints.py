"""bitsandbytes 4-bit test weights, made by the real tools.

Checkpoints: transformers quantizes the tiny demo checkpoint with bitsandbytes on the CPU and
``save_pretrained`` writes it, exactly as users' pre-quantized checkpoints are made
(quantization.md section 9). Every quantized linear of the demo model has an input width that is
a multiple of 64, as bitsandbytes' CPU path needs. Layers: ``bnb_layer`` loads matrices
quantized by ``bitsandbytes.functional.quantize_4bit`` into a 4-bit layer.

The HF reference running such a checkpoint: bitsandbytes' CPU forward has a fast path on
AVX512-BF16 machines that first rounds the block scales to bfloat16 (its numerics then depend on
the machine); the reference turns it off, so every CPU runs bitsandbytes' portable forward,
``dequantize_4bit`` and a matmul.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bitsandbytes.functional as bnbf
import torch

from helpers.hf_runner import demo_path
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.quantization.bitsandbytes import Bnb4bitFormat, Bnb4bitSpec
from vllm.model_executor.layers.quantization.bnb_codec import Packed4bit, QuantState4bit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The demo folder's files other than the weights (tokenizer, chat template, processor).
_KEEP = (
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class Variant:
    """How one test checkpoint is quantized."""

    name: str
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: torch.dtype = torch.bfloat16
    skip: tuple[str, ...] | None = None  # llm_int8_skip_modules (None: transformers' default)
    extra: dict = field(default_factory=dict)


VARIANTS = {
    # Everything transformers quantizes by default: every linear but the LM head, the vision
    # tower, projector and cross-attention included.
    "nf4": Variant("nf4"),
    # An unsloth-style skip list: the projector, one self-attention block, one vision fc2 and
    # the cross-attention output projections stay bf16.
    "nf4-skip": Variant(
        "nf4-skip",
        skip=(
            "lm_head",
            "multi_modal_projector",
            "model.language_model.layers.0.self_attn",
            "model.vision_model.transformer.layers.1.mlp.fc2",
            "cross_attn.o_proj",
        ),
    ),
    # FP4 codes with plain float32 block scales (no double quantization).
    "fp4": Variant("fp4", quant_type="fp4", double_quant=False),
    # The upstream PR's own test ran fp16.
    "nf4-fp16": Variant("nf4-fp16", compute_dtype=torch.float16),
}


def make_checkpoint(dst: Path, variant: Variant, src: Path | None = None) -> Path:
    """Quantizes the tiny demo checkpoint (or ``src``) with transformers + bitsandbytes into
    ``dst``."""
    from transformers import BitsAndBytesConfig, MllamaForConditionalGeneration

    src = src or demo_path()
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=variant.quant_type,
        bnb_4bit_use_double_quant=variant.double_quant,
        bnb_4bit_compute_dtype=variant.compute_dtype,
        llm_int8_skip_modules=list(variant.skip) if variant.skip else None,
    )
    model = MllamaForConditionalGeneration.from_pretrained(
        str(src), quantization_config=cfg, dtype=variant.compute_dtype
    )
    model.save_pretrained(str(dst))
    for name in _KEEP:
        shutil.copy(src / name, dst / name)
    return dst


def load_hf_bnb_model(path: Path, dtype: torch.dtype):
    """HF transformers running a bitsandbytes checkpoint, on bitsandbytes' portable CPU path."""
    from bitsandbytes.nn import Linear4bit
    from transformers import MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(str(path), dtype=dtype).eval()
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def packed_from_bnb(q: torch.Tensor, st: Any) -> Packed4bit:
    """A bitsandbytes ``QuantState`` as the checkpoint loader receives it."""
    state = QuantState4bit(
        st.quant_type,
        st.blocksize,
        tuple(st.shape),
        str(st.dtype).removeprefix("torch."),
        st.nested,
    )
    if not st.nested:
        return Packed4bit(state, q, st.absmax)
    return Packed4bit(state, q, st.absmax, st.state2.absmax, st.state2.code, st.offset)


def bnb_layer(
    shards: list[int],
    k: int,
    quant_type: str = "nf4",
    blocksize: int = 64,
    nested: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    bias: bool = False,
) -> tuple[Linear, torch.Tensor]:
    """A 4-bit layer holding bitsandbytes-quantized shards, and ``dequantize_4bit`` of them."""
    g = torch.Generator().manual_seed(seed)
    fmt = Bnb4bitFormat(Bnb4bitSpec(quant_type, blocksize, nested), dtype=dtype)
    names = ["q", "k", "v"] if len(shards) == 3 else ["gate", "up"][: len(shards)]
    if len(shards) > 1:
        layer = MergedLinear(k, shards, names, fmt=fmt)
    else:
        layer = Linear(k, shards[0], bias=bias, fmt=fmt)
        names = [None]  # type: ignore[list-item]
    layer = layer.to(DEVICE)
    refs = []
    for name, n in zip(names, shards, strict=True):
        w = (0.05 * torch.randn(n, k, generator=g)).to(DEVICE, dtype)
        q, st = bnbf.quantize_4bit(
            w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
        )
        layer.weight.weight_loader(layer.weight, packed_from_bnb(q, st), name)
        refs.append(bnbf.dequantize_4bit(q, st))
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(shards[0], generator=g).to(dtype))
    return layer, torch.cat(refs)
