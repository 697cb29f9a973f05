"""``POST /v1/chat/completions``: messages through the chat template, images, JSON or SSE.

Usage accounting, as vLLM's: ``prompt_tokens`` is the decoder prompt (the rendered chat text,
one ``<|image|>`` token per image) plus the encoder prompt, 1,601 vision tokens per tile of the
last image group (the images decoded tokens see; ``RequestOutput.encoder_prompt_token_ids``).
Admission checks the decoder prompt alone against ``max_model_len`` (docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vllm.engine.async_llm_engine import EngineDeadError
from vllm.entrypoints.chat_utils import (
    ParsedConversation,
    parse_chat_messages_async,
    parse_conversation,
)
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    OpenAIServingError,
    bad_request,
    error_body,
    logprob_entries,
    truncate_prompt,
)
from vllm.entrypoints.openai.streaming import SSE_DONE, SSEResponse, sse_event
from vllm.entrypoints.openai.tool_choice import (
    ToolCallStream,
    ToolChoiceError,
    ToolPlan,
    complete_message,
    finish_reason,
    plan_tools,
)
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import Logprob

logger = init_logger(__name__)


def internal_error(e: BaseException) -> str:
    """What a client learns of an unexpected server error: its type. The message may name
    files, addresses or other clients' requests; it goes to the server log only."""
    return f"Internal server error ({type(e).__name__}; the details are in the server log)."


def in_band_error(e: Exception) -> dict[str, Any]:
    """The error body sent inside an SSE stream once the 200 header has gone out."""
    if isinstance(e, OpenAIServingError):
        return e.body()
    if isinstance(e, ValueError):
        return error_body(str(e), "BadRequestError", 400)
    if isinstance(e, EngineDeadError):
        return error_body(str(e), "InternalServerError", 500)
    logger.exception("Error while streaming a response")
    return error_body(internal_error(e), "InternalServerError", 500)


def token_text(token_id: int, lp: Logprob | None, tokenizer: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _logprob_entry(text: str, value: float) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(
        token=text, logprob=max(value, -9999.0), bytes=list(text.encode("utf-8", errors="replace"))
    )


class OpenAIServingChat(OpenAIServing):
    """Chat completions over the async engine."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        model = self.check_request(request)
        self.check_chat_template(request.chat_template)
        parsed = self._parse(request)
        ticket = self.reserve(len(parsed.image_sources))  # before images are fetched
        try:
            prompt, params, plan = await self._prepare(request, parsed)
            grammar = await self.compile_constraint(params)
            processed = await self.process(prompt)
            response_id = (
                f"chatcmpl-{request.request_id}" if request.request_id else random_id("chatcmpl")
            )
            engine_id = self.engine_request_id(response_id, bool(request.request_id))
            self.log_request(engine_id, prompt.get("prompt"), prompt["prompt_token_ids"], params)
            role = (
                self.ctx.response_role
                if request.add_generation_prompt
                else str(request.messages[-1].get("role", "assistant"))
            )
            gen = self.generate(processed, params, engine_id, ticket, grammar, request.priority)
            # vLLM's count: the decoder prompt plus the encoder prompt (see the docstring).
            num_prompt = len(prompt["prompt_token_ids"]) + processed.encoder_seq_len
            if request.stream:
                body = self._stream(
                    request, gen, response_id, model, role, params, num_prompt, plan
                )
                return SSEResponse(body, on_close=ticket.close)
            (final,) = await self.collect_final([gen], raw_request)
        except BaseException:
            ticket.close()  # (a stream's ticket is closed by the engine or the response)
            raise
        ticket.close()
        # Large logprob responses take a while to build and encode: off the event loop.
        return await asyncio.to_thread(
            lambda: JSONResponse(
                self._response(
                    final, response_id, model, role, params, num_prompt, plan
                ).model_dump()
            )
        )

    def _parse(self, request: ChatCompletionRequest) -> ParsedConversation:
        try:
            parsed = parse_conversation(request.messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        limit = self.engine.config.model_config.limit_images_per_prompt
        if len(parsed.image_sources) > limit:  # before fetching anything
            raise bad_request(
                f"You set image={limit} (or defaulted to 1) in `--limit-mm-per-prompt`, but "
                f"passed {len(parsed.image_sources)} image items in the same prompt."
            )
        return parsed

    async def _prepare(
        self, request: ChatCompletionRequest, parsed: ParsedConversation
    ) -> tuple[dict[str, Any], SamplingParams, ToolPlan]:
        """Messages -> engine prompt (token ids and images), the request's SamplingParams and
        what its tools do (``tool_choice.py``)."""
        guided = self.guided_decoding(request)
        try:
            plan = plan_tools(
                request.tools,
                request.tool_choice,
                request.parallel_tool_calls,
                self.ctx.enable_auto_tools and self.ctx.tool_call_parser is not None,
                guided is not None,
            )
        except ToolChoiceError as e:
            raise bad_request(str(e), "tool_choice") from None
        template_kwargs = dict(request.chat_template_kwargs or {})
        if plan.tools is not None:
            template_kwargs["tools"] = plan.tools
        try:
            prompt = await parse_chat_messages_async(
                parsed,
                self.ctx.tokenizer,
                self.ctx.media,
                chat_template=request.chat_template or self.ctx.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                chat_template_kwargs=template_kwargs,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens,
                budget=self.ctx.limits.chat_template_budget,
                lookup=self.engine.engine.input_processor.image_lookup(request.cache_salt),
                cache_salt=request.cache_salt,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        ids = truncate_prompt(prompt["prompt_token_ids"], request.truncate_prompt_tokens)
        prompt["prompt_token_ids"] = ids
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        max_tokens = request.requested_max_tokens()
        self.check_length(len(ids), max_tokens)
        kwargs = request.sampling_kwargs()
        kwargs["guided_decoding"] = plan.guided or guided
        logprobs = request.requested_logprobs()
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        params = self.sampling_params(
            kwargs, max_tokens, self.ctx.max_model_len - len(ids), bool(request.stream)
        )
        self.check_logprob_entries(logprob_entries(params, len(ids)))
        return prompt, params, plan

    # ------------------------------------------------------------------ output shapes
    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, top_k: int
    ) -> ChatCompletionLogProbs | None:
        if logprobs is None:
            return None
        tok = self.ctx.tokenizer
        content = []
        for tid, step in zip(token_ids, logprobs, strict=False):
            chosen = step.get(tid)
            text = token_text(tid, chosen, tok)
            ranked = sorted(step.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
            top = [_logprob_entry(token_text(t, lp, tok), lp.logprob) for t, lp in ranked[:top_k]]
            entry = _logprob_entry(text, chosen.logprob if chosen is not None else -9999.0)
            content.append(ChatCompletionLogProbsContent(**entry.model_dump(), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _response(
        self,
        final: RequestOutput,
        request_id: str,
        model: str,
        role: str,
        params: SamplingParams,
        num_prompt: int,
        plan: ToolPlan,
    ) -> ChatCompletionResponse:
        top_k = params.logprobs or 0
        choices = []
        for c in final.outputs:
            content, calls = complete_message(plan, c.text)
            message = ChatMessage(
                role=role, content=content, tool_calls=[t.message_json() for t in calls]
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.token_ids, c.logprobs, top_k),
                    finish_reason=finish_reason(plan, c.finish_reason, bool(calls)),
                    stop_reason=c.stop_reason,
                )
            )
        completion = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=completion,
            total_tokens=num_prompt + completion,
        )
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_json(final),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        model: str,
        role: str,
        params: SamplingParams,
        num_prompt: int,
        plan: ToolPlan,
    ) -> AsyncIterator[str]:
        """SSE: a role chunk per choice, content (or ``tool_calls``) deltas, a finish chunk
        per choice, the optional usage chunk, then ``[DONE]``; errors after the header go
        in-band."""
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        n = params.n
        generated = [0] * n
        done = [False] * n
        tools = [ToolCallStream(plan) for _ in range(n)]

        def usage() -> UsageInfo:
            total = sum(generated)
            return UsageInfo(
                prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total
            )

        def chunk(choice: ChatCompletionResponseStreamChoice | None) -> str:
            fields: dict[str, Any] = {"choices": [choice] if choice is not None else []}
            if choice is None or continuous:
                fields["usage"] = usage()
            resp = ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=model,
                **fields,
            )
            return sse_event(resp.model_dump_json(exclude_unset=True))

        try:
            async with contextlib.aclosing(gen):
                for i in range(n):
                    yield chunk(
                        ChatCompletionResponseStreamChoice(
                            index=i,
                            delta=DeltaMessage(role=role, content=""),
                            logprobs=None,
                            finish_reason=None,
                        )
                    )
                async for out in gen:
                    for c in out.outputs:
                        if done[c.index]:
                            continue
                        generated[c.index] += len(c.token_ids)
                        has_logprobs = c.logprobs is not None and len(c.token_ids) > 0
                        if c.finish_reason is None and not c.text and not has_logprobs:
                            continue  # tokens whose text the detokenizer still holds back
                        done[c.index] = c.finish_reason is not None
                        delta = _delta(tools[c.index], c.text, done[c.index])
                        if not (done[c.index] or has_logprobs or delta.content or delta.tool_calls):
                            continue  # text held back while it may still be a tool call
                        yield chunk(
                            ChatCompletionResponseStreamChoice(
                                index=c.index,
                                delta=delta,
                                logprobs=self._logprobs(
                                    c.token_ids, c.logprobs, params.logprobs or 0
                                ),
                                finish_reason=finish_reason(
                                    plan, c.finish_reason, tools[c.index].called
                                ),
                                stop_reason=c.stop_reason,
                            )
                        )
            if include_usage:
                yield chunk(None)
        except Exception as e:
            yield sse_event(json.dumps(in_band_error(e)))
        yield SSE_DONE


def _delta(tools: ToolCallStream, text: str, finished: bool) -> DeltaMessage:
    """One streamed choice's delta for its new ``text``: content, tool-call deltas or both."""
    content, calls = tools.feed(text)
    if finished:
        more_content, more_calls = tools.finish()
        content = (content or "") + (more_content or "") or None
        calls += more_calls
    fields: dict[str, Any] = {}
    if content:
        fields["content"] = content
    if calls:
        fields["tool_calls"] = calls
    return DeltaMessage(**fields)


def prompt_logprobs_json(
    out: RequestOutput, num_top: int | None = None
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` shape: per prompt token, ``{token_id: {logprob, rank,
    decoded_token}}`` (``None`` for the first token); with ``num_top``, the prompt token and
    that many of the most likely ones (the engine may have computed more)."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            tid: {
                "logprob": max(lp.logprob, -9999.0),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in step.items()
            if num_top is None or tid == target or (lp.rank or 0) <= num_top
        }
        for target, step in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False)
    ]
