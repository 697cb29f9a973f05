"""Loading bitsandbytes 4-bit weights: pre-quantized checkpoints written by transformers +
bitsandbytes (both name layouts, a skip list), their errors, quantization at load and 4-bit
dummy weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_runner import demo_path
from safetensors.torch import load_file, save_file

from vllm.model_executor.layers.linear import Linear, UnquantizedFormat
from vllm.model_executor.layers.quantization.bitsandbytes import (
    BitsAndBytesConfig,
    Bnb4bitFormat,
    QuantizationError,
)
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.model_executor.models.mllama_weights import WeightLoadError
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import build_demo_config

BF16 = torch.bfloat16
QKV0 = "language_model.model.layers.0.self_attn"


def _load(
    path: Path, quantization: str | None = "bitsandbytes", fmt: str = "auto"
) -> MllamaForConditionalGeneration:
    spec = load_mllama_config(path)
    return get_model(spec, path, fmt, BF16, torch.device("cpu"), 256, quantization=quantization)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint folder with ``src``'s files and ``tensors`` as its only shard."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_prequantized_layers_hold_the_checkpoint_bytes(bnb_checkpoint) -> None:
    """Every linear but the LM head is 4-bit, vision and cross layers included; a fused layer
    holds its shards' packed rows and scales stacked; the 4-bit layers store exactly the
    checkpoint's packed bytes, block scales and second-level scales."""
    path = bnb_checkpoint("nf4")
    model, t = _load(path), _tensors(path)
    linears = _linears(model)
    quantized = {n for n, m in linears.items() if isinstance(m.fmt, Bnb4bitFormat)}
    assert quantized == set(linears) - {"language_model.lm_head"}
    assert torch.equal(model.language_model.lm_head.weight, t["language_model.lm_head.weight"])
    qkv = linears[f"{QKV0}.qkv_proj"]
    parts = [f"{QKV0}.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(qkv.weight.view(-1), torch.cat([t[p].view(-1) for p in parts]))
    assert torch.equal(qkv.absmax.view(-1), torch.cat([t[p + ".absmax"] for p in parts]))
    assert torch.equal(qkv.nested_absmax, torch.cat([t[p + ".nested_absmax"] for p in parts]))
    offsets = [
        json.loads(bytes(t[p + ".quant_state.bitsandbytes__nf4"].tolist()))["nested_offset"]
        for p in parts
    ]
    assert qkv.shard_offsets.tolist() == offsets
    stored = sum(
        m.weight.nbytes + m.absmax.nbytes + m.nested_absmax.nbytes
        for n, m in linears.items()
        if n in quantized
    )
    on_disk = sum(
        v.nbytes
        for k, v in t.items()
        if k.endswith((".weight", ".absmax", ".nested_absmax")) and v.dtype != BF16
    )
    assert stored == on_disk


def test_skip_list_layers_load_in_dtype(bnb_checkpoint) -> None:
    """A layer is 4-bit exactly when the checkpoint quantized it: the skipped ones (a whole
    self-attention block, the projector, cross-attention outputs, one vision fc2) load in bf16."""
    path = bnb_checkpoint("nf4-skip")
    model, t = _load(path), _tensors(path)
    linears = _linears(model)
    plain = {n for n, m in linears.items() if isinstance(m.fmt, UnquantizedFormat)}
    assert plain == {
        "language_model.lm_head",
        "multi_modal_projector",
        f"{QKV0}.qkv_proj",
        f"{QKV0}.o_proj",
        "language_model.model.layers.1.cross_attn.o_proj",
        "language_model.model.layers.3.cross_attn.o_proj",
        "vision_model.transformer.layers.1.mlp.fc2",
    }
    qkv = linears[f"{QKV0}.qkv_proj"].weight
    assert torch.equal(qkv, torch.cat([t[f"{QKV0}.{p}_proj.weight"] for p in "qkv"]))
    assert isinstance(linears["vision_model.transformer.layers.0.mlp.fc2"].fmt, Bnb4bitFormat)


def test_transformers5_names_load_identically(bnb_checkpoint, tmp_path: Path) -> None:
    path = bnb_checkpoint("fp4")
    renamed = {}
    for name, v in _tensors(path).items():
        if name.startswith("language_model.lm_head."):
            renamed["lm_head." + name.removeprefix("language_model.lm_head.")] = v
        elif name.startswith("language_model.model."):
            renamed["model.language_model." + name.removeprefix("language_model.model.")] = v
        else:
            renamed["model." + name] = v
    a = _load(path).state_dict()
    b = _load(_copy(path, tmp_path / "v5", renamed)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_partly_quantized_fused_group_is_an_error(bnb_checkpoint, tmp_path: Path) -> None:
    """k_proj of one q|k|v group stored in bf16, q and v in 4-bit: refused, naming the group."""
    path = bnb_checkpoint("nf4")
    t = _tensors(path)
    k = f"{QKV0}.k_proj.weight"
    for name in [n for n in t if n.startswith(k + ".")]:
        del t[name]
    t[k] = torch.zeros(32, 64, dtype=BF16)
    with pytest.raises(QuantizationError, match=rf"{QKV0}.qkv_proj: .*only part.*\['k'\]"):
        _load(_copy(path, tmp_path / "partial", t))


def test_missing_statistics_are_named(bnb_checkpoint, tmp_path: Path) -> None:
    path = bnb_checkpoint("nf4")
    t = _tensors(path)
    del t[f"{QKV0}.v_proj.weight.nested_absmax"]
    with pytest.raises(
        WeightLoadError, match=rf"'{QKV0}.v_proj.weight' is missing .*nested_absmax"
    ):
        _load(_copy(path, tmp_path / "missing", t))


def test_quantization_at_load_equals_the_bitsandbytes_checkpoint(bnb_checkpoint) -> None:
    """The demo checkpoint (float32) quantized while it streams holds bitwise what
    transformers + bitsandbytes wrote for the same weights in bf16."""
    ours = _load(demo_path()).state_dict()
    theirs = _load(bnb_checkpoint("nf4")).state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


def test_dummy_4bit_weights_have_the_unsloth_layout() -> None:
    spec = load_mllama_config(demo_path())
    a, b = (
        get_model(
            spec, None, "dummy", BF16, torch.device("cpu"), 256, seed=5, quantization="bitsandbytes"
        )
        for _ in range(2)
    )
    linears = _linears(a)
    assert {n for n, m in linears.items() if isinstance(m.fmt, UnquantizedFormat)} == {
        "language_model.lm_head"
    }
    for m in linears.values():
        if isinstance(m.fmt, Bnb4bitFormat):
            assert m.fmt.spec.nested and m.absmax.dtype == torch.uint8
            assert torch.isfinite(m.fmt.dequantize(m, BF16)).all()
    assert a.language_model.model.embed_tokens.weight.dtype == BF16
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # deterministic for a seed


def test_11b_nf4_weight_bytes_match_the_published_checkpoint(tmp_path: Path) -> None:
    """Built on the meta device in the dummy layout, the 11B model stores 7.18 GB, the size of
    unsloth's Llama-3.2-11B-Vision-Instruct-bnb-4bit shards (quantization.md 1.5)."""
    (tmp_path / "config.json").write_text(json.dumps(build_demo_config("demo/mllama-11b")))
    spec = load_mllama_config(tmp_path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device("meta"):
            model = MllamaForConditionalGeneration(spec, 256, BitsAndBytesConfig())
    finally:
        torch.set_default_dtype(old)
    stored = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert abs(stored / 7.18e9 - 1) < 0.005
