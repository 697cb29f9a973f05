"""Checkpoint loading: sharded safetensors, both name layouts, every error case, dummy weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_runner import demo_path
from safetensors.torch import load_file, save_file

from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.model_executor.models.mllama_weights import (
    WeightLoadError,
    expected_checkpoint_entries,
    to_hub_name,
    to_param_name,
)
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import build_demo_config
from vllm.transformers_utils.hub import resolve_model


def _load(path: Path, fmt: str = "auto") -> MllamaForConditionalGeneration:
    spec = load_mllama_config(path)
    return get_model(spec, path, fmt, torch.float32, torch.device("cpu"), 512)


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(demo_path(), dst)
    return dst


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_hub_names_round_trip(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    model = _load(ckpt)
    tensors = _all_tensors(ckpt)
    # Fused parameters hold the checkpoint tensors in their shards.
    qkv = model.language_model.model.layers[0].self_attn.qkv_proj.weight
    q = tensors["language_model.model.layers.0.self_attn.q_proj.weight"]
    v = tensors["language_model.model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(qkv[:q.shape[0]], q) and torch.equal(qkv[-v.shape[0]:], v)
    gate = model.language_model.model.layers[1].cross_attn_attn_gate
    assert torch.equal(gate, tensors["language_model.model.layers.1.cross_attn_attn_gate"])


def test_transformers5_names_load_identically(ckpt: Path, tmp_path: Path) -> None:
    hub = _all_tensors(ckpt)
    v5 = {}
    for name, t in hub.items():
        if name.startswith("language_model.lm_head."):
            v5["lm_head." + name[len("language_model.lm_head."):]] = t
        elif name.startswith("language_model.model."):
            v5["model.language_model." + name[len("language_model.model."):]] = t
        else:
            v5["model." + name] = t
    assert all(to_hub_name(n) in hub for n in v5)
    alt = tmp_path / "v5"
    alt.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(ckpt / f, alt / f)
    save_file(v5, str(alt / "model.safetensors"))
    a, b = _state(_load(ckpt)), _state(_load(alt))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_names_file(ckpt: Path) -> None:
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors.*missing"):
        _load(ckpt)


def test_corrupt_shard_names_file(ckpt: Path) -> None:
    f = ckpt / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="model-00001-of-00002.safetensors"):
        _load(ckpt)


def _rewrite(ckpt: Path, edit) -> None:
    f = ckpt / "model-00001-of-00002.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if v != f.name or k in tensors}
    index["weight_map"].update({k: f.name for k in tensors})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(ckpt: Path) -> None:
    victim = {}

    def drop(t: dict) -> None:
        name = sorted(t)[0]
        victim["name"] = name
        del t[name]

    _rewrite(ckpt, drop)
    with pytest.raises(WeightLoadError, match="missing 1 tensors") as e:
        _load(ckpt)
    param, shard = to_param_name(victim["name"])
    assert param in str(e.value) and (shard is None or f"[{shard}]" in str(e.value))


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.__setitem__("vision_model.extra.weight", torch.zeros(3)))
    with pytest.raises(WeightLoadError, match=r"model-00001-of-00002.*'vision_model.extra.weight'"):
        _load(ckpt)


def test_shape_mismatch_is_named(ckpt: Path) -> None:
    name = "multi_modal_projector.bias"

    def shrink(t: dict) -> None:
        if name in t:
            t[name] = t[name][:-1].clone()
        else:
            t[name] = torch.zeros(1)

    _rewrite(ckpt, shrink)
    with pytest.raises(WeightLoadError, match=r"'multi_modal_projector.bias'.*shape"):
        _load(ckpt)


def test_no_weight_files(tmp_path: Path) -> None:
    shutil.copy(demo_path() / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        _load(tmp_path)
    model = _load(tmp_path, "dummy")  # random weights need no files
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_dummy_weights_randomise_gates_and_are_deterministic() -> None:
    spec = load_mllama_config(demo_path())
    a = get_model(spec, None, "dummy", torch.float32, torch.device("cpu"), 256, seed=3)
    b = get_model(spec, None, "dummy", torch.float32, torch.device("cpu"), 256, seed=3)
    sa, sb = _state(a), _state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    gates = [v for k, v in sa.items() if k.endswith("gate")]
    assert gates and all((g.abs() > 0.2).all() for g in gates)


@pytest.mark.parametrize("name", ["demo/mllama-11b", "demo/mllama-90b", "demo/mllama-11b-base"])
def test_real_shapes_build_on_meta(name: str, tmp_path: Path) -> None:
    """The 11B/90B configs build (on the meta device) with the checkpoint's tensor set."""
    (tmp_path / "config.json").write_text(json.dumps(build_demo_config(name)))
    spec = load_mllama_config(tmp_path)
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(spec, max_position=256)
    entries = expected_checkpoint_entries(model)
    n_params = sum(p.numel() for p in model.parameters())
    if name == "demo/mllama-11b":
        assert n_params == 10_670_220_835  # Llama-3.2-11B-Vision-Instruct
    assert len(entries) > len(list(model.parameters()))  # fused params count their shards


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="demo"):
        resolve_model(str(tmp_path / "nope"))
