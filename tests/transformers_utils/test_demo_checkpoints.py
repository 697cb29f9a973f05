"""Built-in demo checkpoints: determinism, Hugging Face compatibility, tokenizer, cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm.transformers_utils import demo_checkpoints as dc
from vllm.transformers_utils import demo_tokenizer as dtok
from vllm.transformers_utils.config import load_mllama_config

TINY = "demo/mllama-tiny"
HUB_TO_MEMORY = (  # transformers 5 renames hub names on load (reference §3.3)
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_model.", "model.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    dc.build_demo_checkpoint(TINY, out)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> tuple[Any, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.MllamaForConditionalGeneration.from_pretrained(
        tiny_dir, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def processor(tiny_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoProcessor.from_pretrained(tiny_dir)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _to_memory_name(hub_name: str) -> str:
    for old, new in HUB_TO_MEMORY:
        if hub_name.startswith(old):
            return new + hub_name[len(old) :]
    raise AssertionError(hub_name)


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / shard))
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in out.values())
    return out


def test_tiny_build_is_byte_identical(tmp_path: Path, tiny_dir: Path) -> None:
    dc.build_demo_checkpoint(TINY, tmp_path / "again")
    first, second = _digests(tiny_dir), _digests(tmp_path / "again")
    assert first == second
    expected = {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "preprocessor_config.json", "chat_template.jinja", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", dc.MARKER_FILE,
    }  # fmt: skip
    assert set(first) == expected


def test_tiny_weights_match_hf_names_and_shapes(tiny_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    ratios = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
    cfg = MllamaConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, cross_attention_layers=[1, 3], num_attention_heads=4,
            num_key_value_heads=2, rope_parameters=rope, rms_norm_eps=1e-5, bos_token_id=256,
            eos_token_id=[257, 264, 265], pad_token_id=260, tie_word_embeddings=False),
        vision_config=dict(hidden_size=64, attention_heads=4, intermediate_size=256,
            num_hidden_layers=4, num_global_layers=2, image_size=56, patch_size=14,
            max_num_tiles=4, intermediate_layers_indices=[1, 3], vision_output_dim=192,
            supported_aspect_ratios=ratios, norm_eps=1e-5),
        image_token_index=512,
    )  # fmt: skip
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(cfg)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tensors = _tensors(tiny_dir)
    got = {_to_memory_name(n): t.shape for n, t in tensors.items()}
    assert got == expected
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tensors.values())
    gates = [t for n, t in tensors.items() if n.endswith(("gate", "gate_attn", "gate_ffn"))]
    assert len(gates) == 2 * 2 + 3 + 2 * 2  # cross layers x 2, 3 embedding gates, global x 2
    assert all(0.25 <= float(g[0]) <= 1.75 for g in gates)


def test_hf_loads_tiny_cleanly(hf_model: tuple[Any, dict[str, Any]]) -> None:
    _, info = hf_model
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys


def _logits(model: Any, **inputs: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(**inputs).logits[0]


def test_tiny_logits_are_finite_spread_and_see_images(
    hf_model: tuple[Any, dict[str, Any]], processor: Any
) -> None:
    from PIL import Image

    model, _ = hf_model
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 90, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]  # fmt: skip
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[image], return_tensors="pt", add_special_tokens=False)
    with_image = _logits(model, **inputs)
    text_only = _logits(model, input_ids=inputs["input_ids"])
    assert with_image.isfinite().all() and text_only.isfinite().all()
    first = int((inputs["input_ids"][0] == 512).nonzero()[0, 0])
    assert (with_image[first:] - text_only[first:]).abs().max() > 0.1
    for logits in (with_image, text_only):
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).median() > 0.05
        assert 1.0 < logits.std() < 10.0


def test_tiny_tokenizer_ids_and_round_trip(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = {
        "<|begin_of_text|>": 256, "<|end_of_text|>": 257, "<|reserved_special_token_0|>": 258,
        "<|reserved_special_token_1|>": 259, "<|finetune_right_pad_id|>": 260,
        "<|step_id|>": 261, "<|start_header_id|>": 262, "<|end_header_id|>": 263,
        "<|eom_id|>": 264, "<|eot_id|>": 265, "<|python_tag|>": 266,
        "<|reserved_special_token_2|>": 267, "<|reserved_special_token_246|>": 511,
        "<|image|>": 512,
    }  # fmt: skip
    assert {t: tok.convert_tokens_to_ids(t) for t in ids} == ids
    assert len(tok) == 513
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 265, 260)
    assert tok.model_max_length == 131072
    text = "Grüße, 世界! naïve café 🚀\n\ttabs"
    encoded = tok(text)["input_ids"]
    assert encoded[0] == 256 and encoded[1:] == list(text.encode("utf-8"))
    assert tok.decode(encoded, skip_special_tokens=True) == text
    assert tok("<|image|>hi", add_special_tokens=False)["input_ids"] == [512, 104, 105]


def test_chat_template_renders_llama32_vision_format(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)

    def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return tok.apply_chat_template(messages, tokenize=False, **kwargs)

    image_turn = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe it."}]}]  # fmt: skip
    assert render(image_turn, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>Describe it."
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    parts = [{"type": "text", "text": "A"}, {"type": "image_url", "image_url": {"url": "x"}}]
    url_turn = [{"role": "user", "content": parts}]
    assert render(url_turn).endswith("user<|end_header_id|>\n\nA<|image|><|eot_id|>")
    text_turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(text_turns) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
    )
    system = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    assert render(system, date_string="01 Jan 2025").startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\nBe brief.<|eot_id|>"
    )
    with pytest.raises(Exception, match="incompatible with system messages"):
        render([system[0], *image_turn])


def test_processor_loads_and_tiles(tiny_dir: Path, processor: Any) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, MllamaProcessor

    assert isinstance(processor, MllamaProcessor)
    image_processor = AutoImageProcessor.from_pretrained(tiny_dir)
    image = Image.new("RGB", (90, 40), (200, 30, 30))  # PIL size is (width, height)
    out = image_processor(images=[[image]], return_tensors="np")
    assert out["pixel_values"].shape == (1, 1, 4, 3, 56, 56)
    assert out["aspect_ratio_ids"].tolist() == [[2]]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    )
    batch = processor(text=prompt, images=[image], return_tensors="np", add_special_tokens=False)
    assert batch["pixel_values"].shape == (1, 1, 4, 3, 56, 56)
    assert batch["aspect_ratio_ids"].tolist() == [[2]]
    assert batch["cross_attention_mask"].shape[2:] == (1, 4)


@pytest.mark.parametrize("name", list(dc.DEMO_MODELS))
def test_every_demo_config_parses(name: str, tmp_path: Path) -> None:
    config = dc.build_demo_config(name)
    dtok.write_json(tmp_path / "config.json", config)
    spec = load_mllama_config(tmp_path)
    assert spec.text.rope.rope_type == "llama3" and spec.text.rope.factor == 8.0
    assert spec.image_token_id == spec.text.vocab_size == (512 if name == TINY else 128256)
    assert spec.text.num_hidden_layers == len(spec.text.self_attention_layers) + len(
        spec.text.cross_attention_layers
    )
    assert spec.vision.max_aspect_ratio_id == 8
    if name != TINY:
        base = name.endswith("base")
        assert spec.vision.tokens_per_tile == (1025 if base else 1601)
        assert spec.text.eos_token_ids == ((128001,) if base else (128001, 128008, 128009))


def test_full_size_parameter_counts() -> None:
    def count(name: str) -> int:
        shapes = dc.weight_shapes(dc.build_demo_config(name))
        return sum(int(np.prod(s)) for s in shapes.values())

    assert count("demo/mllama-11b") == 10_670_220_835  # reference §6, HF meta-device count
    assert count("demo/mllama-11b-base") == 10_642_941_475
    assert count(TINY) == 607_691
    assert 88e9 < count("demo/mllama-90b") < 89e9


def test_full_size_configs_need_no_llama_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert dc.build_demo_config("demo/mllama-90b")["text_config"]["hidden_size"] == 8192
    with pytest.raises(dtok.DemoCheckpointError, match="pip install llama-models"):
        dtok.llama3_ranks_path()


def test_llama3_tokenizer_matches_meta(tmp_path: Path) -> None:
    pytest.importorskip("llama_models")
    from tokenizers import Tokenizer

    dc.build_demo_checkpoint("demo/mllama-11b", tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("Hello world! This is a test.").ids == [
        128000, 9906, 1917, 0, 1115, 374, 264, 1296, 13]  # fmt: skip
    assert tok.get_vocab_size() == 128257
    for token, expected in (("<|begin_of_text|>", 128000), ("<|finetune_right_pad_id|>", 128004),
                            ("<|eot_id|>", 128009), ("<|image|>", 128256)):  # fmt: skip
        assert tok.token_to_id(token) == expected
    text = "naïve café — 東京 🚀  x = 12345;\n\n\tdef f(a):\n    return a's"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    if importlib.util.find_spec("tiktoken") is not None:
        from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

        assert ids == MetaTokenizer.get_instance().encode(text, bos=False, eos=False)
    preprocessor = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"height": 560, "width": 560}


def test_get_demo_checkpoint_caches_under_env_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_DEMO_DIR", str(tmp_path))
    assert dc.demo_cache_dir() == tmp_path
    with ThreadPoolExecutor(2) as pool:  # two racing callers build it once
        first, second = pool.map(dc.get_demo_checkpoint, [TINY, TINY])
    assert first == second == tmp_path / f"mllama-tiny-v{dc.GENERATOR_VERSION}"
    marker = first / dc.MARKER_FILE
    stamp = marker.stat().st_mtime_ns
    assert dc.get_demo_checkpoint(TINY) == first and marker.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [first.name]
    assert load_mllama_config(first).text.vocab_size == 512


def test_demo_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DEMO_DIR", raising=False)
    assert dc.demo_cache_dir() == Path.home() / ".cache" / "vllm-mllama" / "demo"


def test_cli_builds_into_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dc.main([TINY, "--out", str(tmp_path / "cli")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / dc.MARKER_FILE).is_file()
    dc.main([])
    listing = capsys.readouterr().out
    assert all(name in listing for name in dc.DEMO_MODELS)
