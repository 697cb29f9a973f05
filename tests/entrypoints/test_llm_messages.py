"""Offline ``vllm.LLM``: a mistake in a prompt or its parameters gets a named error that says
what is wrong, before the engine sees it, and the engine goes on serving."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo/mllama-tiny", max_model_len=256, max_num_seqs=4)


IMG = Image.new("RGB", (20, 20), (200, 30, 60))
MISTAKES: list[tuple[str, Any, Any, type[Exception], str]] = [
    ("params as a dict", "a", {"max_tokens": 2}, TypeError,
     "sampling_params must be a SamplingParams or a list of them, got dict"),
    ("params list of dicts", "a", [{"max_tokens": 2}], TypeError,
     "sampling_params must hold SamplingParams, got dict"),
    ("images as a list", {"prompt": "<|image|>a", "multi_modal_data": [IMG]}, None, ValueError,
     "['multi_modal_data'] must be a dict such as {'image': image}"),
    ("0x0 image", {"prompt": "<|image|>a", "multi_modal_data": {"image": Image.new("RGB", (0, 0))}},
     None, ValueError, "has no pixels (0x0)"),
    ("not an image", {"prompt": "<|image|>a", "multi_modal_data": {"image": "cat.png"}}, None,
     ValueError, "must be a PIL.Image.Image, got str"),
    ("float token id", {"prompt_token_ids": [1, 1.7]}, None, ValueError,
     "['prompt_token_ids'] must be a list of integers, got 1.7"),
    ("a number as prompt", 5, None, TypeError, "must be a string or a dict, got int"),
]


@pytest.mark.parametrize("prompt,params,error,message", [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistakes_get_named_errors(
    llm: LLM, prompt: Any, params: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as exc:
        llm.generate(prompt, params, use_tqdm=False)
    assert message in str(exc.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_image_without_pixels(llm: LLM) -> None:
    part = {"type": "image_pil", "image_pil": Image.new("RGB", (0, 0))}
    with pytest.raises(ValueError, match=r"has no pixels \(0x0\)"):
        llm.chat([{"role": "user", "content": [part]}], use_tqdm=False)


def test_stop_must_be_strings() -> None:
    with pytest.raises(ValueError, match="stop must be a string or a list of strings, got 5"):
        SamplingParams(stop=5)


def test_engine_serves_after_the_mistakes(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0)
    out = llm.generate({"prompt": "<|image|>a", "multi_modal_data": {"image": IMG}}, params,
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
