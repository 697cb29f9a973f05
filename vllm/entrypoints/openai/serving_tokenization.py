"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and response shapes).

The chat form renders the messages with the chat template exactly as a chat completion would
(images count as one ``<|image|>`` token each and are not fetched).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from vllm.entrypoints.chat_utils import parse_conversation, render_chat_prompt
from vllm.entrypoints.openai.json_types import X_BOUND, Bool, Int, PromptText
from vllm.entrypoints.openai.protocol import OpenAIBaseModel
from vllm.entrypoints.openai.serving_engine import OpenAIServing, bad_request

# Any id the tokenizer knows (special tokens and <|image|> included), as /detokenize takes.
TokenizerId = Annotated[Int, Field(json_schema_extra={X_BOUND: "tokenizer_id"})]


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: PromptText
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with chat messages (rendered by the chat template)."""

    _token_list_fields: ClassVar[tuple[str, ...]] = ("messages",)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    """``POST /tokenize`` response."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize`` body."""

    _token_list_fields: ClassVar[tuple[str, ...]] = ("tokens",)

    model: str | None = None
    tokens: Annotated[list[TokenizerId], Field(json_schema_extra={X_BOUND: "tokens"})]


class DetokenizeResponse(BaseModel):
    """``POST /detokenize`` response."""

    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """Tokenizer endpoints."""

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_request(request)
        if isinstance(request, TokenizeChatRequest):
            self.check_chat_template(request.chat_template)
            try:
                parsed = parse_conversation(request.messages)
                text = await asyncio.to_thread(
                    render_chat_prompt,
                    self.ctx.tokenizer,
                    parsed.messages,
                    request.chat_template or self.ctx.chat_template,
                    request.add_generation_prompt,
                    request.continue_final_message,
                    request.chat_template_kwargs,
                    self.ctx.limits.chat_template_budget,
                )
            except ValueError as e:
                raise bad_request(str(e)) from None
        else:
            text = request.prompt
        ids = await self.tokenize_text(text, request.add_special_tokens)
        self._check_count(len(ids), "tokenization")
        strs = None
        if request.return_token_strs:
            strs = list(self.ctx.tokenizer.convert_ids_to_tokens(ids))
        return TokenizeResponse(
            count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids, token_strs=strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(request)
        self._check_count(len(request.tokens), "detokenization")
        tok = self.ctx.tokenizer
        size = len(tok)

        def decode() -> str:  # the vocabulary check walks every id: off the event loop too
            bad = next((t for t in request.tokens if not 0 <= t < size), None)
            if bad is not None:
                raise bad_request(
                    f"Token id {bad} is out of vocabulary (valid ids are 0..{size - 1}).",
                    "tokens",
                )
            return tok.decode(request.tokens)

        return DetokenizeResponse(prompt=await asyncio.to_thread(decode))

    def _check_count(self, count: int, operation: str) -> None:
        """vLLM's rule: no more tokens than the model's context in or out of the tokenizer."""
        limit = self.ctx.max_model_len
        if count > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {count} tokens in the input for {operation}. Please reduce the "
                "length of the input."
            )
