"""The page pool and block manager: allocation, sharing, freeing, integrity."""

from __future__ import annotations

import random

import pytest
import torch

from vllm.core.block_manager import NULL_PAGE, BlockManager, NoFreePages
from vllm.core.prefix_cache import CachingPagePool
from vllm.core.sequence import Request, Sequence
from vllm.multimodal.processing import ImageInputs, ProcessedInputs
from vllm.sampling_params import SamplingParams


def _request(rid: str, prompt_len: int, enc_tiles: int = 0, n: int = 1) -> Request:
    ids = [1] * prompt_len
    images = None
    if enc_tiles:
        ids[0] = 99
        images = ImageInputs(torch.zeros(1, 4, 3, 2, 2), torch.ones(1, dtype=torch.long),
                             [enc_tiles])
    from vllm.multimodal.cross_attention import image_runs, last_group

    inputs = ProcessedInputs(ids, images, image_runs(ids, 99), last_group(ids, 99),
                             tokens_per_tile=17)
    req = Request(rid, inputs, SamplingParams(n=n))
    req.seqs = [Sequence(0, req, 0, list(ids))]
    return req


def test_pool_basics() -> None:
    pool = CachingPagePool(5, 16)
    assert pool.num_free == 4 and pool.usage() == 0.0
    pages = pool.allocate(3)
    assert NULL_PAGE not in pages and len(set(pages)) == 3
    pool.incref(pages[:1])
    pool.decref(pages)
    assert pool.num_free == 3  # the shared page is still owned once
    pool.check_integrity([[pages[0]]])
    with pytest.raises(NoFreePages):
        pool.allocate(4)
    with pytest.raises(AssertionError):
        pool.check_integrity([])  # the remaining reference is a leak


def test_integrity_catches_double_ownership_and_double_free() -> None:
    pool = CachingPagePool(4, 16)
    (p,) = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity([[p], [p]])
    pool.decref([p])
    with pytest.raises(AssertionError):
        pool.decref([p])


def test_prefill_allocation_and_cross_pages() -> None:
    bm = BlockManager(64, block_size=16, cross_block_size=16)
    req = _request("a", 40, enc_tiles=2)  # 34 vision tokens -> 3 cross pages
    assert bm.pages_needed_for_prefill(req, req.seqs) == 3 + 3
    bm.allocate_prefill(req, req.seqs)
    assert len(req.seqs[0].block_table) == 3 and len(req.cross_block_table) == 3
    bm.check_integrity([req])
    bm.free_seq(req.seqs[0])
    bm.free_cross(req)
    bm.check_integrity([req])
    assert bm.pool.num_free == 63


def test_append_and_fork_share_full_pages() -> None:
    bm = BlockManager(64, block_size=4, cross_block_size=4)
    req = _request("a", 10, n=3)
    parent = req.seqs[0]
    bm.allocate_prefill(req, [parent])  # 3 pages: 4 + 4 + 2 tokens
    children = []
    for i in (1, 2):
        child = Sequence(i, req, i, list(parent.token_ids))
        new = bm.fork(parent, child)
        assert new is not None and child.block_table[:2] == parent.block_table[:2]
        assert child.block_table[2] != parent.block_table[2]
        children.append(child)
        req.seqs.append(child)
    assert bm.pool.ref[parent.block_table[0]] == 3
    bm.check_integrity([req])
    # Grow the parent past its page: a new page only when the next position needs it.
    parent.token_ids += [5, 5]
    assert not bm.needs_new_page(parent)
    parent.token_ids += [5]
    assert bm.needs_new_page(parent)
    bm.append_page(parent)
    bm.check_integrity([req])
    for s in req.seqs:
        bm.free_seq(s)
    bm.check_integrity([req])
    assert bm.pool.num_free == 63


def test_fork_at_page_boundary_copies_nothing() -> None:
    bm = BlockManager(16, block_size=4, cross_block_size=4)
    req = _request("a", 8, n=2)
    bm.allocate_prefill(req, req.seqs)
    child = Sequence(1, req, 1, list(req.seqs[0].token_ids))
    assert bm.fork(req.seqs[0], child) is None
    assert child.block_table == req.seqs[0].block_table


def test_random_operations_keep_integrity() -> None:
    rng = random.Random(0)
    bm = BlockManager(200, block_size=4, cross_block_size=8)
    live: list[Request] = []
    for step in range(600):
        op = rng.random()
        if op < 0.3:
            req = _request(str(step), rng.randint(1, 30), enc_tiles=rng.choice([0, 0, 1, 3]),
                           n=rng.choice([1, 1, 2, 4]))
            need = bm.pages_needed_for_prefill(req, req.seqs) + req.params.n - 1
            if need <= bm.pool.num_free:
                bm.allocate_prefill(req, req.seqs)
                for i in range(1, req.params.n):
                    child = Sequence(i, req, i, list(req.seqs[0].token_ids))
                    bm.fork(req.seqs[0], child)
                    req.seqs.append(child)
                live.append(req)
        elif op < 0.8 and live:
            seq = rng.choice(rng.choice(live).seqs)
            if seq.block_table:
                seq.token_ids.append(7)
                if bm.needs_new_page(seq):
                    if bm.pool.num_free == 0:
                        seq.token_ids.pop()
                        continue
                    bm.append_page(seq)
        elif live:
            req = live.pop(rng.randrange(len(live)))
            for s in req.seqs:
                bm.free_seq(s)
            bm.free_cross(req)
        bm.check_integrity(live)
    for req in live:
        for s in req.seqs:
            bm.free_seq(s)
        bm.free_cross(req)
    bm.check_integrity([])
    assert bm.pool.num_free == 199
