"""Loading FP8 weights: compressed-tensors checkpoints (the published layout with its expanded
ignore list, the recipe's regex list, one cross-attention layer kept in bf16, per-tensor
scales, both name layouts), their errors, ``--quantization fp8`` at load against the folder
compressed-tensors writes from the same weights, and FP8 dummy weights at the 11B/90B shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")  # the checkpoints are written by it
from helpers.fp8_checkpoints import quantization_config
from helpers.hf_runner import demo_path
from safetensors.torch import load_file, save_file

from vllm.model_executor.layers.linear import Linear, UnquantizedFormat
from vllm.model_executor.layers.quantization import QuantizationError
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8Format
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.model_executor.models.mllama_weights import WeightLoadError
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import build_demo_config

BF16 = torch.bfloat16
QKV0 = "language_model.model.layers.0.self_attn"
CROSS1 = "language_model.model.layers.1.cross_attn"


def _load(path: Path, quantization: str | None = "compressed-tensors", dtype=BF16):
    spec = load_mllama_config(path)
    return get_model(spec, path, "auto", dtype, torch.device("cpu"), 256, quantization=quantization)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def _fp8(model: torch.nn.Module) -> set[str]:
    return {n for n, m in _linears(model).items() if isinstance(m.fmt, Fp8Format)}


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qcfg: dict | None = None):
    """A checkpoint folder with ``src``'s files, ``tensors`` as its only shard and optionally
    another quantization_config."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(dst / "model.safetensors"))
    if qcfg is not None:
        raw = json.loads((dst / "config.json").read_text())
        raw["quantization_config"] = qcfg
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (FP8 tensors compared as bytes)."""
    if a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _text_linears(model: torch.nn.Module) -> set[str]:
    return {n for n in _linears(model) if n.startswith("language_model.model.")}


def test_published_layout_holds_the_checkpoint_bytes(fp8_checkpoint) -> None:
    """The expanded ignore list (vision tower, projector, LM head): every text-decoder linear
    is FP8, self and cross layers alike; a fused layer holds its shards' FP8 rows and scales
    stacked; the ignored layers hold the checkpoint's bf16 tensors."""
    path = fp8_checkpoint("fp8-dynamic")
    assert "language_model.lm_head" in quantization_config(path)["ignore"]
    model, t = _load(path), _tensors(path)
    assert _fp8(model) == _text_linears(model)
    linears = _linears(model)
    qkv = linears[f"{QKV0}.qkv_proj"]
    parts = [f"{QKV0}.{p}_proj" for p in "qkv"]
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.fp8_scale_dtype == BF16
    assert torch.equal(
        qkv.weight.view(torch.uint8), torch.cat([t[p + ".weight"] for p in parts]).view(torch.uint8)
    )
    assert torch.equal(
        qkv.weight_scale, torch.cat([t[p + ".weight_scale"] for p in parts]).view(-1).float()
    )
    kv = linears[f"{CROSS1}.kv_proj"]
    assert isinstance(kv.fmt, Fp8Format)
    for name in ("vision_model.transformer.layers.0.mlp.fc1", "multi_modal_projector"):
        assert linears[name].weight.dtype == BF16
        assert torch.equal(linears[name].weight, t[name + ".weight"])
    lm_head = model.language_model.lm_head
    assert isinstance(lm_head.fmt, UnquantizedFormat)
    assert torch.equal(lm_head.weight, t["language_model.lm_head.weight"])


def test_recipe_regex_list_loads_as_the_expanded_list(fp8_checkpoint) -> None:
    path = fp8_checkpoint("fp8-recipe")
    assert quantization_config(path)["ignore"][0].startswith("re:")
    a, b = _load(path).state_dict(), _load(fp8_checkpoint("fp8-dynamic")).state_dict()
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def test_expanded_list_keeps_one_cross_attention_layer_in_bf16(fp8_checkpoint) -> None:
    path = fp8_checkpoint("fp8-keep-cross")
    model, t = _load(path), _tensors(path)
    kept = {f"{CROSS1}.q_proj", f"{CROSS1}.kv_proj", f"{CROSS1}.o_proj"}
    assert _fp8(model) == _text_linears(model) - kept
    kv = _linears(model)[f"{CROSS1}.kv_proj"]
    assert torch.equal(
        kv.weight, torch.cat([t[f"{CROSS1}.k_proj.weight"], t[f"{CROSS1}.v_proj.weight"]])
    )


def test_per_tensor_float32_scales_and_dropped_input_scales(fp8_checkpoint) -> None:
    """Per-tensor scales of q, k and v each cover their own rows of the fused layer; float32
    scales are kept as the reference rounds with them; static input scales are dropped."""
    path = fp8_checkpoint("fp8-tensor")
    t = _tensors(path)
    assert any(k.endswith(".input_scale") for k in t)
    model = _load(path)
    qkv = _linears(model)[f"{QKV0}.qkv_proj"]
    assert qkv.fp8_scale_dtype == torch.float32 and qkv.fmt.per_tensor
    scales = [t[f"{QKV0}.{p}_proj.weight_scale"] for p in "qkv"]
    assert all(s.numel() == 1 and s.dtype == torch.float32 for s in scales)
    rows = [size for _, size in qkv.shards.values()]
    expected = torch.cat([s.reshape(1).expand(r) for s, r in zip(scales, rows, strict=True)])
    assert torch.equal(qkv.weight_scale, expected)


def test_transformers5_names_load_identically(fp8_checkpoint, tmp_path: Path) -> None:
    """Tensors and ignore list in transformers 5's names give the same model."""
    path = fp8_checkpoint("fp8-keep-cross")

    def v5(name: str) -> str:
        if name.startswith("language_model.lm_head"):
            return name.removeprefix("language_model.")
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name

    qcfg = quantization_config(path)
    qcfg["ignore"] = [v5(n) for n in qcfg["ignore"]]
    renamed = {v5(k): v for k, v in _tensors(path).items()}
    a = _load(path).state_dict()
    b = _load(_copy(path, tmp_path / "v5", renamed, qcfg)).state_dict()
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def test_partly_ignored_fused_group_is_an_error(fp8_checkpoint) -> None:
    """q_proj of one self-attention layer ignored, k and v FP8: refused, naming the group."""
    with pytest.raises(
        QuantizationError, match=rf"{QKV0}.qkv_proj: .*only part.*\['k', 'v'\] are FP8, \['q'\]"
    ):
        _load(fp8_checkpoint("fp8-partial"))


def test_tensors_that_contradict_the_config_are_named(fp8_checkpoint, tmp_path: Path) -> None:
    path = fp8_checkpoint("fp8-dynamic")
    qcfg = quantization_config(path)
    # The config quantizes the projector, but the checkpoint holds it in bf16.
    stricter = {**qcfg, "ignore": [n for n in qcfg["ignore"] if n != "multi_modal_projector"]}
    with pytest.raises(
        WeightLoadError, match=r"multi_modal_projector.weight.*float8_e4m3fn.*bfloat16"
    ):
        _load(_copy(path, tmp_path / "a", _tensors(path), stricter))
    # The config ignores a layer whose weight the checkpoint stores in FP8.
    looser = {**qcfg, "ignore": [*qcfg["ignore"], f"{CROSS1}.o_proj"]}
    with pytest.raises(WeightLoadError, match=rf"{CROSS1}.o_proj.weight.*not stored in FP8"):
        _load(_copy(path, tmp_path / "b", _tensors(path), looser))


def test_quantization_at_load_equals_the_compressed_tensors_folder(fp8_checkpoint) -> None:
    """The demo checkpoint (float32) quantized to FP8 while it streams, in bf16, holds bitwise
    what compressed-tensors wrote for the same weights in bf16 (values and scales), in the
    published layout."""
    ours = _load(demo_path(), quantization="fp8")
    theirs = _load(fp8_checkpoint("fp8-dynamic"))
    assert _fp8(ours) == _fp8(theirs)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not _same(a[k], b[k])] == []


def test_dummy_fp8_weights_have_the_published_layout() -> None:
    spec = load_mllama_config(demo_path())
    a, b = (
        get_model(spec, None, "dummy", BF16, torch.device("cpu"), 256, seed=5, quantization="fp8")
        for _ in range(2)
    )
    assert _fp8(a) == _text_linears(a)
    for name in _fp8(a):
        m = _linears(a)[name]
        w = m.fmt.dequantize(m, BF16)
        assert torch.isfinite(w).all() and w.abs().max() > 0
    assert a.vision_model.transformer.layers[0].mlp.fc1.weight.dtype == BF16
    sa, sb = a.state_dict(), b.state_dict()
    assert all(_same(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    ("name", "gigabytes"), [("demo/mllama-11b", 12.62), ("demo/mllama-90b", 91.6)]
)
def test_fp8_weight_bytes_match_the_published_checkpoints(
    tmp_path: Path, name: str, gigabytes: float
) -> None:
    """Built on the meta device in the published FP8 layout, the 11B model stores the 12.62 GB
    of RedHatAI's FP8-dynamic shards, the 90B 91.6 GB (quantization.md sections 3, 5): FP8
    weights, bf16 channel scales (held in float32 here: +2 bytes a row)."""
    (tmp_path / "config.json").write_text(json.dumps(build_demo_config(name)))
    spec = load_mllama_config(tmp_path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device("meta"):
            model = MllamaForConditionalGeneration(spec, 256, Fp8Config())
    finally:
        torch.set_default_dtype(old)
    stored = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert abs(stored / (gigabytes * 1e9) - 1) < 0.005


def test_90b_fits_one_h200_in_fp8_not_in_bf16() -> None:
    """The up-front memory check: 90B's bf16 weights do not fit in 0.9 of an H200 (and the
    refusal names the FP8 flag); its FP8 weights (and the dequantization scratch) do."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.worker.memory import check_device_memory, weight_bytes

    h200 = 143_771 << 20  # bytes the device reports
    args = dict(model="demo/mllama-90b", load_format="dummy", max_model_len=8192)
    bf16 = EngineArgs(**args).create_engine_config()
    with pytest.raises(ValueError, match=r"weights alone need .* in bfloat16.*--quantization fp8"):
        check_device_memory(bf16, h200)
    fp8 = EngineArgs(**args, quantization="fp8").create_engine_config()
    assert abs(weight_bytes(fp8) / 1e9 - 92.6) < 0.2  # 91.6 GB + the 0.94 GB gate|up scratch
    check_device_memory(fp8, h200)


def test_zero_points_are_dropped_when_symmetric(fp8_checkpoint, tmp_path: Path) -> None:
    """Checkpoints that kept all-zero weight zero points load as the others; non-zero ones
    (asymmetric) are refused, naming the tensor."""
    path = fp8_checkpoint("fp8-dynamic")
    t = _tensors(path)
    zp = f"{QKV0}.k_proj.weight_zero_point"
    t[zp] = torch.zeros(t[f"{QKV0}.k_proj.weight_scale"].shape, dtype=BF16)
    a = _load(path).state_dict()
    b = _load(_copy(path, tmp_path / "zero", t)).state_dict()
    assert all(_same(a[k], b[k]) for k in a)
    t[zp][0] = 3
    with pytest.raises(WeightLoadError, match=rf"'{zp}': non-zero weight zero points"):
        _load(_copy(path, tmp_path / "nonzero", t))


def test_quantization_at_load_in_row_chunks_equals_the_whole(monkeypatch) -> None:
    """Large tensors are quantized a few rows at a time (bounded device memory): per-channel
    scales make that exact; a fused layer's shards land in their own rows."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.quantization import fp8

    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 7 * 64)  # 7 rows a step
    g = torch.Generator().manual_seed(3)
    layer = linear.MergedLinear(
        64, [40, 24], ["gate", "up"], fmt=Fp8Format(quantize_on_load=True, dtype=BF16)
    )
    ws = [torch.randn(n, 64, generator=g) for n in (40, 24)]
    for name, w in zip(("gate", "up"), ws, strict=True):
        layer.weight.weight_loader(layer.weight, w, name)
    q, s = fp8.quantize_fp8(torch.cat(ws).to(BF16))
    assert _same(layer.weight, q) and torch.equal(layer.weight_scale, s.view(-1).float())
    assert layer.fp8_scale_dtype == BF16
