"""Prompt types of vLLM's offline interface (``vllm.inputs``), for programs that build prompts
with them: each is a plain ``dict`` at run time, as upstream's are.

* :class:`TextPrompt`: ``{"prompt": str, "multi_modal_data": {"image": img | [img, ...]}}``
* :class:`TokensPrompt`: ``{"prompt_token_ids": [int, ...], "multi_modal_data": ...}``
* :class:`ExplicitEncoderDecoderPrompt`: ``{"encoder_prompt": ..., "decoder_prompt": ...}``
  (the encoder prompt holds the images; see ``MllamaInputProcessor.process``)

``mm_processor_kwargs`` per prompt is not supported: set it on the engine
(``LLM(mm_processor_kwargs=...)``, ``--mm-processor-kwargs``).

``cache_salt`` (vLLM's field, in any dict form): requests share cached KV only when their salts
are equal, so a tenant's salt keeps its cache apart from every other tenant's
(``docs/security.md``). A non-empty string of at most :data:`MAX_CACHE_SALT_CHARS` characters.
"""

# No ``from __future__ import annotations``: TypedDict reads NotRequired from live annotations.
from typing import Any, NotRequired, TypeAlias, TypedDict

# Salts are secrets (a tenant's key) or ids (a user, a session): 256 characters hold any of
# them, and bound what a request makes the engine hash and keep.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: Any) -> str | None:
    """``cache_salt`` as given (None when absent); raises ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("cache_salt must be a non-empty string if provided.")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt is {len(value)} characters long; at most {MAX_CACHE_SALT_CHARS} are "
            "allowed."
        )
    return value


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the checkpoint's special tokens)."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``<|image|>`` ids mark where the images go)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


SingletonPrompt: TypeAlias = str | TextPrompt | TokensPrompt


class ExplicitEncoderDecoderPrompt(TypedDict):
    """vLLM's encoder/decoder pair: the images in the encoder prompt, the text in the decoder's."""

    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


PromptType: TypeAlias = SingletonPrompt | ExplicitEncoderDecoderPrompt

__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "ExplicitEncoderDecoderPrompt",
    "PromptType",
    "SingletonPrompt",
    "TextPrompt",
    "TokensPrompt",
    "check_cache_salt",
]
