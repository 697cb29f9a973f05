"""Results handed to users: ``RequestOutput`` with one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.sequence import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One generated continuation (vLLM's fields)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) of a request's life, under vLLM's names.

    ``time_in_queue`` is ``first_scheduled_time - arrival_time``. The per-request step times
    upstream fills only when it collects detailed traces (``scheduler_time``,
    ``model_forward_time``, ``model_execute_time``) are ``None`` here: steps are batched and
    launched asynchronously, so no request has a time of its own.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of a request after a step (vLLM's fields)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    lora_request: None = None
    num_images: int = field(default=0, repr=False)
    # Set when this request failed inside the engine (its outputs end with "abort"); the
    # other requests of the batch are unaffected.
    error: BaseException | None = field(default=None, repr=False)
