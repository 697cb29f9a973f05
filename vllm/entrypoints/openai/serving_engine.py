"""What the chat, completion and tokenization handlers share: the served model names, errors,
prompt-length checks, sampling parameters from a request, and running engine requests.

Handlers raise :class:`OpenAIServingError`; the app turns it into vLLM's (>= 0.10.1) error
body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from vllm.engine.async_llm_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    QueueTicket,
)
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIBaseModel,
)
from vllm.entrypoints.openai.server_limits import ServerLimits
from vllm.entrypoints.openai.streaming import wait_for_disconnect
from vllm.logger import init_logger
from vllm.multimodal.image import ImageMediaConnector
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class OpenAIServingError(Exception):
    """An error answered with an OpenAI-style body and the given HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


class ClientDisconnectedError(Exception):
    """The client went away before a non-streamed response was ready."""


def error_body(
    message: str, err_type: str, status: int, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def truncate_prompt(token_ids: list[int], keep_last: int | None) -> list[int]:
    """``truncate_prompt_tokens``: keep the last ``keep_last`` prompt tokens."""
    if keep_last is not None and 0 < keep_last < len(token_ids):
        return token_ids[-keep_last:]
    return token_ids


def bad_request(message: str, param: str | None = None) -> OpenAIServingError:
    return OpenAIServingError(message, 400, "BadRequestError", param)


def logprob_entries(params: SamplingParams, num_prompt: int, prompt_copies: int = 1) -> int:
    """Logprob entries a response for ``params`` may carry: per choice, per generated token,
    the sampled token and the alternatives; per prompt token (``prompt_copies`` times: once
    per choice in completions), the prompt token and its alternatives."""
    entries = 0
    if params.logprobs is not None:
        entries += params.n * (params.max_tokens or 0) * (params.logprobs + 1)
    if params.prompt_logprobs is not None:
        entries += prompt_copies * num_prompt * (params.prompt_logprobs + 1)
    return entries


@dataclass
class ServerContext:
    """State shared by every handler of one app."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    model_root: str
    media: ImageMediaConnector
    metrics: ServerMetrics
    chat_template: str | None = None
    response_role: str = "assistant"
    log_requests: bool = False
    max_log_len: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    # The longest token's text: a prompt of more than max_model_len times this many
    # characters cannot fit, and is refused before it is tokenized.
    max_token_chars: int = 64
    # Tool calling (--enable-auto-tool-choice, --tool-call-parser).
    enable_auto_tools: bool = False
    tool_call_parser: str | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model_config.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()


class OpenAIServing:
    """Base class of the endpoint handlers."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine

    # ------------------------------------------------------------------ request checks
    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        names = self.ctx.served_model_names
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise OpenAIServingError(
                f"The model `{requested}` does not exist.", 404, "NotFoundError", "model"
            )
        return requested

    def check_request(self, request: OpenAIBaseModel) -> str:
        """Model name, unsupported features and ignored fields; returns the model name.

        A dead engine fails a generation request here (500), before a stream could send its
        200 header; tokenization does not need the engine loop.
        """
        if isinstance(request, (ChatCompletionRequest, CompletionRequest)):
            self.check_engine_alive()
        name = self.model_name(getattr(request, "model", None))
        unsupported = getattr(request, "unsupported_feature", lambda: None)()
        if unsupported:
            raise bad_request(f"{unsupported} is not supported yet by this server.")
        ignored = request.ignored_fields()
        if ignored:
            logger.warning(
                "The following fields were present in the request but ignored: %s", ignored
            )
        return name

    def check_engine_alive(self) -> None:
        """Raises :class:`EngineDeadError` (a 500) when the engine loop is not running."""
        if not self.engine.is_running:
            dead = self.engine.dead_error
            raise EngineDeadError(
                f"engine loop died: {dead!r}" if dead is not None else "engine loop is not running"
            )

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """vLLM's context-length errors (the prompt is the decoder prompt, see usage)."""
        limit = self.ctx.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens} tokens in the messages, Please reduce the "
                "length of the messages."
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the messages, {max_tokens} in the completion). Please reduce the length of "
                "the messages or completion."
            )

    def check_chat_template(self, chat_template: str | None) -> None:
        """A request's own template runs only on a server that trusts them (upstream's rule)."""
        if chat_template is not None and not self.ctx.limits.trust_request_chat_template:
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not "
                "set. Refused request with untrusted chat template.",
                "chat_template",
            )

    def check_prompt_chars(self, text: str) -> None:
        """Refuses, before tokenizing it, a text too long to fit: every token covers at most
        ``max_token_chars`` characters."""
        limit = self.ctx.max_model_len * self.ctx.max_token_chars
        if len(text) > limit:
            raise bad_request(
                f"This model's maximum context length is {self.ctx.max_model_len} tokens. "
                f"However, the prompt has {len(text)} characters, more than any prompt of "
                f"that many tokens ({limit}). Please reduce the length of the messages.",
                "prompt",
            )

    def check_logprob_entries(self, entries: int) -> None:
        limit = self.ctx.limits.max_logprob_entries
        if entries > limit:
            raise bad_request(
                f"The response would carry {entries} logprob entries (n x max_tokens x "
                f"(logprobs + 1), plus prompt tokens x (prompt_logprobs + 1)), more than the "
                f"limit of {limit} (--max-logprob-entries). Reduce n, max_tokens or "
                "top_logprobs.",
                "logprobs",
            )

    def reserve(self, images: int = 0) -> QueueTicket:
        """A place in the engine's waiting queue, or a 503 with Retry-After."""
        limits = self.ctx.limits
        try:
            return self.engine.reserve(
                images, limits.max_queued_requests, limits.max_queued_images
            )
        except QueueFullError as e:
            raise OpenAIServingError(
                str(e),
                503,
                "ServiceUnavailableError",
                headers={"Retry-After": str(e.retry_after)},
            ) from None

    @staticmethod
    def engine_request_id(response_id: str, client_chose: bool) -> str:
        """The engine's id for a request: a client's ``request_id`` gets a random suffix, so
        that ids never collide (and a collision never tells one client about another's)."""
        return f"{response_id}-{uuid.uuid4().hex[:12]}" if client_chose else response_id

    # ------------------------------------------------------------------ inputs
    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        self.check_prompt_chars(text)
        tok = self.ctx.tokenizer
        enc = await asyncio.to_thread(tok, text, add_special_tokens=add_special_tokens)
        return list(enc["input_ids"])

    async def process(self, prompt: dict[str, Any]) -> Any:
        """The engine's input processing (in its worker pool); bad input -> 400."""
        try:
            return await self.engine.process_inputs(prompt)
        except (ValueError, TypeError, OSError) as e:
            raise bad_request(str(e)) from None

    def sampling_params(
        self,
        kwargs: dict[str, Any],
        max_tokens: int | None,
        default_max_tokens: int | None,
        stream: bool,
    ) -> SamplingParams:
        """SamplingParams from the fields the client sent, then the checkpoint's
        generation-config defaults for the rest (``update_from_generation_config``)."""
        llm_engine = self.engine.engine
        gen_config = llm_engine.generation_config
        if max_tokens is None and default_max_tokens is not None:
            max_tokens = default_max_tokens
            if gen_config.get("max_new_tokens"):
                max_tokens = min(max_tokens, int(gen_config["max_new_tokens"]))
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            params = SamplingParams(**kwargs, max_tokens=max_tokens, output_kind=kind)
            params.update_from_generation_config(gen_config, llm_engine.eos_token_ids)
            # The engine's own checks (logprobs cap, token ids), before any response starts.
            llm_engine.check_params(params)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        max_seqs = self.engine.config.scheduler_config.max_num_seqs
        if params.n > max_seqs:  # the scheduler's own check, but before a stream starts
            raise bad_request(f"n={params.n} exceeds max_num_seqs ({max_seqs}).", "n")
        self._check_token_ids(params)
        return params

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids the sampler indexes with: out of the vocabulary they would fail a whole
        batched step (every request in it), so they are refused here with a 400."""
        vocab = self.engine.config.model_config.spec.text.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", list(params.allowed_token_ids or [])),
        ):
            bad = [t for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise bad_request(
                    f"{name} contains token id {bad[0]}, outside the vocabulary "
                    f"(valid ids are 0..{vocab - 1}).",
                    name,
                )
        allowed = set(params.allowed_token_ids or ())
        if allowed and params.min_tokens > 0 and allowed <= params.all_stop_token_ids:
            # Every logit would be masked: the sampler has nothing to draw from.
            raise bad_request(
                "allowed_token_ids holds only stop or EOS tokens, which min_tokens suppresses: "
                "no token could be sampled.",
                "allowed_token_ids",
            )

    def log_request(
        self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams
    ) -> None:
        if not self.ctx.log_requests:
            return
        n = self.ctx.max_log_len
        text = prompt[:n] if (prompt is not None and n is not None) else prompt
        ids = token_ids[:n] if n is not None else token_ids
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            text,
            params,
            ids,
        )

    # ------------------------------------------------------------------ running requests
    @staticmethod
    def guided_decoding(request: ChatCompletionRequest | CompletionRequest) -> Any:
        """The request's structured-output constraint (``GuidedDecodingParams`` or None);
        a malformed one is a 400 naming the field."""
        try:
            return request.guided_decoding()
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def compile_constraint(self, params: SamplingParams) -> Any:
        """The compiled structured-output constraint of ``params`` (None without one), in a
        worker thread and bounded in time: a constraint that cannot be compiled is a 400
        naming the problem, before any response starts."""
        if params.guided_decoding is None:
            return None
        try:
            return await self.engine.compile_grammar(params)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def generate(
        self,
        processed: Any,
        params: SamplingParams,
        request_id: str,
        ticket: QueueTicket | None = None,
        grammar: Any = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's output stream for one prompt (checked first: raises a 400);
        ``grammar`` is ``compile_constraint``'s."""
        policy = self.engine.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise bad_request(
                f"priority={priority} needs --scheduling-policy priority (the server runs "
                f"{policy}).",
                "priority",
            )
        if params.prompt_logprobs is not None:
            vocab = self.engine.config.model_config.spec.text.vocab_size
            beyond = [t for t in processed.prompt_token_ids if t >= vocab]
            if beyond:  # e.g. <|image|>: it has an embedding but no logit
                raise bad_request(
                    f"prompt_logprobs cannot be computed for this prompt: it contains token id "
                    f"{beyond[0]}, outside the output vocabulary of {vocab} tokens (the image "
                    "token has no logit).",
                    "prompt_logprobs",
                )
        return self.engine.generate(
            None, params, request_id, processed=processed, ticket=ticket, grammar=grammar,
            priority=priority,
        )

    async def collect_final(
        self, gens: list[AsyncGenerator[RequestOutput, None]], raw_request: Request
    ) -> list[RequestOutput]:
        """Runs requests to completion; aborts them all if the client disconnects first."""

        async def last(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
            final = None
            async with contextlib.aclosing(gen):
                async for out in gen:
                    final = out
            if final is None:
                raise RuntimeError("the engine finished a request without output")
            return final

        async def run_all() -> list[RequestOutput]:
            try:
                async with asyncio.TaskGroup() as tg:  # one failure cancels the others
                    tasks = [tg.create_task(last(g)) for g in gens]
            except BaseExceptionGroup as eg:
                raise eg.exceptions[0] from None
            return [t.result() for t in tasks]

        work = asyncio.ensure_future(run_all())
        watcher = asyncio.ensure_future(wait_for_disconnect(raw_request.receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientDisconnectedError()
            try:
                return work.result()
            except ValueError as e:  # rejected by the engine when added
                raise bad_request(str(e)) from None
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
            for g in gens:  # requests that never started still hold nothing, but close them
                await g.aclose()
