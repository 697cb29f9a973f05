"""``POST /v1/completions``: raw prompts (a string, strings, token ids or lists of them).

Each prompt is its own engine request; choice ``index`` is ``prompt_index * n + sample_index``
as in vLLM. Every prompt is tokenized, length-checked and processed before any of them starts,
so a bad prompt in a batch fails the whole call with a 400 and runs nothing.

Loglikelihood scoring (lm-evaluation-harness and the like): ``echo`` with ``logprobs=k`` puts
the prompt's tokens in front of the generated ones, each with its logprob and the ``k`` most
likely tokens (the first prompt token has none: ``None``, as in vLLM); ``max_tokens=0``
generates nothing, so the choice is the prompt alone. The prompt logprobs are the engine's
``prompt_logprobs`` (computed with the prefill, on the device), also returned on their own, in
vLLM's shape, when the request asks for ``prompt_logprobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vllm.engine.async_llm_engine import QueueTicket
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.serving_chat import in_band_error, prompt_logprobs_json, token_text
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    bad_request,
    logprob_entries,
    truncate_prompt,
)
from vllm.entrypoints.openai.streaming import (
    SSE_DONE,
    SSEResponse,
    merge_async_iterators,
    sse_event,
)
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import Logprob

# OpenAI's JSON stand-in for a logprob of -inf.
MIN_LOGPROB = -9999.0


@dataclass
class _Prepared:
    """One prompt of the request, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    processed: Any
    grammar: Any = None  # the compiled constraint, if the request has one


def _close_all(tickets: list[QueueTicket]) -> None:
    for t in tickets:
        t.close()


def top_entries(step: dict[int, Logprob], target: int, num_top: int) -> dict[int, Logprob]:
    """One position's entries: its own token and the ``num_top`` most likely ones (a step may
    hold more when ``prompt_logprobs`` asked for more than ``logprobs``)."""
    return {t: lp for t, lp in step.items() if t == target or (lp.rank or 0) <= num_top}


def append_logprobs(
    out: CompletionLogProbs,
    token_ids: list[int],
    steps: list[dict[int, Logprob] | None],
    num_top: int,
    tokenizer: Any,
    offset: int,
) -> int:
    """Appends one entry per token to the parallel lists; a ``None`` step (the first prompt
    token) has no logprob and no alternatives. ``text_offset`` counts the tokens' texts from
    ``offset``; returns the offset after the last token."""
    for tid, step in zip(token_ids, steps, strict=False):
        if step is None:
            text = tokenizer.decode([tid])
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = step.get(tid)
            text = token_text(tid, chosen, tokenizer)
            out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
            out.top_logprobs.append(
                {
                    token_text(t, lp, tokenizer): max(lp.logprob, MIN_LOGPROB)
                    for t, lp in top_entries(step, tid, num_top).items()
                }
            )
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("The prompt must not be empty.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    """Completions over the async engine."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_request(request)
        prompts = _prompt_list(request.prompt)
        tickets: list[QueueTicket] = []
        try:
            for _ in prompts:  # each prompt is an engine request: a place in the queue each
                tickets.append(self.reserve())
            prepared = [await self._prepare(request, p) for p in prompts]
            # Prompt logprobs appear once per choice for echo, and once more when asked for.
            echo_logprobs = bool(request.echo) and request.logprobs is not None
            copies = prepared[0].params.n * (echo_logprobs + (request.prompt_logprobs is not None))
            self.check_logprob_entries(
                sum(logprob_entries(p.params, len(p.token_ids), copies) for p in prepared)
            )
            base_id = f"cmpl-{request.request_id}" if request.request_id else random_id("cmpl")
            engine_base = self.engine_request_id(base_id, bool(request.request_id))
            gens = []
            for i, (p, ticket) in enumerate(zip(prepared, tickets, strict=True)):
                rid = f"{engine_base}-{i}"
                self.log_request(rid, p.text, p.token_ids, p.params)
                gens.append(
                    self.generate(p.processed, p.params, rid, ticket, p.grammar, request.priority)
                )
            if request.stream:
                body = self._stream(request, gens, prepared, base_id, model)
                return SSEResponse(body, on_close=lambda: _close_all(tickets))
            finals = await self.collect_final(gens, raw_request)
        except BaseException:
            _close_all(tickets)
            raise
        _close_all(tickets)
        # Large logprob responses take a while to build and encode: off the event loop.
        return await asyncio.to_thread(
            lambda: JSONResponse(
                self._response(request, finals, prepared, base_id, model).model_dump()
            )
        )

    async def _prepare(self, request: CompletionRequest, prompt: str | list[int]) -> _Prepared:
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = await self.tokenize_text(prompt, request.add_special_tokens)
        else:
            text, ids = None, [int(t) for t in prompt]
        ids = truncate_prompt(ids, request.truncate_prompt_tokens)
        self.check_length(len(ids), request.max_tokens)
        kwargs = request.sampling_kwargs()
        kwargs["guided_decoding"] = self.guided_decoding(request)
        if request.logprobs is not None:
            kwargs["logprobs"] = request.logprobs
            if request.echo:  # the echoed prompt's logprobs, with as many alternatives
                kwargs["prompt_logprobs"] = max(kwargs.get("prompt_logprobs", 0), request.logprobs)
        params = self.sampling_params(
            kwargs, request.max_tokens, self.ctx.max_model_len - len(ids), bool(request.stream)
        )
        engine_prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            engine_prompt["prompt"] = text
        if request.cache_salt is not None:
            engine_prompt["cache_salt"] = request.cache_salt
        grammar = await self.compile_constraint(params)
        return _Prepared(text, ids, params, await self.process(engine_prompt), grammar)

    def _echo_text(self, request: CompletionRequest, prep: _Prepared) -> str:
        """The prompt as echoed: the client's text, or its token ids decoded."""
        if not request.echo:
            return ""
        return prep.text if prep.text is not None else self.ctx.tokenizer.decode(prep.token_ids)

    def _logprobs(
        self,
        request: CompletionRequest,
        final: RequestOutput,
        token_ids: list[int],
        steps: list[dict[int, Logprob]] | None,
        offset: int,
        echo: bool,
    ) -> CompletionLogProbs | None:
        """The choice's logprobs: the prompt's first when ``echo``, then the generated tokens
        (``offset``: where their text starts in the choice)."""
        if request.logprobs is None:
            return None
        tok, k = self.ctx.tokenizer, request.logprobs
        out = CompletionLogProbs()
        if echo:  # the prompt tokens' offsets count their texts from 0, as vLLM's do
            prompt_steps = final.prompt_logprobs or [None] * len(final.prompt_token_ids)
            append_logprobs(out, final.prompt_token_ids, prompt_steps, k, tok, 0)
        append_logprobs(out, token_ids, list(steps or []), k, tok, offset)
        return out

    def _response(
        self,
        request: CompletionRequest,
        finals: list[RequestOutput],
        prepared: list[_Prepared],
        request_id: str,
        model: str,
    ) -> CompletionResponse:
        choices, num_prompt, num_generated = [], 0, 0
        for i, (final, prep) in enumerate(zip(finals, prepared, strict=True)):
            num_prompt += len(prep.token_ids)
            prefix = self._echo_text(request, prep)
            asked = request.prompt_logprobs
            prompt_lps = None if asked is None else prompt_logprobs_json(final, asked)
            for c in final.outputs:
                num_generated += len(c.token_ids)
                logprobs = self._logprobs(
                    request, final, c.token_ids, c.logprobs, len(prefix), request.echo
                )
                choices.append(
                    CompletionResponseChoice(
                        index=i * prep.params.n + c.index,
                        text=prefix + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_lps,
                    )
                )
        usage = UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
        )
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(
        self,
        request: CompletionRequest,
        gens: list[AsyncGenerator[RequestOutput, None]],
        prepared: list[_Prepared],
        request_id: str,
        model: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(include_usage and opts and opts.continuous_usage_stats)
        num_prompt = sum(len(p.token_ids) for p in prepared)
        generated: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        echoed: set[int] = set()

        def usage() -> UsageInfo:
            total = sum(generated.values())
            return UsageInfo(
                prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total
            )

        def chunk(choice: CompletionResponseStreamChoice | None) -> str:
            fields: dict[str, Any] = {"choices": [choice] if choice is not None else []}
            if choice is None or continuous:
                fields["usage"] = usage()
            resp = CompletionStreamResponse(
                id=request_id, object="text_completion", created=created, model=model, **fields
            )
            return sse_event(resp.model_dump_json(exclude_unset=True))

        try:
            async with contextlib.aclosing(merge_async_iterators(gens)) as merged:
                async for i, out in merged:
                    for c in out.outputs:
                        index = i * prepared[i].params.n + c.index
                        if index in done:
                            continue
                        generated[index] = generated.get(index, 0) + len(c.token_ids)
                        has_logprobs = c.logprobs is not None and len(c.token_ids) > 0
                        echo = request.echo and index not in echoed  # with the first chunk
                        if c.finish_reason is None and not (c.text or has_logprobs or echo):
                            continue
                        if c.finish_reason is not None:
                            done.add(index)
                        prefix = self._echo_text(request, prepared[i]) if echo else ""
                        echoed.add(index)
                        start = offsets.get(index, 0) + len(prefix)
                        logprobs = self._logprobs(
                            request, out, c.token_ids, c.logprobs, start, echo
                        )
                        offsets[index] = start + len(c.text)
                        yield chunk(
                            CompletionResponseStreamChoice(
                                index=index,
                                text=prefix + c.text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
            if include_usage:
                yield chunk(None)
        except Exception as e:
            yield sse_event(json.dumps(in_band_error(e)))
        yield SSE_DONE
