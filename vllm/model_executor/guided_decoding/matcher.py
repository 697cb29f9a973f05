"""Per-sequence grammar matchers and the per-row token bitmask the sampler applies.

A sequence's ``SequenceGrammar`` has accepted exactly its output tokens so far (``sync``
brings it there: the tokens it has not seen are accepted, and a matcher that saw tokens the
sequence no longer has is rebuilt from the start). The bitmask of a step is one row per
sampled row, xgrammar's layout (int32 words, bit ``t % 32`` of word ``t // 32`` set when token
``t`` is allowed); rows without a constraint are all ones, so one fixed kernel sequence serves
mixed batches. Masks are written on the host into pinned buffers (a ring: a buffer is reused
only after the steps that read it were collected) and copied to one static device buffer
asynchronously; nothing here reads device memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.guided_params import GuidedDecodingError
from vllm.model_executor.guided_decoding.utf8_guard import GROUND, Utf8Guard

_RING = 3  # pinned host buffers; see TokenBitmask.fill


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A request's compiled constraint: the xgrammar grammar and its vocabulary's UTF-8
    guard (``utf8_guard.py``)."""

    grammar: Any  # xgrammar CompiledGrammar
    utf8: Utf8Guard


class SequenceGrammar:
    """One sequence's xgrammar matcher, in step with its output tokens."""

    def __init__(self, compiled: CompiledConstraint) -> None:
        import xgrammar as xgr

        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._utf8 = GROUND
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the constraint is complete and nothing may follow."""
        return bool(self._matcher.is_terminated())

    def sync(self, token_ids: Sequence[int], prompt_len: int) -> None:
        """Accepts the output tokens (``token_ids[prompt_len:]``) not seen yet, rebuilding
        the matcher first if it saw more than the sequence has; raises
        ``GuidedDecodingError`` when the grammar rejects one. Indexes in place: no copy of
        the output per token."""
        if self.num_accepted > len(token_ids) - prompt_len:
            self.rebuild(token_ids[prompt_len:])
            return
        for i in range(prompt_len + self.num_accepted, len(token_ids)):
            self._accept(token_ids[i])

    def rebuild(self, output_token_ids: Sequence[int]) -> None:
        """A fresh matcher that has accepted ``output_token_ids``."""
        self._matcher.reset()
        self._utf8 = GROUND
        self.num_accepted = 0
        for token_id in output_token_ids:
            self._accept(token_id)

    def _accept(self, token_id: int) -> None:
        if self.terminated or not self._matcher.accept_token(int(token_id)):
            raise GuidedDecodingError(
                f"token {token_id} at output position {self.num_accepted} does not match the "
                "request's constraint"
            )
        self._utf8 = self._compiled.utf8.state_after(self._utf8, int(token_id))
        self.num_accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int, array: np.ndarray | None = None) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (a host int32 tensor;
        ``array`` is its numpy view, when the caller has one)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._compiled.utf8.restrict(bitmask.numpy() if array is None else array, row, self._utf8)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenBitmask:
    """The static device buffer of per-row masks and its pinned host staging buffers."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = bitmask_words(vocab_size)
        pin = device.type == "cuda"
        self.vocab_size = vocab_size
        self.device_buffer = torch.full((max_rows, words), -1, dtype=torch.int32, device=device)
        self._host = [
            torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
            for _ in range(_RING)
        ]
        # Host rows are written through numpy views: a torch op per row costs more host time
        # (and wakes torch's thread pool on the CPU).
        self._arrays = [h.numpy() for h in self._host]
        self._fills = 0
        self._views: dict[int, torch.Tensor] = {}

    def fill(self, grammars: Sequence[SequenceGrammar | None]) -> torch.Tensor:
        """Fills one row per entry (all ones for ``None``) and enqueues the copy to the
        device; returns the device rows ``[len(grammars), words]``.

        Host buffer ``k`` is written again ``_RING`` fills later; by then the step that read
        it has been collected (the engine holds at most one step in flight), so its copy is
        done and nothing waits here."""
        n = len(grammars)
        slot = self._fills % _RING
        host, array = self._host[slot], self._arrays[slot]
        self._fills += 1
        for i, grammar in enumerate(grammars):
            if grammar is None or grammar.terminated:
                array[i] = -1
            else:
                grammar.fill(host, i, array)
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.device_buffer[:n]
        view.copy_(host[:n], non_blocking=True)
        return view


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets the logits of the tokens each row's mask disallows to ``-inf`` (in place) and
    returns ``logits``: ``[n, V]`` float32 with ``bitmask`` ``[n, ceil(V / 32)]`` int32. A fixed
    sequence of element-wise kernels, without host synchronisation."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.view(n, -1)[:, :vocab].to(torch.bool)
    return logits.masked_fill_(~allowed, float("-inf"))
