"""The one owner of prefill work that spans steps: images encoded ahead, prompts in chunks.

A request's prefill may take several steps: its images are encoded a few encoder layers per
step (``encoder_layers_per_step``), then its prompt is prefilled a chunk per step under the
token budget (``enable_chunked_prefill``). :class:`PrefillTracker` holds that state for every
request that has any, as one :class:`PrefillProgress` with an explicit phase:

``ENCODING`` -> ``ENCODED`` -> ``CHUNKED`` -> (done: the record is dropped, the request decodes)

An image request starts in ``ENCODING`` when the encoder is spread over steps, a text request
(or any request when images are encoded inside the prefill step) goes straight to ``CHUNKED``
with its first chunk. Preemption and abort drop the record (``reset``): pages are freed by the
scheduler, the request keeps its tokens and pixels, and everything is recomputed later, so
nothing is lost at any point of a chunked or batched prefill.

The scheduler decides what each step carries and advances the records when it schedules; the
runner executes the step and attaches the device results to the records it was handed
(``hold_encoder``, ``finish_encoding``, ``hold_vision``, ``add_prompt_logprobs``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from vllm.core.sequence import Request, Sequence


class PrefillPhase(enum.Enum):
    ENCODING = "encoding"  # some image layers scheduled; the runner holds the encoder state
    ENCODED = "encoded"  # vision tokens ready; no prompt token computed yet
    CHUNKED = "chunked"  # some prompt tokens in the cache, not all


@dataclass(eq=False)
class PrefillProgress:
    """A request's prefill in progress (see the module docstring for the phases)."""

    request: Request
    phase: PrefillPhase
    encoder_layers_left: int = 0  # image-layers still to run (ENCODING)
    computed: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens in the cache
    # Device state, attached by the runner: the encoder part-way, then the request's projected
    # vision tokens (kept until its last chunk ran, which the later chunks attend to).
    encoder: Any = None
    vision: Any = None
    # Prompt logprobs of the chunks so far (device tensors), emitted with the last chunk.
    prompt_logprobs: list[Any] = field(default_factory=list)
    # n > 1: siblings forked at admission (by parent seq_id), sampled by the parent's last
    # chunk, and the copies of the parent's partial last page they need after it.
    children: dict[int, list[Sequence]] = field(default_factory=dict)
    page_copies: list[tuple[int, int]] = field(default_factory=list)

    def num_computed(self, seq: Sequence) -> int:
        return self.computed.get(seq.seq_id, 0)

    # Runner side: device results of the work the scheduler handed out.
    def hold_encoder(self, encoder: Any, layers_left: int) -> None:
        self.encoder, self.encoder_layers_left = encoder, layers_left

    def finish_encoding(self, vision: Any) -> None:
        assert self.phase is PrefillPhase.ENCODING
        self.encoder, self.vision, self.encoder_layers_left = None, vision, 0
        self.phase = PrefillPhase.ENCODED

    def hold_vision(self, vision: Any) -> None:
        self.vision = vision

    def add_prompt_logprobs(self, part: Any) -> None:
        self.prompt_logprobs.append(part)

    @property
    def encoded(self) -> bool:
        return self.phase is not PrefillPhase.ENCODING


class PrefillTracker:
    """Every request's :class:`PrefillProgress`, by request id."""

    def __init__(self, encoder_layers_per_image: int) -> None:
        self.encoder_layers_per_image = encoder_layers_per_image
        self._progress: dict[str, PrefillProgress] = {}

    def get(self, request: Request) -> PrefillProgress | None:
        return self._progress.get(request.request_id)

    def __len__(self) -> int:
        return len(self._progress)

    def is_prefilling(self, seq: Sequence) -> bool:
        """Admitted but its tokens are not all in the cache yet (it must not decode)."""
        p = self._progress.get(seq.request.request_id)
        return p is not None and seq.seq_id in p.computed

    def num_computed(self, seq: Sequence) -> int:
        p = self._progress.get(seq.request.request_id)
        return 0 if p is None else p.num_computed(seq)

    def count(self, phase: PrefillPhase) -> int:
        """Requests in ``phase`` (metrics and traces)."""
        return sum(1 for p in self._progress.values() if p.phase is phase)

    def num_encoding_ahead(self, waiting: list[Request]) -> int:
        """Waiting requests whose images are encoded or being encoded (they hold memory)."""
        return sum(1 for r in waiting if r.request_id in self._progress)

    # ------------------------------------------------------------------ transitions
    def grant_encoder(self, request: Request, layers: int) -> PrefillProgress:
        """``layers`` image-layers of the request's encoder scheduled in this step."""
        p = self._progress.get(request.request_id)
        if p is None:
            layers_left = request.inputs.num_images * self.encoder_layers_per_image
            p = PrefillProgress(request, PrefillPhase.ENCODING, layers_left)
            self._progress[request.request_id] = p
        assert p.phase is PrefillPhase.ENCODING
        p.encoder_layers_left = max(p.encoder_layers_left - layers, 0)
        return p

    def admit(
        self, request: Request, seqs: list[Sequence], starts: dict[int, int] | None = None
    ) -> PrefillProgress:
        """The request got its pages: each of ``seqs`` is prefilling from token 0, or from
        ``starts[seq_id]`` (its tokens taken from the prefix cache)."""
        p = self._progress.get(request.request_id)
        if p is None:
            p = PrefillProgress(request, PrefillPhase.CHUNKED)
            self._progress[request.request_id] = p
        assert p.encoded, "admitted before its images were encoded"
        p.phase = PrefillPhase.CHUNKED
        starts = starts or {}
        p.computed = {s.seq_id: starts.get(s.seq_id, 0) for s in seqs}
        return p

    def chunk(self, seq: Sequence, end: int) -> tuple[PrefillProgress, int, bool]:
        """Schedules the sequence's tokens up to ``end``; returns its record, the chunk's
        start and whether this was the last chunk (then the sequence leaves the record)."""
        p = self._progress[seq.request.request_id]
        assert p.phase is PrefillPhase.CHUNKED
        start = p.computed[seq.seq_id]
        assert start < end <= len(seq), (start, end, len(seq))
        last = end == len(seq)
        if last:
            p.computed.pop(seq.seq_id, None)
        else:
            p.computed[seq.seq_id] = end
        return p, start, last

    def finish_if_done(self, request: Request) -> None:
        """Drops the record once no sequence of the request has tokens left to prefill (the
        runner has taken what it needs for this step's chunks: the record's vision stays
        alive through the step's own references)."""
        p = self._progress.get(request.request_id)
        if p is not None and p.phase is PrefillPhase.CHUNKED and not p.computed:
            del self._progress[request.request_id]

    def reset(self, request: Request) -> None:
        """Preemption or abort: the request's prefill starts over (or never runs)."""
        self._progress.pop(request.request_id, None)
