"""Long prompts with images prefilled in many chunks (tiny model, CPU): a prompt several times
the token budget with one image near its start (every later chunk cross-attends to it) and
one with three images spread through it (each chunk sees the group its tokens follow) give
the outputs of whole-prompt prefill (check_logprobs_close), with a prompt logprob for every
prompt token."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from PIL import Image

from vllm import LLM, SamplingParams

BUDGET = 64
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=1)


def _image(seed: int, w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _text(n: int, seed: int) -> str:
    words = ["river", "stone", "light", "north", "garden", "paper", "cloud", "metal"]
    rng = np.random.default_rng(seed)
    return " ".join(words[i] for i in rng.integers(0, len(words), n))


def _prompts() -> list[dict]:
    return [
        # One image near the start, then a long tail: every chunk after the first attends to
        # the image's vision tokens from its cross pages.
        {
            "prompt": "<|image|><|begin_of_text|>" + _text(3, 0) + " " + _text(95, 1),
            "multi_modal_data": {"image": _image(1, 120, 80)},
        },
        # Three images spread through the prompt, each after a long stretch of text.
        {
            "prompt": "<|begin_of_text|>"
            + _text(25, 2)
            + " <|image|>"
            + _text(35, 3)
            + " <|image|>"
            + _text(25, 4)
            + " <|image|>"
            + _text(15, 5),
            "multi_modal_data": {
                "image": [_image(2, 60, 140), _image(3, 100, 100), _image(4, 200, 50)]
            },
        },
    ]


def _llm(**kw) -> LLM:
    return LLM(
        model="demo/mllama-tiny",
        max_model_len=1024,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 3},
        **kw,
    )


@pytest.fixture(scope="module")
def whole() -> list:
    return _llm().generate(_prompts(), PARAMS, use_tqdm=False)


@pytest.mark.parametrize("encoder", [0, 4])
def test_long_prompts_with_images_in_chunks_equal_whole_prefill(whole: list, encoder: int) -> None:
    llm = _llm(
        enable_chunked_prefill=True, max_num_batched_tokens=BUDGET, encoder_layers_per_step=encoder
    )
    engine = llm.llm_engine
    image = engine.config.model_config.spec.image_token_id
    for p in _prompts():
        ids = engine.process_inputs(p).prompt_token_ids
        positions = [i for i, t in enumerate(ids) if t == image]
        assert len(ids) > 8 * BUDGET, len(ids)  # many chunks
        # The images lie where the prompt says: the first at the start, or spread so that
        # they arrive in different chunks.
        chunks = {pos // BUDGET for pos in positions}
        assert chunks == {0} if len(positions) == 1 else len(chunks) == 3
    got = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    check_logprobs_close(vllm_greedy(whole), vllm_greedy(got), "whole", "chunked")
    for a, b in zip(whole, got, strict=True):
        ref, new = a.prompt_logprobs, b.prompt_logprobs
        assert len(ref) == len(new) == len(a.prompt_token_ids)
        # Every prompt token's logprob (float32 on CPU: only the order of sums differs); a
        # chunk that lost its image or its earlier keys would move them far more.
        checked = 0
        for i, (lp0, lp1) in enumerate(zip(ref, new, strict=True)):
            assert (lp0 is None) == (lp1 is None), i
            if lp0 is not None:
                tok = a.prompt_token_ids[i]
                assert abs(lp0[tok].logprob - lp1[tok].logprob) < 1e-3, i
                checked += 1
        assert checked > 8 * BUDGET
