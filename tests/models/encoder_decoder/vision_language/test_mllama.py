"""Greedy logprobs of ``vllm.LLM`` against HF transformers + the Meta-parity shim.

The upstream test matrix on the tiny demo checkpoint: text only, one leading image at every
aspect ratio and several sizes, the same image three times, two and three leading images,
interleaved images, consecutive images mid-prompt, and the regressions. Requests run batched
(``max_num_seqs=4``, different image counts in one batch); the HF side runs one prompt at a
time. Parametrised on ``enforce_eager``: the default (``False``) decodes through the CUDA-graph
runner (captured on CUDA, emulated on the CPU) and must agree with eager mode and HF.
On CPU the comparison runs in float32, on CUDA in bfloat16.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.hf_runner import demo_path, hf_greedy_logprobs, hf_inputs, load_hf_model
from PIL import Image

from vllm import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
MAX_TOKENS = 32
NUM_LOGPROBS = 5
LIMIT_IMAGES = 3
TILE = 56

IMAGE_PROMPT = "<|image|><|begin_of_text|>The meaning of the image is"
TEXT_PROMPT = "The color of the sky is blue but sometimes it can also be"
# (tiles high, tiles wide) of the 8 aspect ratios.
RATIOS = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]


@cache
def image(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed * 7919 + w * 31 + h)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def with_images(prompt: str, *images: Image.Image) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": list(images)}}


@pytest.fixture(scope="module", params=[False, True], ids=["graphs", "eager"])
def llm(request) -> LLM:
    return LLM(model="demo/mllama-tiny", dtype=DTYPE, max_model_len=512, max_num_seqs=4,
               limit_mm_per_prompt={"image": LIMIT_IMAGES}, enforce_eager=request.param)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=NUM_LOGPROBS, **kw)


def hf_reference(llm: LLM, prompts: list) -> list:
    """HF greedy generation for each prompt alone, on the prompt our engine processed."""
    engine = llm.llm_engine
    spec = engine.config.model_config.spec
    model = load_hf_model(str(demo_path()), getattr(torch, DTYPE), DEVICE)
    out = []
    for p in prompts:
        processed = engine.process_inputs(p)
        kw = hf_inputs(processed.prompt_token_ids, processed.images, spec.image_token_id,
                       spec.vision.max_num_tiles, DEVICE, getattr(torch, DTYPE))
        out.append(hf_greedy_logprobs(model, kw, MAX_TOKENS, NUM_LOGPROBS))
    return out


def run_and_compare(llm: LLM, prompts: list) -> None:
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    check_logprobs_close(hf_reference(llm, prompts), vllm_greedy(outputs), "hf", "vllm")
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0
    if not engine.config.model_config.enforce_eager:
        assert engine.runner.stats.eager_decode_steps == 0  # every decode step replayed


def test_text_only(llm: LLM) -> None:
    run_and_compare(llm, [TEXT_PROMPT, "Hello, my name is"])


def test_single_leading_image_every_aspect_ratio(llm: LLM) -> None:
    prompts = [with_images(IMAGE_PROMPT, image(TILE * w, TILE * h)) for h, w in RATIOS]
    run_and_compare(llm, prompts)


@pytest.mark.parametrize("sizes", [[(20, 20), (300, 100)], [(512, 512), (100, 400)]])
def test_single_leading_image_sizes(llm: LLM, sizes: list) -> None:
    run_and_compare(llm, [with_images(IMAGE_PROMPT, image(w, h, 1)) for w, h in sizes])


def test_same_image_three_times(llm: LLM) -> None:
    run_and_compare(llm, [with_images(IMAGE_PROMPT, image(90, 60))] * 3)


def test_multi_leading_images(llm: LLM) -> None:
    prompts = [
        with_images("<|image|><|image|><|begin_of_text|>Describe 2 images.",
                    image(56, 56), image(112, 56, 2)),
        with_images("<|image|><|image|><|begin_of_text|>Describe 2 images.",
                    image(56, 56), image(224, 224, 3)),
        with_images("<|image|><|image|><|image|><|begin_of_text|>Describe 3 images.",
                    image(56, 56), image(56, 168, 4), image(112, 56, 5)),
    ]
    run_and_compare(llm, prompts)


def test_interleaved_images(llm: LLM) -> None:
    prompts = [
        with_images("<|begin_of_text|>The content of the image <|image|> is", image(60, 60)),
        with_images("<|begin_of_text|>Between the first image <|image|> and the second "
                    "image<|image|>, which is a stop sign and which is a cherry blossom?",
                    image(60, 60), image(120, 50, 6)),
    ]
    run_and_compare(llm, prompts)


def test_consecutive_images_mid_prompt(llm: LLM) -> None:
    prompts = [with_images("<|begin_of_text|>Look at these <|image|><|image|><|image|> and say",
                           image(56, 56), image(112, 112, 7), image(40, 160, 8)),
               TEXT_PROMPT]
    run_and_compare(llm, prompts)


def test_mismatched_image_tokens_raise(llm: LLM) -> None:
    bad = with_images("<|begin_of_text|><|image|> <|image|> Compare the two images",
                      image(56, 56))
    with pytest.raises(ValueError, match=r"image tokens \(2\).*images \(1\)"):
        llm.generate(bad, greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("order", ["text_first", "image_first"])
def test_mixed_text_and_image_batches(llm: LLM, order: str) -> None:
    img = with_images("<|begin_of_text|>Text before the image <|image|> and after",
                      image(100, 60, 9))
    prompts = [TEXT_PROMPT, img] if order == "text_first" else [img, "<|begin_of_text|>Hello!"]
    run_and_compare(llm, prompts)


def test_explicit_and_implicit_prompts_agree(llm: LLM) -> None:
    implicit = [with_images(IMAGE_PROMPT, image(56, 112)), TEXT_PROMPT]
    explicit = [
        {"encoder_prompt": with_images("<|image|>", image(56, 112)),
         "decoder_prompt": "<|begin_of_text|>The meaning of the image is"},
        {"encoder_prompt": "", "decoder_prompt": TEXT_PROMPT},
    ]
    a = llm.generate(implicit, greedy(), use_tqdm=False)
    b = llm.generate(explicit, greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in a] == [o.prompt_token_ids for o in b]
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]


def test_largest_admitted_image_count_decodes(llm: LLM) -> None:
    """Every request at the image limit with 4-tile images: the cross tables are full width."""
    big = with_images("<|image|><|image|><|image|><|begin_of_text|>Three large images",
                      image(224, 224, 10), image(224, 224, 11), image(224, 224, 12))
    run_and_compare(llm, [big, big, TEXT_PROMPT])
