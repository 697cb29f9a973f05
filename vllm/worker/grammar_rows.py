"""The runner's side of structured output: which rows of a step are constrained, and their
token masks for the sampler.

A step's masks can only be filled once every constrained sequence's matcher has accepted the
sequence's previous token. For a prefill that is true at launch (its sequences have nothing in
flight); a decode step may be launched while the previous step's tokens are still on the
device, so its sampling is deferred: the runner replays the forward, the engine collects the
previous step (the output processor advances the matchers), and ``ModelRunner.finish_launch``
fills the masks and samples while the GPU still runs the forward.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from vllm.core.sequence import Sequence
from vllm.model_executor.guided_decoding.matcher import SequenceGrammar, TokenBitmask


def grammar_of(seq: Sequence) -> SequenceGrammar | None:
    """The sequence's matcher, created (and caught up with its outputs) when needed; ``None``
    for a sequence without a constraint or one that has finished."""
    compiled = seq.request.grammar
    if compiled is None or seq.status.finished:
        return None
    if seq.grammar is None:
        seq.grammar = SequenceGrammar(compiled)
    seq.grammar.sync(seq.token_ids, seq.prompt_len)
    return seq.grammar


def any_constrained(seqs: Seq[Sequence]) -> bool:
    return any(s.request.grammar is not None for s in seqs)


class GrammarRows:
    """The token bitmask buffers, allocated at the first constrained step."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self._bitmask: TokenBitmask | None = None
        self.masked_steps = 0  # steps that sampled under a mask (for tests and benchmarks)

    def masks(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """The device masks of ``seqs``, one row each, in order (all ones where unconstrained)."""
        if self._bitmask is None:
            self._bitmask = TokenBitmask(self.max_rows, self.vocab_size, self.device)
        self.masked_steps += 1
        return self._bitmask.fill([grammar_of(s) for s in seqs])
