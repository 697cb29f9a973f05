"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and response shapes).

The chat form renders the messages with the chat template exactly as a chat completion would
(images count as one ``<|image|>`` token each and are not fetched).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from vllm.entrypoints.chat_utils import parse_conversation, render_chat_prompt
from vllm.entrypoints.openai.protocol import OpenAIBaseModel
from vllm.entrypoints.openai.serving_engine import OpenAIServing, bad_request


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with chat messages (rendered by the chat template)."""

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
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

    model: str | None = None
    tokens: list[int]


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
        strs = None
        if request.return_token_strs:
            strs = list(self.ctx.tokenizer.convert_ids_to_tokens(ids))
        return TokenizeResponse(
            count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids, token_strs=strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(request)
        tok = self.ctx.tokenizer
        size = len(tok)
        bad = [t for t in request.tokens if not 0 <= t < size]
        if bad:
            raise bad_request(
                f"Token id {bad[0]} is out of vocabulary (valid ids are 0..{size - 1}).", "tokens"
            )
        text = await asyncio.to_thread(tok.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
