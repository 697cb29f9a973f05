"""What one step carries (``Scheduler.schedule``'s output, the runner's input)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.core.prefill_tracker import PrefillProgress
from vllm.core.sequence import Request, Sequence


@dataclass(eq=False)
class PrefillChunk:
    """Tokens ``[start, end)`` of a sequence, prefilled in this step (``start`` of them are in
    the cache already). The last chunk samples for ``samplers`` (the sequence, then the
    siblings forked from it)."""

    seq: Sequence
    start: int
    end: int
    progress: PrefillProgress
    samplers: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class EncoderWork:
    """``layers`` image-layers of a waiting request's vision encoder."""

    progress: PrefillProgress
    layers: int


@dataclass
class SchedulerOutput:
    """What the runner executes in one step."""

    decode_seqs: list[Sequence] = field(default_factory=list)
    new_pages: list[tuple[Sequence, int]] = field(default_factory=list)  # decode appends
    chunks: list[PrefillChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # after the forward
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes: the budget's measure."""
        return len(self.decode_seqs) + sum(c.num_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sample_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step (the runner's results put the
        chunks it runs as decode-graph rows before the eager ones)."""
        return self.decode_seqs + [s for c in self.chunks for s in c.samplers]

    @property
    def requests(self) -> list[Request]:
        seqs = self.decode_seqs + [c.seq for c in self.chunks]
        return list({id(s.request): s.request for s in seqs}.values())

    @property
    def is_empty(self) -> bool:
        return not (self.decode_seqs or self.chunks or self.encoder_work)
