"""Prompt types of vLLM's offline interface (``vllm.inputs``), for programs that build prompts
with them: each is a plain ``dict`` at run time, as upstream's are.

* :class:`TextPrompt`: ``{"prompt": str, "multi_modal_data": {"image": img | [img, ...]}}``
* :class:`TokensPrompt`: ``{"prompt_token_ids": [int, ...], "multi_modal_data": ...}``
* :class:`ExplicitEncoderDecoderPrompt`: ``{"encoder_prompt": ..., "decoder_prompt": ...}``
  (the encoder prompt holds the images; see ``MllamaInputProcessor.process``)

``mm_processor_kwargs`` per prompt is not supported: set it on the engine
(``LLM(mm_processor_kwargs=...)``, ``--mm-processor-kwargs``).
"""

# No ``from __future__ import annotations``: TypedDict reads NotRequired from live annotations.
from typing import Any, NotRequired, TypeAlias, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the checkpoint's special tokens)."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``<|image|>`` ids mark where the images go)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


SingletonPrompt: TypeAlias = str | TextPrompt | TokensPrompt


class ExplicitEncoderDecoderPrompt(TypedDict):
    """vLLM's encoder/decoder pair: the images in the encoder prompt, the text in the decoder's."""

    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


PromptType: TypeAlias = SingletonPrompt | ExplicitEncoderDecoderPrompt

__all__ = [
    "ExplicitEncoderDecoderPrompt",
    "PromptType",
    "SingletonPrompt",
    "TextPrompt",
    "TokensPrompt",
]
