"""A step's results, copied from the device to pinned host memory without waiting.

``ResultCopier.start`` enqueues the copies of everything a step produced (sampled ids, their
logprobs, prompt logprobs) behind the step's work and records an event; ``collect`` waits for
that event and turns the host tensors into lists. A launch never reads device data on the host,
so the host schedules step N+1 while the GPU still runs step N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm.core.sequence import Request, Sequence
from vllm.model_executor.layers.sampler import SamplerOutput

# Prompt logprobs of one request: [T, 1 + k] values and ids, [T] ranks; rank 0 marks a
# position whose target is an image token (no logprob there).
PromptLogprobs = tuple[list[list[float]], list[list[int]], list[int]]


@dataclass
class PromptLogprobsOnDevice:
    """One request's prompt logprobs as the step computed them (device tensors), with the
    host facts needed to read them."""

    values: torch.Tensor  # [T, 1 + k] float32
    token_ids: torch.Tensor  # [T, 1 + k] int64
    ranks: torch.Tensor  # [T] int64
    image_positions: list[bool]  # [T] host: the target at t is an image token

    @staticmethod
    def concat(parts: list[PromptLogprobsOnDevice]) -> PromptLogprobsOnDevice:
        """One request's prompt logprobs from those of its chunks, in order."""
        if len(parts) == 1:
            return parts[0]
        return PromptLogprobsOnDevice(
            torch.cat([p.values for p in parts]),
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.ranks for p in parts]),
            [b for p in parts for b in p.image_positions],
        )


@dataclass
class StepOutput:
    """Host results of one step: one entry per sampling sequence, in order."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[list[float]] | None = None  # [sampled, top-k...]
    logprob_ids: list[list[int]] | None = None
    ranks: list[int] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    num_prompt_tokens: int = 0  # tokens a prefill step computed (for the engine's stats)
    # (sequence, tokens whose K/V the step leaves written): full pages among them may be
    # offered to the prefix cache once the step's results are collected (filled only with
    # prefix caching on).
    written: list[tuple[Sequence, int]] = field(default_factory=list)
    # (request, its cross table) for each request whose cross group the step wrote.
    written_cross: list[tuple[Request, list[int]]] = field(default_factory=list)


@dataclass
class StepHandle:
    """A launched step: device results being copied to (pinned) host memory.

    A decode step with constrained rows is launched with its sampling deferred: ``finish``
    samples it (``ModelRunner.finish_launch``) and ``sampled`` is ``None`` until then."""

    result: StepOutput
    sampled: torch.Tensor | None  # host (pinned on CUDA) once the event has fired
    # Per sampling part: its row count and its (values, ids, ranks), None if it has none.
    logprobs: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] | None
    prompt_logprobs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]]]
    event: torch.cuda.Event | None
    # The step's sampling parts (and prompt logprobs on the device), once sampled.
    finish: Callable[[], tuple[list[tuple[SamplerOutput, int]], dict]] | None = None


class ResultCopier:
    """Starts the asynchronous result copies of each launched step and collects them."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.pin = device.type == "cuda"
        ring = max_rows if self.pin else 0
        # Sampled ids go to a ring of pinned buffers and events (nothing allocated per step):
        # a slot is reused three launches later, after its step has been collected.
        self._ring = [torch.empty(ring, dtype=torch.int64, pin_memory=ring > 0) for _ in range(3)]
        self._ring_events = [torch.cuda.Event() for _ in self._ring] if ring else []
        self._ring_views: dict[tuple[int, int], torch.Tensor] = {}
        self._launches = 0
        self._stream: torch.cuda.Stream | None = None
        self._device_index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if ring
            else -1
        )

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        return buf.copy_(t, non_blocking=True)

    def start(
        self,
        result: StepOutput,
        parts: list[tuple[SamplerOutput, int]],
        prompt_logprobs: dict[str, PromptLogprobsOnDevice],
    ) -> StepHandle:
        """Enqueues the copies behind the step's work; nothing here waits for the device.
        ``parts`` (samples, real rows) sample ``result.seqs`` in order: the decode's rows,
        then the prefill's."""
        n = len(result.seqs)
        pieces = [p.sampled_token_ids[:size] for p, size in parts]
        if len(pieces) == 1:
            ids = pieces[0]
        elif pieces:
            ids = torch.cat(pieces)
        else:
            ids = torch.empty(0, dtype=torch.int64)
        assert ids.shape[0] == n, (ids.shape, n)
        slot = self._launches % len(self._ring)
        self._launches += 1
        event = None
        if self.pin and 0 < n <= self._ring[0].shape[0]:
            buf = self._ring_views.get((slot, n))
            if buf is None:
                buf = self._ring_views[(slot, n)] = self._ring[slot][:n]
            sampled = buf.copy_(ids, non_blocking=True)
            event = self._ring_events[slot]
        else:
            sampled = self._to_host(ids)
        logprobs = []
        for part, size in parts:
            if part.logprobs is None:
                logprobs.append((size, None))
                continue
            assert part.logprob_token_ids is not None and part.sampled_ranks is not None
            logprobs.append(
                (
                    size,
                    (
                        self._to_host(part.logprobs[:size]),
                        self._to_host(part.logprob_token_ids[:size]),
                        self._to_host(part.sampled_ranks[:size]),
                    ),
                )
            )
        prompt = {
            rid: (
                self._to_host(p.values),
                self._to_host(p.token_ids),
                self._to_host(p.ranks),
                p.image_positions,
            )
            for rid, p in prompt_logprobs.items()
        }
        if self.pin:
            event = event or torch.cuda.Event()
            event.record(self._current_stream())
        has_logprobs = any(lp is not None for _, lp in logprobs)
        return StepHandle(result, sampled, logprobs if has_logprobs else None, prompt, event)

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``, cached while the raw stream stays the same (the
        public call builds a new Python object each time: host time on every step)."""
        index = self._device_index
        raw = torch._C._cuda_getCurrentRawStream(index)
        if self._stream is None or self._stream.cuda_stream != raw:
            self._stream = torch.cuda.current_stream(index)
        return self._stream

    @staticmethod
    def collect(handle: StepHandle) -> StepOutput:
        """Waits for a launched step's copies and returns its host results."""
        assert handle.finish is None and handle.sampled is not None, "step not sampled yet"
        if handle.event is not None:
            handle.event.synchronize()
        result = handle.result
        result.token_ids = handle.sampled.tolist()
        if handle.logprobs is not None:
            # Per part; a part without logprobs (none of its rows asked) gets empty entries.
            result.logprobs, result.logprob_ids, result.ranks = [], [], []
            for size, part in handle.logprobs:
                if part is None:
                    result.logprobs += [[] for _ in range(size)]
                    result.logprob_ids += [[] for _ in range(size)]
                    result.ranks += [0] * size
                    continue
                vals, ids, ranks = part
                result.logprobs += vals.tolist()
                result.logprob_ids += ids.tolist()
                result.ranks += ranks.tolist()
        for rid, (vals, ids, ranks, images) in handle.prompt_logprobs.items():
            ranks_l = [0 if image else r for image, r in zip(images, ranks.tolist(), strict=True)]
            result.prompt_logprobs[rid] = (vals.tolist(), ids.tolist(), ranks_l)
        return result
