"""The page pool with a prefix cache: reference-counted pages, and full self pages and cross
groups kept under their keys (``prefix_keys.py``) after their owners let them go.

A page is in exactly one of three states:

* **free**: holds nothing anyone can find; handed out first;
* **referenced** (``ref > 0``): in some sequence's page table or request's cross table; it may
  also be *cached* (registered under a key, so that other requests can share it);
* **evictable**: cached and unreferenced. It still holds its K/V, and a request whose keys
  match takes it back (``match_self`` / ``match_cross``); until then it counts as free (in
  ``num_free``, the usage gauge and admission), and an allocation that finds the free list
  short evicts it.

A **self entry** is one page; a **cross entry** is a whole cross group (the pages of one image
group's cross-attention K/V), evicted as a unit, since a partial group is of no use.

Eviction order
--------------
Every time pages are released (one ``decref`` or ``release`` call: the pages an owner lets go
at once), the entries that become evictable are stamped with that release's number. Eviction
takes the entry with the oldest stamp first: least recently used, by last release, across self
pages and cross groups alike. So a cross group is never evicted while an entry released before
it remains (a 200 MiB group is not evicted for one self page while older self pages remain),
and it is never kept past entries released after it (it is not kept forever). Entries released
together are evicted cheapest first: self pages before cross groups (a page costs one page of
prefill to recompute, a group the vision tower and the K/V projection of all its images), and
of self pages the deepest in its chain first (a page whose parent is gone can never be matched,
so parents outlive their children). Evicting a group frees all its pages; the ones beyond the
allocation's need join the free list and serve the next allocations, so no younger entry is
evicted before an older one.

Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens looked up and
found (vLLM's ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``);
``cross_cache_queries`` / ``cross_cache_hits`` count cross-group lookups (the block manager
also counts, as a query, each image request that found no usable group and allocated its own).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NULL_PAGE = 0
_SELF, _CROSS = 0, 1  # also the tie rank: self pages go before cross groups


class NoFreePages(RuntimeError):
    """The pool cannot satisfy an allocation (the scheduler checks first; this is a bug guard)."""


@dataclass(eq=False)
class _Entry:
    key: bytes
    kind: int
    pages: list[int]
    depth: int  # a self page's index in its chain (0 for a cross group)
    referenced: int  # how many of its pages have ref > 0
    stamp: int = -1  # the heap item that makes it evictable (-1: not evictable)


class CachingPagePool:
    """Free list, reference counts and the prefix cache of pages ``1 .. num_pages - 1``.

    The pool interface (``allocate``, ``incref``, ``decref``, ``num_free``, ``usage``,
    ``check_integrity``) is the plain pool's; ``match_*`` take cached pages (a reference each),
    ``cache_*`` register written pages under their keys, ``probe_*`` answer admission
    questions without changing anything."""

    def __init__(self, num_pages: int, block_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the page pool needs at least one page besides the null page")
        self.num_pages = num_pages
        self.block_size = block_size
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(1, num_pages))
        self._self: dict[bytes, _Entry] = {}
        self._cross: dict[bytes, _Entry] = {}
        self._entry_of: dict[int, _Entry] = {}
        # Evictable entries: (release number, tie rank, -depth, stamp, entry); an item is live
        # while its stamp equals its entry's (matching an entry unstamps it).
        self._heap: list[tuple[int, int, int, int, _Entry]] = []
        self._stamps = itertools.count()
        self._releases = 0
        self.num_evictable = 0  # pages in evictable entries
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.cross_cache_queries = 0
        self.cross_cache_hits = 0

    # ------------------------------------------------------------------ the pool interface
    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free ones and evictable cached ones."""
        return len(self.free) + self.num_evictable

    @property
    def num_allocatable(self) -> int:
        return self.num_pages - 1

    def usage(self) -> float:
        """Fraction of allocatable pages referenced (the KV-cache usage gauge)."""
        return 1.0 - self.num_free / self.num_allocatable

    def allocate(self, n: int) -> list[int]:
        """``n`` pages, each with one reference: free pages first, then evicted ones."""
        if n > self.num_free:
            raise NoFreePages(f"asked for {n} pages, {self.num_free} free")
        while len(self.free) < n:
            self._evict_oldest()
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Another reference to referenced pages (siblings sharing pages)."""
        for p in pages:
            assert self.ref[p] > 0, f"incref of unreferenced page {p}"
            self.ref[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page, as one release (see the module docstring)."""
        self.release([pages])

    def release(self, tables: Iterable[Iterable[int]]) -> None:
        """Drops one reference from each page of each table, all as one release: a finished or
        preempted request's sequences and cross group age together."""
        self._releases += 1
        for pages in tables:
            for p in pages:
                assert p != NULL_PAGE and self.ref[p] > 0, f"double free of page {p}"
                self.ref[p] -= 1
                if self.ref[p] > 0:
                    continue
                entry = self._entry_of.get(p)
                if entry is None:
                    self.free.append(p)
                    continue
                entry.referenced -= 1
                if entry.referenced == 0:
                    self._make_evictable(entry)

    # ------------------------------------------------------------------ self pages
    def probe_self(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(pages ``match_self`` would return, how many of them are evictable now): taking
        those makes them stop counting as free, which admission must count as allocation."""
        hits = evictable = 0
        for key in keys:
            entry = self._self.get(key)
            if entry is None:
                break
            hits += 1
            evictable += entry.referenced == 0
        return hits, evictable

    def match_self(self, keys: Sequence[bytes], num_tokens: int) -> list[int]:
        """The cached pages of the longest run of ``keys`` from the first, each with a new
        reference. ``num_tokens`` is the prompt length the lookup is for (the counters)."""
        pages = []
        for key in keys:
            entry = self._self.get(key)
            if entry is None:
                break
            self._acquire(entry)
            pages.append(entry.pages[0])
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += len(pages) * self.block_size
        return pages

    def cache_self(self, key: bytes, page: int, depth: int) -> bool:
        """Registers a full, written, referenced self page under its key (``depth``: its index
        in the chain). False when the key is already cached (two requests computed the same
        page): this page then stays uncached and is freed as usual."""
        assert self.ref[page] > 0, f"caching unreferenced page {page}"
        if key in self._self:
            return False
        assert page not in self._entry_of, f"page {page} is cached twice"
        entry = _Entry(key, _SELF, [page], depth, referenced=1)
        self._self[key] = entry
        self._entry_of[page] = entry
        return True

    # ------------------------------------------------------------------ cross groups
    def probe_cross(self, key: bytes) -> tuple[int, bool] | None:
        """(the group's page count, whether it is evictable now), or None if not cached."""
        entry = self._cross.get(key)
        return None if entry is None else (len(entry.pages), entry.referenced == 0)

    def match_cross(self, key: bytes) -> list[int] | None:
        """The cached cross group under ``key`` with a new reference on each page, or None."""
        self.cross_cache_queries += 1
        entry = self._cross.get(key)
        if entry is None:
            return None
        self.cross_cache_hits += 1
        self._acquire(entry)
        return list(entry.pages)

    def cache_cross(self, key: bytes, pages: Sequence[int]) -> bool:
        """Registers a written cross group (its pages referenced together) under its key;
        False when the key is already cached (these pages then stay uncached)."""
        assert pages and all(self.ref[p] > 0 for p in pages), "caching unreferenced pages"
        if key in self._cross:
            return False
        assert not any(p in self._entry_of for p in pages), "a page is cached twice"
        assert len(set(pages)) == len(pages), "a page appears twice in one group"
        entry = _Entry(key, _CROSS, list(pages), 0, referenced=len(pages))
        self._cross[key] = entry
        for p in pages:
            self._entry_of[p] = entry
        return True

    # ------------------------------------------------------------------ maintenance
    def reset(self) -> int:
        """Forgets every key (vLLM's reset of the prefix cache): evictable entries are freed,
        referenced ones stay with their owners but can no longer be matched. Returns the pages
        freed."""
        freed = 0
        for entry in [*self._self.values(), *self._cross.values()]:
            if entry.referenced == 0:
                self.num_evictable -= len(entry.pages)
                self.free.extend(entry.pages)
                freed += len(entry.pages)
            self._drop(entry)
        self._heap = []
        return freed

    def check_integrity(self, owners: Iterable[list[int]]) -> None:
        """Every reference is accounted for and every page is in exactly one state: raises
        AssertionError on a leak, a double ownership, a referenced page that is free or
        evictable, or an index that disagrees with the pages."""
        counts = Counter(p for table in owners for p in table)
        assert NULL_PAGE not in counts, "the null page is owned"
        free = set(self.free)
        assert len(free) == len(self.free), "duplicate page in the free list"
        assert NULL_PAGE not in free and NULL_PAGE not in self._entry_of
        for key, entry in [*self._self.items(), *self._cross.items()]:
            assert entry.key == key
            assert all(self._entry_of.get(p) is entry for p in entry.pages), "index mismatch"
        entries = {id(e): e for e in self._entry_of.values()}
        assert len(entries) == len(self._self) + len(self._cross), "an unkeyed entry"
        live = {item[3] for item in self._heap}
        evictable_pages = 0
        for entry in entries.values():
            assert (self._self if entry.kind == _SELF else self._cross).get(entry.key) is entry
            referenced = sum(self.ref[p] > 0 for p in entry.pages)
            assert entry.referenced == referenced, f"entry {entry.pages}: reference count"
            if referenced == 0:
                assert entry.stamp in live, f"evictable entry {entry.pages} is not in the heap"
                evictable_pages += len(entry.pages)
            else:
                assert entry.stamp == -1, f"referenced entry {entry.pages} is evictable"
        assert self.num_evictable == evictable_pages, "evictable page count"
        for p in range(1, self.num_pages):
            assert self.ref[p] == counts.get(p, 0), (
                f"page {p}: refcount {self.ref[p]} but {counts.get(p, 0)} owners"
            )
            in_free, cached = p in free, p in self._entry_of
            assert not (in_free and cached), f"page {p} is free and cached"
            if self.ref[p] > 0:
                assert not in_free, f"page {p} is referenced and free"
            else:
                assert in_free or cached, (
                    f"page {p} is lost (unreferenced, neither free nor cached)"
                )

    # ------------------------------------------------------------------ internals
    def _acquire(self, entry: _Entry) -> None:
        if entry.referenced == 0:  # evictable: it stops counting as free
            entry.stamp = -1
            self.num_evictable -= len(entry.pages)
        for p in entry.pages:
            if self.ref[p] == 0:
                entry.referenced += 1
            self.ref[p] += 1

    def _make_evictable(self, entry: _Entry) -> None:
        entry.stamp = next(self._stamps)
        heapq.heappush(self._heap, (self._releases, entry.kind, -entry.depth, entry.stamp, entry))
        self.num_evictable += len(entry.pages)
        if len(self._heap) > 2 * len(self._entry_of) + 64:  # drop stale items now and then
            self._heap = [item for item in self._heap if item[3] == item[4].stamp]
            heapq.heapify(self._heap)

    def _evict_oldest(self) -> None:
        while True:
            *_, stamp, entry = heapq.heappop(self._heap)
            if stamp == entry.stamp:
                break
        assert all(self.ref[p] == 0 for p in entry.pages), "evicting a referenced page"
        self.num_evictable -= len(entry.pages)
        self._drop(entry)
        self.free.extend(entry.pages)

    def _drop(self, entry: _Entry) -> None:
        """Removes an entry from the index (its pages' state is the caller's business)."""
        del (self._self if entry.kind == _SELF else self._cross)[entry.key]
        for p in entry.pages:
            del self._entry_of[p]
        entry.stamp = -1
