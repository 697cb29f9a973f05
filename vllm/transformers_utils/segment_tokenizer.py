"""Chat prompts tokenized piece by piece, the long pieces remembered.

A chat client resends the whole conversation on every turn, so the rendered prompt of turn k + 1
begins with the text of turn k, and tokenizing it again costs time that grows with the history
(about 4 us a token on one CPU core for the Llama 3 tokenizer: 23 ms for 6,000 tokens).

A fast tokenizer cuts its input at its added tokens (``<|eot_id|>``, ``<|start_header_id|>``,
``<|image|>``, ...) before anything else and tokenizes the text between them on its own
(tokenizers' ``AddedVocabulary``, leftmost-longest matching). The pieces of a chat prompt are
therefore independent: a message's text gives the same ids whatever surrounds it. This module
does that cut itself, takes each long piece's ids from a bounded cache, and tokenizes the
others in one batch, with exactly the ids ``tokenizer(text, add_special_tokens=False)``
gives. It is used only where that equality holds by construction: no normalizer, and added
tokens matched as written (not normalized, no stripping, not single-word); any other tokenizer
is called as is. A probe checks the equality once at construction as well.
"""

from __future__ import annotations

import re
import threading
import weakref
from array import array
from collections import OrderedDict
from typing import Any

# Pieces at least this long are remembered (a message's text); shorter ones (role names,
# separators) are cheaper to tokenize again than to look up.
MIN_CACHED_CHARS = 128
# Bound of the cache: characters of remembered text (and salts) plus 8 bytes per remembered id.
MAX_CACHE_BYTES = 64 << 20

_PROBE = (
    "Hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n<|image|>  two  spaces\n"
    " and\ttabs, ünïcödé 123 4567<|eot_id|>x<|reserved_special_token_3|> <|image|><|image|>"
)


def _splittable(tokenizer: Any) -> Any:
    """The tokenizers back end of ``tokenizer`` if its added tokens cut the text as this
    module does (see the module docstring), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    if backend.normalizer is not None:
        return None
    added = backend.get_added_tokens_decoder()
    if not added or any(
        t.normalized or t.lstrip or t.rstrip or t.single_word for t in added.values()
    ):
        return None
    return backend


class SegmentTokenizer:
    """``encode(text)`` == ``tokenizer(text, add_special_tokens=False)["input_ids"]``, with
    the long pieces between added tokens cached (thread-safe, bounded in bytes)."""

    def __init__(self, tokenizer: Any, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # (cache_salt, piece) -> ids
        self._cache: OrderedDict[tuple[str | None, str], array] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0
        self._backend = _splittable(tokenizer)
        if self._backend is None:
            return
        added = self._backend.get_added_tokens_decoder()
        self._ids = {t.content: i for i, t in added.items()}
        # Longest first: at one position the alternation then takes the longest match, and
        # re scans left to right: leftmost-longest, as the tokenizer matches added tokens.
        names = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
        if self._encode(_PROBE) != self._reference(_PROBE):
            self._backend = None  # not the equality this class promises: tokenize whole

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def _reference(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str, cache_salt: str | None = None) -> list[int]:
        """The ids of ``text`` without the tokenizer's own special tokens (BOS). Pieces are
        remembered per ``cache_salt``: a hit shows in timing, so tenants share none."""
        if self._backend is None:
            return self._reference(text)
        return self._encode(text, cache_salt)

    def _encode(self, text: str, cache_salt: str | None = None) -> list[int]:
        parts = self._split.split(text)  # text, added token, text, ..., text
        found: dict[int, array] = {}
        todo: list[int] = []
        with self._lock:
            for i in range(0, len(parts), 2):
                piece = parts[i]
                if len(piece) < MIN_CACHED_CHARS:
                    if piece:
                        todo.append(i)
                    continue
                ids = self._cache.get((cache_salt, piece))
                if ids is None:
                    self.misses += 1
                    todo.append(i)
                else:
                    self.hits += 1
                    self._cache.move_to_end((cache_salt, piece))
                    found[i] = ids
        if todo:
            encoded = self._backend.encode_batch([parts[i] for i in todo], add_special_tokens=False)
            fresh = {i: array("l", e.ids) for i, e in zip(todo, encoded, strict=True)}
            found.update(fresh)
            self._remember(
                {
                    (cache_salt, parts[i]): ids
                    for i, ids in fresh.items()
                    if len(parts[i]) >= MIN_CACHED_CHARS
                }
            )
        out: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._ids[part])
            elif part:
                out.extend(found[i])
        return out

    def _remember(self, entries: dict[tuple[str | None, str], array]) -> None:
        with self._lock:
            for key, ids in entries.items():
                size = _size(key, ids)
                if size > self.max_bytes or key in self._cache:
                    continue
                self._cache[key] = ids
                self._bytes += size
                while self._bytes > self.max_bytes:
                    self._bytes -= _size(*self._cache.popitem(last=False))

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes


def _size(key: tuple[str | None, str], ids: array) -> int:
    return len(key[0] or "") + len(key[1]) + 8 * len(ids)


_REGISTRY: weakref.WeakKeyDictionary[Any, SegmentTokenizer] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def segment_tokenizer(tokenizer: Any) -> SegmentTokenizer:
    """The one :class:`SegmentTokenizer` of ``tokenizer`` (made on first use)."""
    with _REGISTRY_LOCK:
        seg = _REGISTRY.get(tokenizer)
        if seg is None:
            seg = _REGISTRY[tokenizer] = SegmentTokenizer(tokenizer)
        return seg
