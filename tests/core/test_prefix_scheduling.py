"""Prefix caching in the scheduler under random multi-turn workloads (hypothesis), with the
model replaced by a host simulation that tracks what every KV slot holds.

Each slot a step writes records the content its K/V depends on: the tokens up to and
including its position, the images those tokens introduced, and the salt. Whenever a step
reads a sequence's earlier positions (a chunk's context, a decode's history) every slot must
hold exactly what that sequence would have written there itself: a page shared across
requests with other tokens, other images or another salt, a page freed while still read, or
an evicted page handed back as a hit all fail it. The pool's integrity check runs after every
step, through random aborts, preemptions and evictions (a small pool)."""

from __future__ import annotations

import hashlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm import SamplingParams
from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.prefix_keys import images_seen
from vllm.core.scheduler import RequestTooLarge, Scheduler
from vllm.core.scheduler_output import SchedulerOutput
from vllm.core.sequence import Request, Sequence, SequenceStatus
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ImageInputs, ProcessedInputs

IMAGE, TOKENS_PER_TILE, TILES, BLOCK = 999, 3, 1, 4
MAX_LEN = 128


def _inputs(ids: list[int], images: list[int], salt: str | None) -> ProcessedInputs:
    n = ids.count(IMAGE)
    assert n == len(images)
    inputs = None
    if n:
        digests = [hashlib.sha256(f"image{i}".encode()).digest() for i in images]
        inputs = ImageInputs(
            torch.zeros(n, TILES, 1, 1, 1),
            torch.ones(n, dtype=torch.int64),
            [TILES] * n,
            digests=digests,
        )
    return ProcessedInputs(
        list(ids),
        inputs,
        image_runs(ids, IMAGE),
        last_group(ids, IMAGE),
        tokens_per_tile=TOKENS_PER_TILE,
        image_token_id=IMAGE,
        cache_salt=salt,
    )


def _cross_content(req: Request) -> tuple:
    """What a request's cross pages hold: its last group's images and the salt."""
    first, end = req.inputs.last_group
    return (tuple(req.inputs.images.digests[first:end]), req.inputs.cache_salt)


def _content(seq: Sequence, pos: int) -> tuple:
    """What the K/V of ``seq`` at ``pos`` depends on."""
    inputs = seq.request.inputs
    ids = seq.token_ids[: pos + 1]
    n_images = sum(1 for t in ids[: seq.prompt_len] if t == IMAGE)
    digests = tuple(inputs.images.digests[:n_images]) if n_images else ()
    return (tuple(ids), digests, inputs.cache_salt)


class KVSim:
    def __init__(self, config: SchedulerConfig, num_pages: int) -> None:
        self.bm = BlockManager(num_pages, BLOCK, 8, enable_prefix_caching=True)
        self.sched = Scheduler(config, self.bm, TILES, 1)
        self.slots: dict[tuple[int, int], tuple] = {}
        self.outputs: dict[str, list[int]] = {}
        self.computed = 0
        self.vision_skipped = 0

    def _read(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            page = seq.block_table[pos // BLOCK]
            got = self.slots.get((page, pos % BLOCK))
            assert got == _content(seq, pos), (seq.request.request_id, pos, page)

    def _write(self, seq: Sequence, pos: int) -> None:
        self.slots[(seq.block_table[pos // BLOCK], pos % BLOCK)] = _content(seq, pos)

    def _read_cross(self, req: Request) -> None:
        assert req.cross_written and req.cross_block_table
        for page in req.cross_block_table:
            assert self.slots.get((page, "cross")) == _cross_content(req), req.request_id

    def run(self, out: SchedulerOutput, token: int) -> None:
        written, cross = [], []
        for s in out.decode_seqs:
            self._read(s, len(s) - 1)
            self._write(s, len(s) - 1)
            if s.request.has_images:
                self._read_cross(s.request)
            written.append((s, len(s)))
        for c in out.chunks:
            req = c.seq.request
            if req.has_images and req.inputs.sees_images(c.start, c.end):
                if req.cross_cached:
                    # No vision: its tokens may see nothing but the cached last group.
                    lo, hi = images_seen(req.inputs.runs, c.start, c.end)
                    assert hi == lo or lo >= req.inputs.last_group[0], req.request_id
                    self.vision_skipped += 1
                elif not req.cross_written:
                    for page in req.cross_block_table:
                        self.slots[(page, "cross")] = _cross_content(req)
                    req.cross_written = True
                    cross.append((req, list(req.cross_block_table)))
                self._read_cross(req)
            self._read(c.seq, c.start)
            for pos in range(c.start, c.end):
                self._write(c.seq, pos)
            self.computed += c.end - c.start
            written.append((c.seq, c.end))
        for src, dst in out.page_copies:
            for off in range(BLOCK):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
        self.sched.cache_written(written, cross)
        for seq in out.sample_seqs:
            if seq.status.finished:
                continue
            seq.token_ids.append(token)
            if seq.num_output_tokens >= seq.request.params.max_tokens or len(seq) >= MAX_LEN:
                self.sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH_CAPPED)
        for r in self.sched.release_finished():
            self.outputs[r.request_id] = r.seqs[0].output_token_ids


conversation = st.tuples(
    st.lists(st.sampled_from([1, 2, IMAGE]), min_size=1, max_size=24),  # first prompt
    st.lists(st.sampled_from([0, 1, 2]), min_size=3, max_size=3),  # its image choices
    st.sampled_from([None, None, "a", "b"]),  # cache_salt
    st.integers(1, 3),  # turns
    st.integers(1, 6),  # max_tokens per turn
    st.sampled_from([1, 1, 1, 2]),  # n
)
event = st.tuples(
    st.sampled_from(["abort", "preempt", "none", "none", "none"]), st.integers(0, 1000)
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=6),
    events=st.lists(event, max_size=40),
    chunked=st.booleans(),
    budget=st.sampled_from([6, 16, 48]),
    pages=st.integers(40, 90),
    keyed=st.lists(st.booleans(), min_size=1),
)
def test_cached_pages_hold_what_the_reader_would_write(
    convs, events, chunked, budget, pages, keyed
) -> None:
    """``keyed`` picks the requests whose prompt keys come made with their inputs
    (``BlockManager.key_prompt``, as the engine's input processing makes them) rather than at
    admission."""
    if not chunked:
        budget = MAX_LEN
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        max_num_encoder_tiles=3 * TILES,
        enable_chunked_prefill=chunked,
    )
    sim = KVSim(config, pages)
    sched = sim.sched
    # Per conversation: (next turn, prompt so far, image choices, the live request id).
    state = {}
    for i, (ids, imgs, *_) in enumerate(convs):
        ids = ids[: MAX_LEN // 4]
        ids = [t for k, t in enumerate(ids) if t != IMAGE or ids[:k].count(IMAGE) < 3]
        images = imgs[: ids.count(IMAGE)]
        state[i] = [0, ids, images, None]
    events = list(events)
    step = 0
    while True:
        for i, (_, _, salt, turns, max_tokens, n) in enumerate(convs):
            turn, ids, images, live = state[i]
            if live is not None and live in sched.requests:
                continue
            if live is not None and live in sim.outputs:  # the next turn resends it all
                ids = ids + sim.outputs[live] + [1 + (turn % 2)] * (turn + 1)
            if turn >= turns or len(ids) + max_tokens >= MAX_LEN:
                state[i][3] = None
                continue
            rid = f"{i}.{turn}"
            inputs = _inputs(ids, images, salt)
            if keyed[(i + turn) % len(keyed)]:
                inputs = sim.bm.key_prompt(inputs)
            req = Request(
                rid,
                inputs,
                SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                arrival_time=float(step),
            )
            try:
                sched.add_request(req)
            except RequestTooLarge:
                state[i] = [turns, ids, images, None]
                continue
            state[i] = [turn + 1, ids, images, rid]
        if not sched.has_unfinished():
            break
        kind, pick = events.pop(0) if events else ("none", 0)
        ids = sorted(sched.requests)
        if kind == "abort" and ids:
            sched.abort(ids[pick % len(ids)])
        elif kind == "preempt" and sched.running:
            sched.preempt(sched.running[pick % len(sched.running)])
        out = sched.schedule()
        if out is not None:
            sim.run(out, token=1 + step % 2)
        sched.check_integrity()
        step += 1
        assert step < 3000, "a request starved"
    assert sim.bm.pool.num_free == sim.bm.pool.num_allocatable
    sim.bm.pool.check_integrity([])


def test_second_turn_computes_only_its_new_tokens() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN)
    sim = KVSim(config, 64)
    first = [IMAGE, 1, 2, 1, 1, 2, 2, 1, 2, 1]
    sim.sched.add_request(
        Request("t1", _inputs(first, [0], None), SamplingParams(max_tokens=6, ignore_eos=True))
    )
    while sim.sched.has_unfinished():
        sim.run(sim.sched.schedule(), token=2)
    second = first + sim.outputs["t1"] + [1, 1, 2]
    # Turn 1 wrote the K/V of every token but its last output: 15 of its 16, so 3 full
    # pages (the 4th lacks its last slot and must not be shared).
    written = len(first) + 6 - 1
    sim.computed = 0
    hits0 = sim.bm.pool.prefix_cache_hits
    sim.sched.add_request(
        Request("t2", _inputs(second, [0], None), SamplingParams(max_tokens=1, ignore_eos=True))
    )
    while sim.sched.has_unfinished():
        sim.run(sim.sched.schedule(), token=2)
    cached = written // BLOCK * BLOCK
    assert sim.bm.pool.prefix_cache_hits - hits0 == cached
    assert sim.computed == len(second) - cached
    assert sim.vision_skipped == 1  # its cross group was shared
    # The same tokens with another image, or another salt: nothing is shared.
    for rid, image, salt in (("other-image", 1, None), ("other-salt", 0, "tenant")):
        sim.computed = 0
        sim.sched.add_request(
            Request(
                rid, _inputs(second, [image], salt), SamplingParams(max_tokens=1, ignore_eos=True)
            )
        )
        while sim.sched.has_unfinished():
            sim.run(sim.sched.schedule(), token=2)
        assert sim.computed == len(second), rid
    sim.bm.pool.check_integrity([])


def test_prompt_keys_made_with_the_inputs_are_the_admission_keys() -> None:
    """Keys made when the inputs are processed equal those admission would make, and
    admission makes none for the prompt's pages then; each sequence (n > 1 siblings) extends
    its own copy."""
    from vllm.core import prefix_keys

    bm = BlockManager(64, BLOCK, 8, enable_prefix_caching=True)
    ids = [5, IMAGE, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(max_tokens=2, n=2, temperature=1)

    def seq(request: Request, i: int) -> Sequence:
        return Sequence(i, request, i, list(ids))

    lazy = Request("a", _inputs(ids, [0], "s"), params)
    made = bm.key_prompt(_inputs(ids, [0], "s"))
    assert made.page_chain is not None and len(made.page_chain.keys) == len(ids) // BLOCK
    eager = Request("b", made, params)
    calls = []
    original = prefix_keys.page_key
    prefix_keys.page_key = lambda *a: calls.append(1) or original(*a)
    try:
        first, second = seq(eager, 0), seq(eager, 1)
        keys = bm._lookup_keys(first)
        bm._lookup_keys(second)
        assert calls == []  # nothing hashed at admission
        first.page_keys.update(ids + [1] * BLOCK)  # an output page, on one sibling only
        assert len(calls) == 1
        assert len(second.page_keys.keys) == len(made.page_chain.keys) == len(ids) // BLOCK
    finally:
        prefix_keys.page_key = original
    assert keys and keys == bm._lookup_keys(seq(lazy, 2))
    off = BlockManager(64, BLOCK, 8, enable_prefix_caching=False)
    assert off.key_prompt(_inputs(ids, [0], None)).page_chain is None
