"""``--quantization`` / ``--load-format`` as vLLM takes them, and detection from config.json's
``quantization_config``: what is accepted, what each refusal names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.hf_runner import demo_path

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
    for method in ("awq", "fp8", "gptq"):
        with pytest.raises(
            ValueError,
            match=rf"quantization='{method}' is not supported yet.*"
            "bitsandbytes 4-bit",
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
        (
            {"quant_method": "compressed-tensors", "format": "float-quantized"},
            "'compressed-tensors'.*supported: bitsandbytes 4-bit",
        ),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'.*supported: bitsandbytes 4-bit"),
        ({"bits": 4}, "quant_method` is missing"),
    ],
)
def test_checkpoint_methods_not_built_are_refused(tmp_path: Path, block: dict, match: str) -> None:
    path = _with_quant_config(tmp_path, block)
    for quantization in (None, "bitsandbytes"):
        with pytest.raises(ValueError, match=match):
            _config(EngineArgs(model=str(path), quantization=quantization))
