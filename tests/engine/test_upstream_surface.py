"""What programs written against upstream vLLM read from the offline engine: the encoder prompt
and usage counts, request metrics, the engine's configuration objects, ``LLM.chat`` options and
the ``LLM(...)`` keywords for the processor and the checkpoint configuration."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vllm import LLM, SamplingParams

IMAGE = 512  # <|image|> of the tiny demo
TOKENS_PER_TILE = 17  # (56 / 14)^2 + 1


def _image(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        model="demo/mllama-tiny", max_model_len=512, max_num_seqs=8,
        limit_mm_per_prompt={"image": 2},
    )  # fmt: skip


def _tiles(llm: LLM, image: Image.Image) -> int:
    return llm.llm_engine.input_processor.process_images([image]).num_tiles[0]


def test_encoder_prompt_counts_vision_tokens_of_the_last_group(llm: LLM) -> None:
    """vLLM's encoder prompt for this model: 1,601 (here 17) image tokens per tile of the
    images decoded tokens see (the last group), none for text; usage counts add it."""
    wide, tall = _image(200, 50), _image(50, 200, seed=1)
    assert _tiles(llm, wide) != _tiles(llm, tall) or _tiles(llm, wide) > 1
    params = SamplingParams(temperature=0, max_tokens=2)
    text, group, interleaved = llm.generate(
        [
            "Just text",
            {"prompt": "<|image|><|image|><|begin_of_text|>Two",
             "multi_modal_data": {"image": [wide, tall]}},
            {"prompt": "<|begin_of_text|>A <|image|> then B <|image|>",
             "multi_modal_data": {"image": [wide, tall]}},
        ],
        params,
        use_tqdm=False,
    )  # fmt: skip
    assert text.encoder_prompt_token_ids == [] and text.encoder_prompt == ""
    both = (_tiles(llm, wide) + _tiles(llm, tall)) * TOKENS_PER_TILE
    assert group.encoder_prompt_token_ids == [IMAGE] * both
    assert group.encoder_prompt == "<|image|>" * both
    assert interleaved.encoder_prompt_token_ids == [IMAGE] * _tiles(llm, tall) * TOKENS_PER_TILE
    assert group.prompt_token_ids.count(IMAGE) == 2  # the decoder prompt is unchanged


def test_max_image_tiles_lowers_the_tiling(llm: LLM) -> None:
    """``mm_processor_kwargs={"max_image_tiles": 2}``: an image that fits 2 tiles is processed
    exactly as at the model's 4 (same pixels, same aspect-ratio id, zero tiles after); a wider
    one gets 2 tiles, and its aspect-ratio id names its arrangement in the model's table."""
    from vllm.multimodal.processing import MllamaInputProcessor, tile_arrangements

    full = llm.llm_engine.input_processor
    two = MllamaInputProcessor(
        full.spec, full.tokenizer, full.image_processor, 2, 512,
        processor_kwargs={"max_image_tiles": 2},
    )  # fmt: skip
    fits = _image(112, 56)
    a, b = full.process_images([fits]), two.process_images([fits])
    assert a.num_tiles == b.num_tiles == [2]
    assert b.pixel_values.shape == a.pixel_values.shape
    assert b.pixel_values.equal(a.pixel_values) and b.aspect_ratio_ids.equal(a.aspect_ratio_ids)
    for img in (_image(200, 50), _image(50, 200)):
        out = two.process_images([img])
        assert out.num_tiles == [2] and not out.pixel_values[0, 2:].any()
        ratio = full.spec.vision.supported_aspect_ratios[int(out.aspect_ratio_ids[0]) - 1]
        assert tuple(ratio) in tile_arrangements(2)[1:]  # 1x2 or 2x1, not a 3- or 4-tile one
