"""Incremental detokenization with stop strings, one ``IncrementalDetokenizer`` per sequence.

Each step decodes only a short window of tokens: the tokens since the last *clean boundary*
(a point after which the decoded text ended in a complete character), so the cost per token
does not grow with the sequence. Text is released in three stages:

1. decoded: a token whose bytes end inside a UTF-8 character decodes to a trailing U+FFFD; the
   characters before that are final, the trailing U+FFFD run is held until later tokens complete
   it (or until ``flush``);
2. searched: stop strings are looked for in the newly decoded characters plus the previous
   ``max(len(stop)) - 1`` characters, so matches that span tokens are found;
3. released: unless ``include_stop_str_in_output``, the last ``max(len(stop)) - 1`` characters
   are held back, because a stop string completed by a later token would remove them.

For a byte-level BPE tokenizer the released text after ``flush`` equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` without
``clean_up_tokenization_spaces`` (transformers 5 skips that clean-up for BPE anyway; vLLM never
applies it to generated text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers
from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the output, so the first output tokens are decoded in context
# (matters for tokenizers whose decoder treats the first token of a string specially).
_PROMPT_CONTEXT_TOKENS = 5
# Tokens decoded past the last clean boundary before the window is cut at an exact split point.
# Valid text reaches a clean boundary within a few tokens; bytes that are not UTF-8 (a broken or
# random model) can keep the text ending in U+FFFD indefinitely, and each step would decode an
# ever longer window.
_MAX_PENDING_TOKENS = 32


@dataclass(frozen=True)
class DetokenizeResult:
    """Text released by one ``add_tokens`` call, and the stop string that ended the sequence."""

    new_text: str
    stop_string: str | None = None


def _make_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, spaces_between: bool
) -> Callable[[Sequence[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        # Fast tokenizers: call the Rust decoder directly (what ``decode`` does for BPE).
        def decode_fast(ids: Sequence[int]) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode_slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between,
            clean_up_tokenization_spaces=False,
        )

    return decode_slow


def _last(text: str, count: int) -> str:
    return text[max(0, len(text) - count) :] if count > 0 else ""


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, step by step, and finds stop strings.

    ``add_tokens`` returns the newly *released* text; ``flush`` releases what is held back and
    must be called once when the sequence finishes for any reason other than a stop string.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = _make_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in self._stop), default=0)
        self._tail_len = max(longest - 1, 0)  # characters kept for matching across tokens
        self._hold_len = 0 if include_stop_str_in_output else self._tail_len
        self._tail = ""  # last ``_tail_len`` decoded characters
        self._unreleased = ""  # decoded characters not released yet (at most ``_hold_len``)
        self._released: list[str] = []
        self._finished = False
        # Token window: [0, _read) is context that ends at a clean boundary, [_read, end) is
        # being decoded; ``_emitted`` characters of the latter are already decoded.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt does not end on a character boundary: no context
        self._window = context
        self._read = len(context)
        self._context_len: int | None = None  # len(decode(window[:read])), computed lazily
        self._emitted = 0
        self._cut_after = _MAX_PENDING_TOKENS  # pending tokens before trying _cut_window

    @property
    def output_text(self) -> str:
        """The text released so far (all of it after a stop string or ``flush``)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def finished(self) -> bool:
        return self._finished

    def add_tokens(self, new_ids: Sequence[int], check_stop: bool = True) -> DetokenizeResult:
        """Appends generated ids; returns the released text and the stop string if one fired.

        After a stop string the output is truncated before it (or after it, with
        ``include_stop_str_in_output``) and the detokenizer is finished. ``check_stop=False``
        skips the stop-string search (vLLM ignores stop strings until ``min_tokens``).
        """
        if self._finished:
            raise RuntimeError("add_tokens() after the sequence finished (stop string or flush)")
        self._window.extend(new_ids)
        return self._emit(self._decode_window(final=False), check_stop)

    def flush(self) -> DetokenizeResult:
        """Finishes the sequence: releases held characters (a trailing U+FFFD run included)."""
        if self._finished:
            return DetokenizeResult("")
        result = self._emit(self._decode_window(final=True), check_stop=True)
        if result.stop_string is not None:
            return result
        held, self._unreleased = self._unreleased, ""
        self._release(held)
        self._finished = True
        return DetokenizeResult(result.new_text + held)

    # ------------------------------------------------------------------ internals
    def _decode_window(self, final: bool) -> str:
        """Newly final characters of the window (all remaining characters if ``final``)."""
        if self._read == len(self._window):
            return ""
        if self._context_len is None:
            self._context_len = len(self._decode(self._window[: self._read]))
        full = self._decode(self._window)
        fresh = full[self._context_len :]
        if fresh.endswith(_REPLACEMENT) and not final:
            # Possibly an incomplete character: everything before the U+FFFD run is final.
            stable = len(fresh.rstrip(_REPLACEMENT))
            new = fresh[self._emitted : stable]
            self._emitted = max(self._emitted, stable)
            if len(self._window) - self._read > self._cut_after:
                new += self._cut_window(full)
            return new
        new = fresh[self._emitted :]
        # Clean boundary at the end: the decoded tokens become the next step's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._context_len = None
        self._emitted = 0
        self._cut_after = _MAX_PENDING_TOKENS
        return new

    def _cut_window(self, full: str) -> str:
        """Shortens a window that has gone many tokens without a clean end; returns the
        characters this makes final that were held (U+FFFD of invalid bytes).

        First, pending tokens that decode to nothing (special tokens being skipped) are
        dropped if the window still decodes the same. Then the head is cut at a token boundary
        ``j`` where the text splits exactly (``decode(w[:j]) + decode(w[j:]) == decode(w)``)
        and the tail decodes to at least 3 characters, hence holds at least 3 bytes: an
        incomplete UTF-8 character has at most 3, so later tokens can only change the tail's
        decoding and the head's characters are final. Where neither applies the window stays
        whole (as it would without this) and the next try waits for as many tokens again."""
        pending = self._window[self._read :]
        kept = [t for t in pending if self._decode([t]) != ""]
        if len(kept) < len(pending) and self._decode(self._window[: self._read] + kept) == full:
            self._window = self._window[: self._read] + kept
        released, n, tries = "", len(self._window), 0
        for j in range(n - 1, self._read, -1):
            tail = self._decode(self._window[j:])
            if len(tail) < 3:
                continue
            head = self._decode(self._window[:j])
            if head + tail == full:
                head_fresh = len(head) - self._context_len
                if self._emitted < head_fresh:
                    released = full[self._context_len + self._emitted : len(head)]
                self._emitted = max(self._emitted - head_fresh, 0)
                self._window = self._window[j:]
                self._read = 0
                self._context_len = 0
                break
            tries += 1
            if tries == 4:
                break
        pending_now = len(self._window) - self._read
        self._cut_after = (_MAX_PENDING_TOKENS if pending_now <= _MAX_PENDING_TOKENS
                           else pending_now + _MAX_PENDING_TOKENS)
        return released

    def _emit(self, new: str, check_stop: bool) -> DetokenizeResult:
        if not new:
            return DetokenizeResult("")
        search = self._tail + new
        hit = self._find_stop(search, len(self._tail)) if check_stop and self._stop else None
        start = len(self._tail) - len(self._unreleased)  # first unreleased character in search
        if hit is not None:
            stop_string, end = hit
            text = search[start:end]
            self._release(text)
            self._unreleased = ""
            self._finished = True
            return DetokenizeResult(text, stop_string)
        pending = self._unreleased + new
        keep = min(self._hold_len, len(pending))
        text = pending[: len(pending) - keep]
        self._unreleased = pending[len(pending) - keep :]
        self._tail = _last(search, self._tail_len)
        self._release(text)
        return DetokenizeResult(text)

    def _find_stop(self, search: str, old_len: int) -> tuple[str, int] | None:
        """The stop string that completes first in ``search[old_len:]``, and where text ends.

        Only matches that end in the new characters count (older ones were searched before or
        deliberately skipped). Ties on the end go to the longer match.
        """
        best: tuple[int, int, str] | None = None  # (match end, match start, stop string)
        for stop in self._stop:
            index = search.find(stop, max(0, old_len - len(stop) + 1))
            if index >= 0:
                candidate = (index + len(stop), index, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, start, stop = best
        return stop, end if self._include_stop else start

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)


def detokenize_logprob_tokens(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own (special tokens kept), for ``Logprob.decoded_token``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return backend.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]
