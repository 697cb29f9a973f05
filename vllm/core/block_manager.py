"""One pool of equal-size pages for both caches, and the per-sequence page tables.

A self page holds ``block_size`` tokens of K/V for every self-attention layer; a cross page
holds, in the same bytes, ``cross_block_size`` vision tokens for every cross-attention layer.
Page 0 is the null page (never allocated; padding rows point at it). Pages are reference
counted: n > 1 siblings share their full prompt pages and their request's cross pages.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from vllm.core.sequence import Request, Sequence

NULL_PAGE = 0


class NoFreePages(RuntimeError):
    """The pool cannot satisfy an allocation (the scheduler checks first; this is a bug guard)."""


class PagePool:
    """Free list and reference counts of pages ``1 .. num_pages - 1``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("the page pool needs at least one page besides the null page")
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_allocatable(self) -> int:
        return self.num_pages - 1

    def usage(self) -> float:
        """Fraction of allocatable pages in use (the KV-cache usage gauge)."""
        return 1.0 - self.num_free / self.num_allocatable

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreePages(f"asked for {n} pages, {len(self.free)} free")
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self.ref[p] > 0, f"incref of free page {p}"
            self.ref[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self.ref[p] > 0, f"double free of page {p}"
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(p)

    def check_integrity(self, owners: Iterable[list[int]]) -> None:
        """Every reference is accounted for: raises AssertionError on a leak, a double
        ownership, a referenced free page or a duplicate in the free list."""
        counts = Counter(p for table in owners for p in table)
        assert NULL_PAGE not in counts, "the null page is owned"
        free = set(self.free)
        assert len(free) == len(self.free), "duplicate page in the free list"
        assert NULL_PAGE not in free, "the null page is in the free list"
        for p in range(1, self.num_pages):
            assert self.ref[p] == counts.get(p, 0), (
                f"page {p}: refcount {self.ref[p]} but {counts.get(p, 0)} owners")
            assert (self.ref[p] == 0) == (p in free), f"page {p}: free list disagrees"


class BlockManager:
    """Allocates pages to sequences (self cache) and to requests (cross cache)."""

    def __init__(self, num_pages: int, block_size: int, cross_block_size: int) -> None:
        self.pool = PagePool(num_pages)
        self.block_size = block_size
        self.cross_block_size = cross_block_size

    def pages_for_tokens(self, n: int) -> int:
        return -(-n // self.block_size)

    def cross_pages_for(self, request: Request) -> int:
        return -(-request.inputs.encoder_seq_len // self.cross_block_size)

    def pages_needed_for_prefill(self, request: Request, seqs: list[Sequence]) -> int:
        need = sum(self.pages_for_tokens(len(s)) for s in seqs)
        if not request.cross_block_table:
            need += self.cross_pages_for(request)
        return need

    def allocate_prefill(self, request: Request, seqs: list[Sequence]) -> None:
        """Pages for every token of ``seqs`` and, once per request, its cross pages."""
        if not request.cross_block_table and request.has_images:
            request.cross_block_table = self.pool.allocate(self.cross_pages_for(request))
            request.cross_written = False
        for s in seqs:
            assert not s.block_table
            s.block_table = self.pool.allocate(self.pages_for_tokens(len(s)))

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
        if len(parent.block_table) > full:
            page = self.pool.allocate(1)[0]
            child.block_table.append(page)
            return page
        return None

    def free_seq(self, seq: Sequence) -> None:
        self.pool.decref(seq.block_table)
        seq.block_table = []

    def free_cross(self, request: Request) -> None:
        self.pool.decref(request.cross_block_table)
        request.cross_block_table = []
        request.cross_written = False

    def check_integrity(self, requests: Iterable[Request]) -> None:
        owners: list[list[int]] = []
        for r in requests:
            # The request's cross pages are owned once per request.
            owners.append(r.cross_block_table)
            owners.extend(s.block_table for s in r.seqs)
        self.pool.check_integrity(owners)
