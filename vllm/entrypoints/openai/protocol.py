"""Request and response bodies of the OpenAI-compatible API (vLLM's field names and defaults).

Requests allow unknown fields (``extra="allow"``); the server logs them as ignored. Sampling
fields default to ``None`` here: only the fields a client actually sent reach
``SamplingParams``, so the checkpoint's generation-config defaults fill the rest.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from vllm.entrypoints.openai.json_types import (
    X_BOUND,
    Bool,
    Float,
    Int,
    PromptText,
    TokenId,
    TokenIds,
    bounded_int,
    is_token_ids,
)
from vllm.entrypoints.openai.protocol_guided import guided_params
from vllm.entrypoints.openai.protocol_responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.request_checks import (
    NO_LIMITS,
    REQUEST_LIMITS,
    RequestLimits,
    check_content_parts,
    check_tokens,
    clamp,
    find_lone_surrogate,
    too_long,
)
from vllm.guided_params import GuidedDecodingParams
from vllm.inputs import MAX_CACHE_SALT_CHARS
from vllm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

# The request bodies, and the response bodies of protocol_responses.py (vLLM's protocol module
# holds both).
__all__ = [
    "GUIDED_FIELDS",
    "INT64_MAX",
    "INT64_MIN",
    "LOGIT_BIAS_LIMIT",
    "SAMPLING_FIELDS",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionResponseStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionResponseStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "ErrorInfo",
    "ErrorResponse",
    "OpenAIBaseModel",
    "StreamOptions",
    "UsageInfo",
    "random_id",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's (and vLLM's) range for logit_bias values: larger ones are clamped to it.
LOGIT_BIAS_LIMIT = 100.0

# Request fields copied to SamplingParams under the same name when the client sent them.
SAMPLING_FIELDS = (
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
# The request fields that ask for structured output (besides response_format).
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "structured_outputs",
)


class OpenAIBaseModel(BaseModel):
    """Base of request bodies: unknown fields are kept (and reported by ``ignored_fields``)."""

    model_config = ConfigDict(extra="allow")
    # Fields holding token ids (bounded by max_model_len), and by the vocabulary.
    _token_list_fields: ClassVar[tuple[str, ...]] = ()
    _vocab_list_fields: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        cls._check_lengths(data, REQUEST_LIMITS.get() or NO_LIMITS)
        for name in cls.model_fields:  # extra fields are ignored, so not scanned either
            if name in data:
                where = find_lone_surrogate(data[name], name)
                if where is not None:
                    raise ValueError(
                        f"{where}: contains a lone UTF-16 surrogate, which is not valid text."
                    )
        return data

    @classmethod
    def _check_lengths(cls, data: dict[str, Any], limits: RequestLimits) -> None:
        """O(1) per field: runs before pydantic (or the surrogate scan) looks at elements."""
        if limits.max_model_len is not None:
            for name in cls._token_list_fields:
                check_tokens(name, data.get(name), limits.max_model_len)
        if limits.vocab_size is not None:
            for name in cls._vocab_list_fields:
                value = data.get(name)
                if isinstance(value, (list, dict)) and len(value) > limits.vocab_size:
                    why = f"the vocabulary has {limits.vocab_size} tokens"
                    raise too_long(name, len(value), limits.vocab_size, why)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: the usage chunk (``include_usage`` defaults to true)."""

    include_usage: Bool | None = True
    continuous_usage_stats: Bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completion requests."""

    _vocab_list_fields: ClassVar[tuple[str, ...]] = (
        "logit_bias",
        "allowed_token_ids",
        "stop_token_ids",
    )

    model: str | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    n: Int | None = None
    seed: bounded_int(ge=INT64_MIN, le=INT64_MAX) | None = None
    stop: str | list[str] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions (``extra_body`` in the openai SDK)
    best_of: Int | None = None
    use_beam_search: Bool = False
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: Bool | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    skip_special_tokens: Bool | None = None
    spaces_between_special_tokens: Bool | None = None
    truncate_prompt_tokens: bounded_int(ge=1) | None = None
    prompt_logprobs: Int | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    request_id: str | None = None
    priority: Int = 0
    # Requests share cached KV only when their salts are equal (docs/security.md).
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefix-cache isolation: only requests with the same salt share cached "
        "KV (a tenant's secret keeps others from probing its cache through timing).",
    )
    # Structured output (protocol_guided.py turns these into GuidedDecodingParams).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written in decimal (``int()`` alone would also take " 5")."""
        for key in value or ():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}.")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _check_stop_limits(self) -> _SamplingRequest:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(
                f"`stop` has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed."
            )
        total = sum(len(s) for s in stops)
        if total > MAX_STOP_CHARS:
            raise ValueError(
                f"`stop` strings have {total} characters in total; at most {MAX_STOP_CHARS} "
                "are allowed."
            )
        return self

    @classmethod
    def _check_lengths(cls, data: dict[str, Any], limits: RequestLimits) -> None:
        super()._check_lengths(data, limits)
        limit = limits.max_model_len
        for name in ("max_tokens", "max_completion_tokens"):
            value = data.get(name)
            if limit is not None and type(value) is int and value >= limit:
                # Whatever the prompt: it has at least one token (the schema's maximum).
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {value} tokens in the completion ({name}), and the prompt "
                    "takes at least one. Please reduce the length of the completion."
                )
        for name in ("stop", "bad_words"):
            value = data.get(name)
            if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"`{name}` has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed."
                )

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for the fields the client set (and not to null).

        ``logit_bias`` values are clamped to [-100, 100] as OpenAI and vLLM document (a value
        beyond float32's range would turn logits into NaN); NaN and infinity stay, for
        SamplingParams to refuse."""
        sent = self.model_fields_set
        kwargs = {
            k: getattr(self, k)
            for k in SAMPLING_FIELDS
            if k in sent and getattr(self, k) is not None
        }
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = {
                k: clamp(v, LOGIT_BIAS_LIMIT) for k, v in kwargs["logit_bias"].items()
            }
        return kwargs

    def unsupported_feature(self) -> str | None:
        """The name of a requested feature this server does not implement, if any."""
        if self.use_beam_search:
            return "use_beam_search"
        return None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The structured-output constraint the request asks for (raises
        ``GuidedDecodingError``, a 400, when malformed)."""
        return guided_params(self)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` body."""

    _token_list_fields: ClassVar[tuple[str, ...]] = ("messages",)

    @classmethod
    def _check_lengths(cls, data: dict[str, Any], limits: RequestLimits) -> None:
        super()._check_lengths(data, limits)
        if limits.max_model_len is not None:
            check_content_parts(data.get("messages"), limits.max_model_len)

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    max_tokens: bounded_int(ge=1) | None = Field(
        default=None, description="Deprecated: max_completion_tokens"
    )
    max_completion_tokens: bounded_int(ge=1) | None = None
    tools: list[dict[str, Any]] | None = None
    # None: "auto" with tools, "none" without (OpenAI's rule).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = True
    echo: Bool = False
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("`top_logprobs` must be a positive value.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_feature(self) -> str | None:
        found = super().unsupported_feature()
        if found:
            return found
        if self.echo:
            return "echo"
        if self.mm_processor_kwargs:
            return "mm_processor_kwargs"
        return None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` body."""

    @classmethod
    def _check_lengths(cls, data: dict[str, Any], limits: RequestLimits) -> None:
        """A batch holds at most ``max_prompts`` prompts; a token-id prompt at most
        ``max_model_len`` ids (checked per prompt, so O(prompts))."""
        super()._check_lengths(data, limits)
        prompt = data.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return
        batch = isinstance(prompt[0], (list, str))
        if batch and limits.max_prompts is not None and len(prompt) > limits.max_prompts:
            why = "--max-queued-requests: each prompt is a request"
            raise too_long("prompt", len(prompt), limits.max_prompts, why)
        if limits.max_model_len is not None:
            for i, p in enumerate(prompt if batch else [prompt]):
                check_tokens(f"prompt[{i}]" if batch else "prompt", p, limits.max_model_len)

    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1, json_schema_extra={X_BOUND: "prompts"})]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra={X_BOUND: "prompts"})]
    )
    echo: Bool | None = False
    logprobs: bounded_int(ge=0) | None = None
    # 0 with echo: the prompt scored, nothing generated (loglikelihood).
    max_tokens: bounded_int(ge=0) | None = 16
    suffix: str | None = None
    add_special_tokens: Bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        """One message for every malformed prompt (pydantic's would list each union member)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(is_token_ids(p) for p in value) or is_token_ids(value):
                return value
        if value == [] or (isinstance(value, list) and [] in value):
            raise ValueError("The prompt must not be empty.")
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids (integers) or a "
            "list of lists of token ids."
        )

    def unsupported_feature(self) -> str | None:
        found = super().unsupported_feature()
        if found:
            return found
        if self.suffix:
            return "suffix"
        return None
