"""The caching page pool: cached pages count as free, are found again, are evicted oldest
release first (cheap ties first), are never handed out while referenced, and the integrity
check covers them. A hypothesis state machine runs random interleavings of admissions (cache
hits, allocation, registration), sibling sharing, preemption-style partial releases, frees,
resets and decode allocations against a model of the eviction order and of page contents."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm.core.prefix_cache import NULL_PAGE, CachingPagePool, NoFreePages

B = 4  # tokens per page


def key(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def chain(symbols: list[int]) -> list[bytes]:
    """Distinct prefixes get distinct keys (a stand-in for prefix_keys.page_keys)."""
    return [key("page", tuple(symbols[: i + 1])) for i in range(len(symbols))]


def test_cached_pages_count_as_free_and_are_found_again() -> None:
    pool = CachingPagePool(6, B)  # 5 allocatable pages
    keys = chain([1, 2, 3])
    pages = pool.allocate(3)
    for depth, (k, p) in enumerate(zip(keys, pages, strict=True)):
        assert pool.cache_self(k, p, depth)
    assert pool.num_free == 2 and pool.usage() == pytest.approx(3 / 5)
    pool.decref(pages)
    assert pool.num_free == 5 and pool.usage() == 0.0 and pool.num_evictable == 3
    pool.check_integrity([])
    assert pool.probe_self(chain([1, 2, 9])) == (2, 2)
    got = pool.match_self(chain([1, 2, 9]), num_tokens=11)
    assert got == pages[:2] and pool.num_free == 3
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (11, 2 * B)
    pool.check_integrity([got])
    # A sibling shares them; releasing one owner keeps them referenced (not evictable).
    pool.incref(got)
    pool.decref(got)
    assert pool.num_free == 3
    pool.check_integrity([got])
    # A second page under a cached key stays uncached and is freed as usual.
    (dup,) = pool.allocate(1)
    assert not pool.cache_self(keys[0], dup, 0)
    pool.decref([dup])
    pool.decref(got)
    pool.check_integrity([])
    assert pool.num_free == 5 and pool.num_evictable == 3


def _cross(pool: CachingPagePool, name: str, n: int) -> list[int]:
    pages = pool.allocate(n)
    assert pool.cache_cross(key("cross", name), pages)
    return pages


def _self_pages(pool: CachingPagePool, symbols: list[int]) -> list[int]:
    pages = pool.allocate(len(symbols))
    for depth, (k, p) in enumerate(zip(chain(symbols), pages, strict=True)):
        pool.cache_self(k, p, depth)
    return pages


def test_a_large_group_is_not_evicted_for_one_page_while_older_pages_remain() -> None:
    pool = CachingPagePool(11, B)  # 10 pages
    old = _self_pages(pool, [1, 2])
    group = _cross(pool, "img", 6)
    young = _self_pages(pool, [7, 8])
    pool.decref(old)  # release 1
    pool.decref(group)  # release 2
    pool.decref(young)  # release 3
    assert pool.num_free == 10 and not pool.free
    (p,) = pool.allocate(1)
    assert p == old[1]  # the oldest release, its deepest page first
    assert pool.probe_cross(key("cross", "img")) == (6, True)
    assert pool.probe_self(chain([1, 2])) == (1, 1)
    pool.allocate(1)
    assert pool.probe_self(chain([1])) == (0, 0)
    # No self page older than the group is left: the next page evicts the group (it is not
    # kept forever), and its other five pages serve the next allocations; the younger self
    # pages survive all of them.
    pool.allocate(1)
    assert pool.probe_cross(key("cross", "img")) is None
    assert len(pool.free) == 5
    pool.allocate(5)
    assert pool.probe_self(chain([7, 8])) == (2, 2)


def test_released_together_self_pages_go_before_the_group_deepest_first() -> None:
    pool = CachingPagePool(8, B)  # 7 pages
    seq = _self_pages(pool, [1, 2, 3])
    group = _cross(pool, "img", 4)
    pool.release([group, seq])  # one request finishing: one release
    order = [pool.allocate(1)[0] for _ in range(3)]
    assert order == [seq[2], seq[1], seq[0]]
    assert pool.probe_cross(key("cross", "img")) == (4, True)
    assert pool.allocate(1)[0] in group and pool.probe_cross(key("cross", "img")) is None


def test_a_hit_makes_an_entry_young_again_and_referenced_pages_are_never_evicted() -> None:
    pool = CachingPagePool(6, B)
    a = _self_pages(pool, [1])
    b = _self_pages(pool, [2])
    pool.decref(a)
    pool.decref(b)
    pool.match_self(chain([1]), 4)
    pool.decref(a)  # a was used again after b: b is now the older one
    assert pool.allocate(4)[-1] == b[0]  # 3 free pages, then b
    assert pool.probe_self(chain([1])) == (1, 1)
    assert pool.match_self(chain([1]), 4) == a
    with pytest.raises(NoFreePages):  # everything is referenced now
        pool.allocate(1)


def test_cross_groups_are_shared_and_a_preempted_request_finds_its_pages() -> None:
    pool = CachingPagePool(10, B)
    group = _cross(pool, "img", 3)
    assert pool.match_cross(key("cross", "img")) == group  # a second request shows it
    seq = _self_pages(pool, [1, 2])
    pool.release([seq, group])  # the first request is preempted
    pool.check_integrity([group])
    assert pool.probe_cross(key("cross", "img")) == (3, False)  # still read by the second
    assert pool.match_self(chain([1, 2]), 9) == seq  # resumed: its own pages again
    assert pool.match_cross(key("cross", "img")) == group
    assert (pool.cross_cache_queries, pool.cross_cache_hits) == (2, 2)
    assert pool.match_cross(key("cross", "other")) is None
    pool.check_integrity([seq, group, group])


def test_reset_and_integrity_failures() -> None:
    pool = CachingPagePool(6, B)
    held = _self_pages(pool, [1])
    gone = _self_pages(pool, [2, 3])
    pool.decref(gone)
    assert pool.reset() == 2 and pool.num_evictable == 0 and len(pool.free) == 4
    assert pool.probe_self(chain([1])) == (0, 0)
    pool.check_integrity([held])
    pool.decref(held)  # no longer cached: plain free
    assert len(pool.free) == 5
    pool.check_integrity([])
    with pytest.raises(AssertionError):
        pool.decref(held)  # double free
    pages = _self_pages(pool, [4])
    with pytest.raises(AssertionError):
        pool.check_integrity([])  # a leak
    with pytest.raises(AssertionError):
        pool.check_integrity([pages, pages])  # double ownership
    pool.ref[pages[0]] = 0  # a page dropped without a release: lost and miscounted
    with pytest.raises(AssertionError):
        pool.check_integrity([])


class PoolMachine(RuleBasedStateMachine):
    """Requests over a small pool. The model knows what each page holds (a key, or None for
    an uncached write) and predicts which cached entries each allocation evicts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = CachingPagePool(13, B)
        self.owners: list[dict[str, list[int]]] = []  # {"seq": pages, "cross": pages}
        self.holds: dict[int, object] = {}  # page -> what was written into it
        self.cached: dict[bytes, tuple[list[int], int, int]] = {}  # key -> pages, kind, depth
        self.evictable: dict[bytes, tuple[int, int, int, int]] = {}  # key -> order
        self.releases = 0
        self.order = 0

    # -------------------------------------------------------------- the model
    def _refs(self, extra: tuple[list[int], ...] = ()) -> dict[int, int]:
        refs: dict[int, int] = {}
        tables = [t for o in self.owners for t in (o["seq"], o["cross"])]
        for p in (p for t in [*tables, *extra] for p in t):
            refs[p] = refs.get(p, 0) + 1
        return refs

    def _allocate(self, n: int) -> list[int]:
        short = n - len(self.pool.free)
        expected: set[bytes] = set()
        for k in sorted(self.evictable, key=self.evictable.__getitem__):
            if short <= 0:
                break
            expected.add(k)
            short -= len(self.cached[k][0])
        refs = self._refs()
        pages = self.pool.allocate(n)
        for k in expected:
            assert self._is_cached(k) is False, "the model's oldest entry was kept"
            del self.cached[k], self.evictable[k]
        for k in self.cached:
            assert self._is_cached(k), "a referenced entry, or a younger one, was evicted"
        for p in pages:
            assert p != NULL_PAGE and refs.get(p, 0) == 0, f"page {p} handed out while referenced"
            self.holds[p] = None
        return pages

    def _is_cached(self, k: bytes) -> bool:
        pages, kind, _ = self.cached[k]
        if kind == 0:
            return self.pool.probe_self([k])[0] == 1
        return self.pool.probe_cross(k) is not None

    def _release(self, tables: list[list[int]], held: tuple[list[int], ...] = ()) -> None:
        """Releases ``tables`` of an owner no longer in ``owners`` that still holds ``held``."""
        before = self._refs((*held, *tables))
        self.pool.release(tables)
        self.releases += 1
        after = self._refs(held)
        for k, (pages, kind, depth) in self.cached.items():
            if k in self.evictable:
                continue
            if all(after.get(p, 0) == 0 for p in pages) and any(before.get(p, 0) for p in pages):
                self.evictable[k] = (self.releases, kind, -depth, self.order)
                self.order += 1

    # -------------------------------------------------------------- rules
    @rule(symbols=st.lists(st.integers(0, 2), min_size=1, max_size=4),
          image=st.none() | st.integers(0, 2), extra=st.integers(0, 1))  # fmt: skip
    def admit(self, symbols: list[int], image: int | None, extra: int) -> None:
        """A request: full prompt pages from the cache where they match, the rest allocated
        (plus ``extra`` uncached pages), its cross group shared or allocated and cached."""
        keys = chain(symbols)
        hits, evictable_hits = self.pool.probe_self(keys)
        need = len(keys) - hits + extra
        ck = key("cross", image) if image is not None else None
        group = self.pool.probe_cross(ck) if ck else None
        cross_need = 0
        if ck and group is None:
            cross_need = 1 + image  # groups of 1..3 pages
        elif group is not None and group[1]:
            evictable_hits += group[0]
        if need + cross_need + evictable_hits > self.pool.num_free:
            return  # admission would wait
        got = self.pool.match_self(keys, len(keys) * B)
        assert len(got) == hits
        for k, p in zip(keys, got, strict=False):
            assert self.holds[p] == k, "a cache hit returned a page holding something else"
            self.evictable.pop(k, None)
        cross: list[int] = []
        if ck is not None:
            found = self.pool.match_cross(ck)
            if found is not None:
                assert all(self.holds[p] == ck for p in found)
                self.evictable.pop(ck, None)
                cross = found
            else:
                cross = self._allocate(cross_need)
                for p in cross:
                    self.holds[p] = ck
                assert self.pool.cache_cross(ck, cross)
                self.cached[ck] = (cross, 1, 0)
        fresh = self._allocate(need)
        for depth, (k, p) in enumerate(zip(keys[hits:], fresh, strict=False), start=hits):
            self.holds[p] = k
            assert self.pool.cache_self(k, p, depth) == (k not in self.cached)
            if k not in self.cached:
                self.cached[k] = ([p], 0, depth)
            else:
                self.holds[p] = None  # an uncached duplicate
        self.owners.append({"seq": got + fresh, "cross": cross})

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        """A sibling sharing the owner's pages."""
        o = self.owners[i % len(self.owners)]
        self.pool.incref(o["seq"] + o["cross"])
        self.owners.append({"seq": list(o["seq"]), "cross": list(o["cross"])})

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def decode_page(self, i: int) -> None:
        """An uncached page appended to a running sequence, when one can be had."""
        if self.pool.num_free:
            o = self.owners[i % len(self.owners)]
            o["seq"] += self._allocate(1)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100), together=st.booleans())
    def finish(self, i: int, together: bool) -> None:
        """A request ends (or is preempted): its tables in one release, or seq then cross."""
        o = self.owners.pop(i % len(self.owners))
        if together:
            self._release([o["seq"], o["cross"]])
        else:
            self._release([o["seq"]], held=(o["cross"],))
            self._release([o["cross"]])

    @rule(go=st.integers(0, 4))
    def reset(self, go: int) -> None:
        """Now and then, vLLM's prefix-cache reset."""
        if go == 0:
            self.pool.reset()
            self.cached.clear()
            self.evictable.clear()

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity([o["seq"] for o in self.owners] +
                                  [o["cross"] for o in self.owners])  # fmt: skip
        referenced = {p for o in self.owners for p in o["seq"] + o["cross"]}
        assert self.pool.num_free == self.pool.num_allocatable - len(referenced)
        assert self.pool.num_evictable == sum(len(self.cached[k][0]) for k in self.evictable)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_random_interleavings = PoolMachine.TestCase
