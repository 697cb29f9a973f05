"""One pool of equal-size pages for both caches, and the per-sequence page tables.

A self page holds ``block_size`` tokens of K/V for every self-attention layer; a cross page
holds, in the same bytes, ``cross_block_size`` vision tokens for every cross-attention layer.
Page 0 is the null page (never allocated; padding rows point at it). Pages are reference
counted: n > 1 siblings share their full prompt pages and their request's cross pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from vllm.core.prefix_cache import NULL_PAGE, CachingPagePool, NoFreePages
from vllm.core.prefix_keys import chain_for, cross_key_for, images_seen, max_cached_pages
from vllm.core.sequence import Request, Sequence
from vllm.multimodal.processing import ProcessedInputs

__all__ = ["NULL_PAGE", "BlockManager", "NoFreePages"]



class BlockManager:
    """Allocates pages to sequences (self cache) and to requests (cross cache).

    With ``enable_prefix_caching`` a sequence's full pages are registered under their keys
    (``prefix_keys.py``) once their K/V is written (``cache_written``), and an admitted
    sequence takes the longest run of cached pages matching its own keys: its prefill starts
    after them. Without, the pool is the same but nothing is ever keyed, matched or cached.
    """

    def __init__(self, num_pages: int, block_size: int, cross_block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        self.pool = CachingPagePool(num_pages, block_size)
        self.block_size = block_size
        self.cross_block_size = cross_block_size
        self.enable_prefix_caching = enable_prefix_caching

    def pages_for_tokens(self, n: int) -> int:
        return -(-n // self.block_size)

    def cross_pages_for(self, request: Request) -> int:
        return -(-request.inputs.encoder_seq_len // self.cross_block_size)

    # ------------------------------------------------------------------ prefix cache
    def _caches(self, inputs: ProcessedInputs) -> bool:
        """Whether a request's pages are keyed: caching is on and every image has its
        identity (inputs built without digests are never shared)."""
        images = inputs.images
        return self.enable_prefix_caching and (
            images is None or len(images.digests) == images.num_images)

    def _lookup_keys(self, seq: Sequence) -> list[bytes]:
        """The keys of the sequence's pages it may take from the cache (none when caching
        is off or the request asks for prompt logprobs, which need every token computed)."""
        req = seq.request
        if not self._caches(req.inputs) or req.params.prompt_logprobs is not None:
            return []
        chain = self._chain(seq)
        chain.update(seq.token_ids)
        return chain.keys[: max_cached_pages(len(seq), self.block_size)]

    def key_prompt(self, inputs: ProcessedInputs) -> ProcessedInputs:
        """``inputs`` with its prompt's page keys (``ProcessedInputs.page_chain``) when
        prefix caching is on. Pure: the server calls it in its input threads."""
        if not self._caches(inputs):
            return inputs
        chain = chain_for(inputs, self.block_size)
        chain.update(inputs.prompt_token_ids)
        return dataclasses.replace(inputs, page_chain=chain)

    def _chain(self, seq: Sequence):
        if seq.page_keys is None:
            made = seq.request.inputs.page_chain
            if made is not None and made.block_size == self.block_size:
                seq.page_keys = made.fork()  # each sequence extends its own copy
            else:
                seq.page_keys = chain_for(seq.request.inputs, self.block_size)
        return seq.page_keys

    def probe_prefill(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(cached pages the sequences would take, how many of those are evictable now)."""
        hits = evictable = 0
        for s in seqs:
            keys = self._lookup_keys(s)
            if keys:
                h, e = self.pool.probe_self(keys)
                hits, evictable = hits + h, evictable + e
        return hits, evictable

    def _cross_key(self, request: Request) -> bytes | None:
        if not self._caches(request.inputs):
            return None
        if request.cross_key is None:
            request.cross_key = cross_key_for(request.inputs)
        return request.cross_key

    def skips_vision(self, request: Request, seqs: list[Sequence]) -> bool:
        """Whether an admission now runs no vision: the request's cross group is cached, and
        the tokens its sequences compute (past their cached pages) see only that group."""
        key = self._cross_key(request)
        if key is None or self.pool.probe_cross(key) is None:
            return False
        first = request.inputs.last_group[0]
        for s in seqs:
            lo, hi = images_seen(request.inputs.runs, self.cached_tokens(s), len(s))
            if hi > lo and lo < first:
                return False
        return True

    def pages_needed_for_prefill(self, request: Request, seqs: list[Sequence]) -> int:
        """Pages an admission takes from ``num_free``: the new ones, plus the cached pages it
        matches that are evictable now (they stop counting as free)."""
        need = sum(self.pages_for_tokens(len(s)) for s in seqs)
        hits, evictable = self.probe_prefill(seqs)
        need += evictable - hits
        if not request.cross_block_table and request.has_images:
            if self.skips_vision(request, seqs):
                size, cross_evictable = self.pool.probe_cross(self._cross_key(request))
                need += size if cross_evictable else 0
            else:
                need += self.cross_pages_for(request)
        return need

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens at the start of the sequence that an admission now would take from the
        cache (the prefill starts there)."""
        keys = self._lookup_keys(seq)
        return self.pool.probe_self(keys)[0] * self.block_size if keys else 0

    def allocate_prefill(self, request: Request, seqs: list[Sequence]) -> dict[int, int]:
        """Pages for every token of ``seqs`` (their cached prefix first) and, once per
        request, its cross pages. Returns each sequence's cached tokens, by seq_id."""
        starts: dict[int, int] = {}
        # Decided before the matches below change what counts as evictable.
        skip_vision = (not request.cross_block_table and request.has_images
                       and self.skips_vision(request, seqs))
        for s in seqs:
            assert not s.block_table
            keys = self._lookup_keys(s)
            cached = self.pool.match_self(keys, len(s)) if keys else []
            s.num_cached_pages = len(cached)
            starts[s.seq_id] = len(cached) * self.block_size
            s.block_table = cached
        if skip_vision:
            # Written by an earlier request: this one's prefill reads its K/V from the pages.
            pages = self.pool.match_cross(request.cross_key)
            assert pages is not None
            request.cross_block_table = pages
            request.cross_written = request.cross_cached = True
        elif not request.cross_block_table and request.has_images:
            if self._cross_key(request) is not None:
                self.pool.cross_cache_queries += 1  # looked up (probe_cross) and not found
            request.cross_block_table = self.pool.allocate(self.cross_pages_for(request))
            request.cross_written = request.cross_cached = False
        for s in seqs:
            s.block_table += self.pool.allocate(
                self.pages_for_tokens(len(s)) - len(s.block_table))
        return starts

    def cache_written(self, seq: Sequence, num_written: int) -> None:
        """Registers the sequence's full pages among its first ``num_written`` tokens (their
        K/V written by a step whose results were collected)."""
        if not self._caches(seq.request.inputs) or not seq.block_table or seq.status.finished:
            return
        full = min(num_written, len(seq)) // self.block_size
        if full <= seq.num_cached_pages:
            return
        chain = self._chain(seq)
        chain.update(seq.token_ids[: full * self.block_size])
        for i in range(seq.num_cached_pages, min(full, len(seq.block_table))):
            self.pool.cache_self(chain.keys[i], seq.block_table[i], i)
        seq.num_cached_pages = full

    def cache_cross(self, request: Request, pages: list[int]) -> None:
        """Registers the request's cross group, written by a step whose results were
        collected (``pages``: its cross table then; nothing if it no longer holds them)."""
        key = self._cross_key(request)
        if key is not None and pages and request.cross_block_table == pages:
            self.pool.cache_cross(key, pages)

    # ------------------------------------------------------------------ decode and fork
    def needs_new_page(self, seq: Sequence) -> bool:
        """Whether the next decode step's token needs a fresh page. That token sits at
        position len(seq) - 1, plus the tokens still in flight (async scheduling)."""
        return self.pages_for_tokens(len(seq) + seq.inflight) > len(seq.block_table)

    def append_page(self, seq: Sequence) -> int:
        page = self.pool.allocate(1)[0]
        seq.block_table.append(page)
        return page

    def fork(self, parent: Sequence, child: Sequence) -> int | None:
        """Child shares the parent's full pages; a partial last page is copied.

        Returns the new page that must receive a copy of the parent's last page, or None.
        """
        full = len(parent) // self.block_size
        shared = parent.block_table[:full]
        self.pool.incref(shared)
        child.block_table = list(shared)
        if parent.page_keys is not None:
            child.page_keys = parent.page_keys.fork()
        child.num_cached_pages = full  # the parent registers the shared pages
        if len(parent.block_table) > full:
            page = self.pool.allocate(1)[0]
            child.block_table.append(page)
            return page
        return None

    # ------------------------------------------------------------------ release
    def free_seq(self, seq: Sequence) -> None:
        self.pool.decref(seq.block_table)
        seq.block_table = []
        seq.num_cached_pages = 0

    def free_cross(self, request: Request) -> None:
        self.pool.decref(request.cross_block_table)
        request.cross_block_table = []
        request.cross_written = request.cross_cached = False

    def free_request(self, request: Request, seqs: list[Sequence]) -> None:
        """Frees the pages of ``seqs`` and the request's cross pages as one release (they
        age together in the cache's LRU order)."""
        self.pool.release([*(s.block_table for s in seqs), request.cross_block_table])
        for s in seqs:
            s.block_table = []
            s.num_cached_pages = 0
        request.cross_block_table = []
        request.cross_written = request.cross_cached = False

    def check_integrity(self, requests: Iterable[Request]) -> None:
        owners: list[list[int]] = []
        for r in requests:
            # The request's cross pages are owned once per request.
            owners.append(r.cross_block_table)
            owners.extend(s.block_table for s in r.seqs)
        self.pool.check_integrity(owners)
