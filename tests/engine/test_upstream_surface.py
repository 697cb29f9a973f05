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


def test_top_level_names_and_inputs() -> None:
    """The imports upstream programs start with."""
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.engine.async_llm_engine import AsyncLLMEngine
    from vllm.engine.llm_engine import LLMEngine
    from vllm.inputs import ExplicitEncoderDecoderPrompt, PromptType, TextPrompt, TokensPrompt

    assert vllm.AsyncEngineArgs is AsyncEngineArgs and issubclass(AsyncEngineArgs, EngineArgs)
    assert vllm.AsyncLLMEngine is AsyncLLMEngine and vllm.LLMEngine is LLMEngine
    assert vllm.TextPrompt is TextPrompt and vllm.TokensPrompt is TokensPrompt
    assert TextPrompt.__required_keys__ == {"prompt"}
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"}
    assert "multi_modal_data" in TokensPrompt.__optional_keys__
    assert ExplicitEncoderDecoderPrompt.__required_keys__ == {"encoder_prompt", "decoder_prompt"}
    assert TextPrompt in PromptType.__args__ and str in PromptType.__args__
    assert AsyncEngineArgs(model="demo/mllama-tiny", max_model_len=64).max_model_len == 64


def test_typed_prompts_engine_configs_and_metrics(llm: LLM) -> None:
    from vllm.inputs import TextPrompt, TokensPrompt

    engine = llm.llm_engine
    assert engine.vllm_config is engine.config
    assert engine.model_config is engine.config.model_config is engine.get_model_config()
    mc = engine.model_config
    assert mc.max_model_len == 512 and mc.model == "demo/mllama-tiny"
    assert mc.served_model_name == "demo/mllama-tiny" and mc.tokenizer == "demo/mllama-tiny"
    assert mc.hf_config.text_config.vocab_size == 512  # a transformers MllamaConfig
    ids = llm.get_tokenizer()("Typed prompt")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    text, tokens = llm.generate(
        [TextPrompt(prompt="Typed prompt"), TokensPrompt(prompt_token_ids=ids)],
        params,
        use_tqdm=False,
    )
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    m = text.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert m.scheduler_time is None and m.model_forward_time is None
    assert m.model_execute_time is None
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("x", params, lora_request=object())


def test_chat_continue_final_message_and_content_format(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    conversation = [
        {"role": "user", "content": "Say a word"},
        {"role": "assistant", "content": "The word is"},
    ]
    (cont,) = llm.chat(
        conversation, params, add_generation_prompt=False, continue_final_message=True,
        use_tqdm=False,
    )  # fmt: skip
    assert cont.prompt.endswith("The word is")  # no end-of-turn after the final message
    (fresh,) = llm.chat(conversation, params, use_tqdm=False)
    assert fresh.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    parts = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": _image(60, 40)},
        {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    (as_parts,) = llm.chat(parts, params, chat_template_content_format="openai", use_tqdm=False)
    (as_text,) = llm.chat(parts, params, chat_template_content_format="string", use_tqdm=False)
    assert as_parts.prompt_token_ids.count(IMAGE) == as_text.prompt_token_ids.count(IMAGE) == 1
    assert "<|image|>What is it?" in as_parts.prompt  # the template's rendering of the parts
    assert "<|image|>\nWhat is it?" in as_text.prompt  # vLLM's string form
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(parts, params, chat_template_content_format="markdown", use_tqdm=False)
    with pytest.raises(ValueError, match="pass it to LLM"):
        llm.chat(parts, params, mm_processor_kwargs={"max_image_tiles": 1}, use_tqdm=False)


def test_llm_processor_and_config_keywords() -> None:
    """``LLM(mm_processor_kwargs=..., hf_overrides=...)`` reach the processor and the config."""
    small = LLM(
        model="demo/mllama-tiny", max_num_seqs=2,
        mm_processor_kwargs={"max_image_tiles": 1},
        hf_overrides={"text_config": {"max_position_embeddings": 256}},
    )  # fmt: skip
    assert small.llm_engine.model_config.max_model_len == 256
    (out,) = small.generate(
        {"prompt": "<|image|><|begin_of_text|>Hi", "multi_modal_data": {"image": _image(200, 50)}},
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
    )
    assert out.encoder_prompt_token_ids == [IMAGE] * TOKENS_PER_TILE  # one tile, not four
