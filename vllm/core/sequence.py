"""Request and sequence state held by the scheduler.

A :class:`Request` is what a user submitted (one prompt, its images, its sampling parameters).
It starts with one :class:`Sequence`; with ``n > 1`` the siblings are forked after the prompt's
prefill and share its full pages and the request's cross-attention pages.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.multimodal.processing import ProcessedInputs


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH_CAPPED,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop",
                SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Sequence:
    """One generated continuation: prompt tokens followed by its output tokens."""

    seq_id: int
    request: Request
    index: int  # sibling index, 0..n-1
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    row: int = -1  # the runner's persistent decode row while running
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Any]] | None = None
    output_text: str = ""
    stop_reason: int | str | None = None
    detokenizer: Any = None
    generator: Any = None
    inflight: int = 0  # tokens sampled on the device whose results the host has not read yet
    # Its grammar matcher (``guided_decoding.matcher.SequenceGrammar``) when the request has
    # a constraint: created at its first sample, kept in step with its output tokens (kept
    # over preemption; rebuilt from the tokens if it ever saw more than the sequence has).
    grammar: Any = None
    # Prefix caching: the keys of its full pages (a ``prefix_keys.PageKeyChain``, kept over
    # preemption) and how many of its first pages are cached or were offered to the cache.
    page_keys: Any = None
    num_cached_pages: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.request.inputs.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class Request:
    """A user request (vLLM's sequence group)."""

    request_id: str
    inputs: ProcessedInputs
    params: Any  # SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # --scheduling-policy priority: lower values are served first
    arrival_index: int = 0  # the scheduler's arrival counter (ties of arrival_time)
    seqs: list[Sequence] = field(default_factory=list)
    cross_block_table: list[int] = field(default_factory=list)
    cross_written: bool = False
    # Prefix caching: the key of its cross group, and whether its cross pages came written
    # from the cache (its prefill then reads their K/V and runs no vision).
    cross_key: bytes | None = None
    cross_cached: bool = False
    forked: bool = False  # siblings created (n > 1 after the first prefill)
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    error: BaseException | None = None  # set when the request failed inside the engine
    grammar: Any = None  # the compiled constraint (an xgrammar CompiledGrammar), if any

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs) and (
            self.forked or self.params.n == 1 or any(
                s.status == SequenceStatus.FINISHED_ABORTED for s in self.seqs))

    @property
    def has_images(self) -> bool:
        return self.inputs.images is not None
