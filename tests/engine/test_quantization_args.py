"""``--quantization`` / ``--load-format`` as vLLM takes them, and detection from config.json's
``quantization_config``: what is accepted, what each refusal names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.hf_runner import demo_path, full_size_config_folder

from vllm.config import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import make_parser


def _config(args: EngineArgs) -> ModelConfig:
    return args.create_engine_config().model_config


def _with_quant_config(tmp_path: Path, block: dict) -> Path:
    """The demo checkpoint's config.json (no weights needed) with a quantization_config."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_path() / name, dst / name)
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = block
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


BNB_4BIT = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "bnb_4bit_quant_storage": "uint8",
    "llm_int8_skip_modules": None,
}


def test_flags_parse_as_vllm_spells_them() -> None:
    args = make_parser().parse_args(
        [
            "serve",
            "demo/mllama-tiny",
            "--quantization",
            "bitsandbytes",
            "--load-format",
            "bitsandbytes",
        ]
    )
    assert (args.quantization, args.load_format) == ("bitsandbytes", "bitsandbytes")
    mc = _config(
        EngineArgs(
            model="demo/mllama-tiny", quantization="bitsandbytes", load_format="bitsandbytes"
        )
    )
    assert (mc.quantization, mc.load_format) == ("bitsandbytes", "bitsandbytes")


def test_unbuilt_methods_are_refused_naming_what_is_supported() -> None:
    for method in ("awq", "gptq", "bitsandbytes-8bit"):
        with pytest.raises(
            ValueError,
            match=rf"quantization='{method}' is not supported;.*bitsandbytes 4-bit.*"
            "compressed-tensors.*quantization='fp8'",
        ):
            _config(EngineArgs(model="demo/mllama-tiny", quantization=method))
    with pytest.raises(ValueError, match="load_format='bitsandbytes' needs quantization="):
        _config(EngineArgs(model="demo/mllama-tiny", load_format="bitsandbytes"))


def test_detected_from_config_json(tmp_path: Path) -> None:
    path = _with_quant_config(tmp_path, BNB_4BIT)
    assert _config(EngineArgs(model=str(path))).quantization == "bitsandbytes"
    mc = _config(EngineArgs(model=str(path), load_format="bitsandbytes"))
    assert mc.quantization == "bitsandbytes"


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({**BNB_4BIT, "load_in_4bit": False, "load_in_8bit": True}, "8-bit bitsandbytes"),
        ({**BNB_4BIT, "bnb_4bit_quant_storage": "bfloat16"}, "quant_storage='bfloat16'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'.*supported: bitsandbytes 4-bit"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            "'fp8'.*supported: bitsandbytes",
        ),
        ({"bits": 4}, "quant_method` is missing"),
    ],
)
def test_checkpoint_methods_not_built_are_refused(tmp_path: Path, block: dict, match: str) -> None:
    path = _with_quant_config(tmp_path, block)
    for quantization in (None, "bitsandbytes"):
        with pytest.raises(ValueError, match=match):
            _config(EngineArgs(model=str(path), quantization=quantization))


# The config.json block of RedHatAI's FP8-dynamic checkpoints (quantization.md section 3).
FP8_DYNAMIC = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "actorder": None,
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": None,
                "observer_kwargs": {},
                "strategy": "token",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": 1.36,
    "ignore": ["language_model.lm_head", "multi_modal_projector"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def test_fp8_methods_and_detection(tmp_path: Path) -> None:
    """``fp8`` quantizes at load (with dummy weights too); a compressed-tensors FP8 checkpoint
    is detected from config.json (``quantization_config``, or the older
    ``compression_config``), and the flag must agree with it."""
    assert _config(EngineArgs(model="demo/mllama-tiny", quantization="fp8")).quantization == "fp8"
    full = full_size_config_folder(tmp_path / "11b", "demo/mllama-11b")
    mc = _config(EngineArgs(model=str(full), load_format="dummy", quantization="fp8"))
    assert mc.quantization == "fp8"
    path = _with_quant_config(tmp_path, FP8_DYNAMIC)
    for flag in (None, "compressed-tensors"):
        assert _config(EngineArgs(model=str(path), quantization=flag)).quantization == (
            "compressed-tensors"
        )
    for flag in ("fp8", "bitsandbytes"):
        with pytest.raises(
            ValueError,
            match=rf"quantization='{flag}' does not match .*"
            "'compressed-tensors'",
        ):
            _config(EngineArgs(model=str(path), quantization=flag))
    raw = json.loads((path / "config.json").read_text())
    raw["compression_config"] = raw.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(raw))
    assert _config(EngineArgs(model=str(path))).quantization == "compressed-tensors"
    with pytest.raises(
        ValueError,
        match="needs a checkpoint whose config.json has a compressed-tensors.*quantization='fp8'",
    ):
        _config(EngineArgs(model="demo/mllama-tiny", quantization="compressed-tensors"))


def _group(**weights: object) -> dict:
    block = json.loads(json.dumps(FP8_DYNAMIC))
    block["config_groups"]["group_0"]["weights"].update(weights)
    return block


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (_group(num_bits=4, type="int"), "4-bit int weights"),
        (_group(strategy="group", group_size=128), "weight strategy 'group'"),
        (_group(strategy="block", block_structure=[128, 128]), "weight strategy 'block'"),
        ({**FP8_DYNAMIC, "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({**FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        (
            {
                **FP8_DYNAMIC,
                "config_groups": {
                    "g": {**FP8_DYNAMIC["config_groups"]["group_0"], "targets": ["MllamaTextMLP"]}
                },
            },
            "targets the class 'MllamaTextMLP'",
        ),
        (
            {
                **FP8_DYNAMIC,
                "config_groups": {
                    "g": {
                        **FP8_DYNAMIC["config_groups"]["group_0"],
                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"},
                    }
                },
            },
            "quantizes input activations",
        ),
    ],
)
def test_compressed_tensors_schemes_not_served_are_refused(
    tmp_path: Path, block: dict, match: str
) -> None:
    path = _with_quant_config(tmp_path, block)
    with pytest.raises(ValueError, match=rf"{match}.*(supported|'auto')"):
        _config(EngineArgs(model=str(path)))


def test_kv_cache_dtype_reaches_the_cache_config_and_unknown_ones_are_refused() -> None:
    for dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        cfg = EngineArgs(model="demo/mllama-tiny", kv_cache_dtype=dtype).create_engine_config()
        assert cfg.cache_config.kv_cache_dtype == dtype
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        _config(EngineArgs(model="demo/mllama-tiny", kv_cache_dtype="int8"))
