"""`python -m benchmarks.profiling timeline` with a chat turn's input path as it was before
the tokenization cache and the one-image pixel view: every prompt tokenized whole, every
request's pixels stacked into a fresh pinned tensor. The baseline of `tools/gpu_turn_profile.sh`
(same build, same machine). Arguments: those of the timeline tool."""

from __future__ import annotations

import sys

import torch

from benchmarks.profiling import serve_timeline
from vllm.entrypoints import chat_utils
from vllm.multimodal import processing


def _tokenize_whole(
    tokenizer, text: str, add_special_tokens: bool = False, cache_salt: str | None = None
) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


_process_images = processing.MllamaInputProcessor.process_images


def _stacked(self, images, cache_salt=None):
    out = _process_images(self, images, cache_salt)
    pixels = torch.empty(
        out.pixel_values.shape, dtype=out.pixel_values.dtype, pin_memory=self.pin_memory
    )
    pixels.copy_(out.pixel_values)
    out.pixel_values = pixels
    return out


if __name__ == "__main__":
    chat_utils.tokenize_chat_prompt = _tokenize_whole
    processing.MllamaInputProcessor.process_images = _stacked
    serve_timeline.main(sys.argv[1:])
