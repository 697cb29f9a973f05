"""Scheduler properties under random workloads (hypothesis), with the model replaced by a
host simulation of what the runner does with a step.

Every step stays within the token and encoder budgets; every request that is not aborted
finishes; no ready request is overtaken by later ones in more than ``MAX_SKIPPED_STEPS``
steps (the admission-order rule); pages balance after random aborts and preemptions at any
point of a chunked or batched prefill."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm import SamplingParams
from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.scheduler import MAX_SKIPPED_STEPS, RequestTooLarge, Scheduler
from vllm.core.scheduler_output import SchedulerOutput
from vllm.core.sequence import Request, SequenceStatus
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ImageInputs, ProcessedInputs

IMAGE, TOKENS_PER_TILE, TILES, LAYERS_PER_IMAGE = 999, 6, 2, 5
MAX_LEN = 96


def _inputs(prompt_len: int, image_at: list[int]) -> ProcessedInputs:
    ids = [1] * prompt_len
    for p in image_at:
        ids[min(p, prompt_len - 1)] = IMAGE
    n = ids.count(IMAGE)
    images = None
    if n:
        images = ImageInputs(
            torch.zeros(n, TILES, 1, 1, 1), torch.ones(n, dtype=torch.int64), [TILES] * n
        )
    return ProcessedInputs(
        ids,
        images,
        image_runs(ids, IMAGE),
        last_group(ids, IMAGE),
        tokens_per_tile=TOKENS_PER_TILE,
        image_token_id=IMAGE,
    )


request_spec = st.tuples(
    st.integers(1, 60),  # prompt length
    st.lists(st.integers(0, 59), max_size=2),  # image token positions
    st.integers(1, 12),  # max_tokens
    st.sampled_from([1, 1, 1, 2]),  # n
    st.integers(0, 2),  # priority
    st.integers(0, 6),  # arrival step
)
event = st.tuples(st.sampled_from(["abort", "preempt", "none", "none"]), st.integers(0, 1000))


class Sim:
    """The scheduler with a host stand-in for the runner (tokens, encoder layers)."""

    def __init__(self, config: SchedulerConfig, num_pages: int, layer_tokens: int = 0) -> None:
        self.config = config
        self.layer_tokens = layer_tokens
        self.bm = BlockManager(num_pages, 4, 8)
        self.sched = Scheduler(config, self.bm, TILES, LAYERS_PER_IMAGE, layer_tokens)
        self.encoder_done: dict[str, int] = {}
        self.overtaken: dict[str, int] = {}
        self.admitted: list[str] = []
        self.finished: list[str] = []

    def check_step(
        self, out: SchedulerOutput, waiting_before: list[Request], ready_before: set[str]
    ) -> None:
        c = self.config
        assert out.num_tokens <= c.max_num_batched_tokens
        # The encoder's own share, plus what the token budget left at its cost in tokens.
        layers = c.encoder_layers_per_step
        if layers and self.layer_tokens:
            layers += (c.max_num_batched_tokens - out.num_tokens) // self.layer_tokens
        assert sum(w.layers for w in out.encoder_work) <= layers
        for chunk in out.chunks:
            assert 0 <= chunk.start < chunk.end <= len(chunk.seq)
            if not c.enable_chunked_prefill:
                assert chunk.start == 0 and chunk.end == len(chunk.seq)
        # Tiles of the images whose vision tokens this step carries.
        carried = {
            ch.seq.request.request_id: ch.seq.request.inputs.num_images * TILES
            for ch in out.chunks
            if ch.seq.request.inputs.sees_images(ch.start, ch.end)
        }
        assert sum(carried.values()) <= c.max_num_encoder_tiles
        decoding = {id(s) for s in out.decode_seqs}
        assert not any(id(ch.seq) in decoding for ch in out.chunks)
        # The admission-order rule: a ready waiting request overtaken by a later one in
        # more than MAX_SKIPPED_STEPS steps is a failure.
        new = [
            r
            for r in waiting_before
            if r not in self.sched.waiting
            and r not in out.preempted
            and r.request_id in self.sched.requests
        ]
        self.admitted += [r.request_id for r in new]
        if new:
            last = max(waiting_before.index(r) for r in new)
            for r in waiting_before[:last]:
                if r in self.sched.waiting and r.request_id in ready_before:
                    self.overtaken[r.request_id] = self.overtaken.get(r.request_id, 0) + 1
                    assert self.overtaken[r.request_id] <= MAX_SKIPPED_STEPS

    def ready(self) -> set[str]:
        """Waiting requests that could be admitted now but for what the step has left."""
        out = set()
        for r in self.sched.waiting:
            p = self.sched.tracker.get(r)
            if not (r.has_images and self.config.encoder_layers_per_step) or (p and p.encoded):
                out.add(r.request_id)
        return out

    def run(self, out: SchedulerOutput) -> None:
        for w in out.encoder_work:
            rid = w.progress.request.request_id
            self.encoder_done[rid] = self.encoder_done.get(rid, 0) + w.layers
            total = w.progress.request.inputs.num_images * LAYERS_PER_IMAGE
            if self.encoder_done[rid] >= total:
                w.progress.finish_encoding("vision")
                del self.encoder_done[rid]
            else:
                w.progress.hold_encoder("encoder", total - self.encoder_done[rid])
        for seq in out.sample_seqs:
            if seq.status.finished:
                continue
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.request.params.max_tokens or len(seq) >= MAX_LEN:
                self.sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH_CAPPED)
        self.finished += [r.request_id for r in self.sched.release_finished()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=10),
    events=st.lists(event, max_size=30),
    chunked=st.booleans(),
    budget=st.sampled_from([8, 13, 32, 64]),
    encoder=st.sampled_from([0, 2, 3, 7]),
    pages=st.integers(30, 60),
    policy=st.sampled_from(["fcfs", "priority"]),
    layer_tokens=st.sampled_from([0, 1, 3, 27]),
)
@example(  # a higher priority arriving while two others are encoded ahead (was a deadlock)
    specs=[(1, [0], 1, 1, 0, 2), (1, [0], 1, 1, 1, 1), (1, [0], 1, 1, 2, 0)],
    events=[],
    chunked=False,
    budget=8,
    encoder=2,
    pages=30,
    policy="priority",
    layer_tokens=0,
)
def test_scheduler_properties(
    specs, events, chunked, budget, encoder, pages, policy, layer_tokens
) -> None:
    if not chunked:
        budget = MAX_LEN  # whole sequences must fit (the engine arguments enforce it)
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        max_num_encoder_tiles=2 * TILES,
        enable_chunked_prefill=chunked,
        encoder_layers_per_step=encoder,
        scheduling_policy=policy,
    )
    sim = Sim(config, pages, layer_tokens)
    sched = sim.sched
    pending = sorted(enumerate(specs), key=lambda x: x[1][5])
    aborted: set[str] = set()
    step = 0
    events = list(events)
    while pending or sched.has_unfinished():
        while pending and pending[0][1][5] <= step:
            i, (plen, imgs, max_tokens, n, prio, _) = pending.pop(0)
            req = Request(
                str(i),
                _inputs(plen, imgs),
                SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                arrival_time=float(step),
                priority=prio if policy == "priority" else 0,
            )
            try:
                sched.add_request(req)
            except RequestTooLarge:
                aborted.add(req.request_id)  # refused at the door: never scheduled
        kind, pick = events.pop(0) if events else ("none", 0)
        ids = sorted(sched.requests)
        if kind == "abort" and ids:
            rid = ids[pick % len(ids)]
            sched.abort(rid)
            aborted.add(rid)
        elif kind == "preempt" and sched.running:
            sched.preempt(sched.running[pick % len(sched.running)])
        waiting_before, ready_before = list(sched.waiting), sim.ready()
        out = sched.schedule()
        if out is not None:
            sim.check_step(out, waiting_before, ready_before)
            sim.run(out)
        sched.check_integrity()
        step += 1
        assert step < 2000, "a request starved"
    # Everything not aborted finished, and every page came back.
    assert not sched.requests and len(sched.tracker) == 0
    assert sim.bm.pool.num_free == sim.bm.pool.num_allocatable
    assert set(sim.admitted) >= set(sim.finished)
    assert set(sim.finished) | aborted == {str(i) for i in range(len(specs))}


def test_priority_then_arrival_order() -> None:
    """Under the priority policy, admission follows (priority, arrival); under fcfs, arrival."""
    for policy, expected in (("priority", ["2", "0", "3", "1"]), ("fcfs", ["0", "1", "2", "3"])):
        config = SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, scheduling_policy=policy
        )
        sim = Sim(config, 40)
        for i, prio in enumerate([1, 2, 0, 1]):
            sim.sched.add_request(
                Request(
                    str(i),
                    _inputs(10, []),
                    SamplingParams(max_tokens=2, ignore_eos=True),
                    arrival_time=float(i),
                    priority=prio if policy == "priority" else 0,
                )
            )
        order = []
        while sim.sched.has_unfinished():
            out = sim.sched.schedule()
            assert out is not None
            order += [c.seq.request.request_id for c in out.chunks if c.start == 0]
            sim.run(out)
        assert order == expected, policy


def test_a_large_prompt_is_not_overtaken_forever() -> None:
    """Without chunking, a prompt that does not fit next to the decode lets smaller ones go
    first for MAX_SKIPPED_STEPS steps, then gets a step with no decode in it."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
    sim = Sim(config, 200)
    sched = sim.sched
    sched.add_request(
        Request("run", _inputs(8, []), SamplingParams(max_tokens=80, ignore_eos=True), 0.0)
    )
    sim.run(sched.schedule())  # "run" decodes from now on
    sched.add_request(Request("big", _inputs(64, []), SamplingParams(max_tokens=2), 1.0))
    for i in range(12):
        sched.add_request(Request(f"s{i}", _inputs(4, []), SamplingParams(max_tokens=1), 2.0))
    first = None
    for step in range(20):
        out = sched.schedule()
        if any(c.seq.request.request_id == "big" for c in out.chunks):
            first = step
            assert not out.decode_seqs  # the decode gave way for one step
            break
        sim.run(out)
    assert first == MAX_SKIPPED_STEPS
    assert dataclasses.asdict(config)["enable_chunked_prefill"] is False


def test_overtaking_stops_after_the_bound() -> None:
    """A prompt short of pages lets smaller ones go first in MAX_SKIPPED_STEPS steps, then
    nothing behind it is admitted until it is (pages free as the running request ends)."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, enable_chunked_prefill=True
    )
    sim = Sim(config, 25)  # 24 pages of 4 tokens
    sched = sim.sched
    sched.add_request(
        Request("run", _inputs(40, []), SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    )
    sim.run(sched.schedule())  # "run" holds 10 pages and decodes
    sched.add_request(Request("big", _inputs(60, []), SamplingParams(max_tokens=2), 1.0))
    for i in range(30):
        sched.add_request(Request(f"s{i}", _inputs(4, []), SamplingParams(max_tokens=1), 2.0))
    overtaking_steps, big_at = 0, None
    for step in range(60):
        out = sched.schedule()
        admitted = [c.seq.request.request_id for c in out.chunks if c.start == 0]
        if "big" in admitted:
            big_at = step
            break
        overtaking_steps += bool(admitted)
        sim.run(out)
    assert overtaking_steps == MAX_SKIPPED_STEPS
    assert big_at is not None and big_at > MAX_SKIPPED_STEPS  # it waited for "run"'s pages


def test_the_budget_left_goes_to_the_encoder() -> None:
    """An image waits alone: its step runs the encoder's own 2 layers plus what the 32-token
    budget leaves at 4 tokens a layer; next to a prompt that fills the budget, only its own 2."""
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=MAX_LEN,
        max_num_encoder_tiles=4 * TILES,
        enable_chunked_prefill=True,
        encoder_layers_per_step=2,
    )
    images = 4  # 4 images of LAYERS_PER_IMAGE layers: more than one step can take
    for prompt, expected in ((0, 2 + 32 // 4), (40, 2)):
        sim = Sim(config, 60, layer_tokens=4)
        if prompt:
            sim.sched.add_request(Request("text", _inputs(prompt, []), SamplingParams(), 0.0))
        sim.sched.add_request(
            Request("img", _inputs(8, list(range(images))), SamplingParams(), 1.0)
        )
        out = sim.sched.schedule()
        assert out.num_tokens == min(prompt, 32)
        assert [w.layers for w in out.encoder_work] == [expected]


def test_encoder_layer_tokens_counts_the_flops() -> None:
    """One encoder layer over an image against one prefill token, both by FLOPs: by hand for
    a small shape, and the 90B text model makes an image-layer worth fewer tokens than 11B's."""
    from vllm.core.scheduler import encoder_layer_tokens
    from vllm.transformers_utils.config import parse_mllama_config
    from vllm.transformers_utils.demo_checkpoints import build_demo_config

    text = dataclasses.make_dataclass(
        "T",
        [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
        ],
    )(8, 16, 2, 2, 2)
    vision = dataclasses.make_dataclass(
        "V", ["max_num_tiles", "tokens_per_tile", "hidden_size", "intermediate_size"]
    )(2, 5, 4, 8)
    # Vision: 10 tokens x 2 x (4*16 + 2*32) weights + 4 * 10 * 10 * 4 for attention = 4160.
    # Text token: 2 x 2 layers x (2*64 + 2*8*4 + 3*128) = 2304; 4160 / 2304 rounds up to 2.
    assert encoder_layer_tokens(text, vision) == 2
    small, large = (
        encoder_layer_tokens(spec.text, spec.vision)
        for spec in (
            parse_mllama_config(build_demo_config(f"demo/mllama-{size}")) for size in ("11b", "90b")
        )
    )
    assert large < small
