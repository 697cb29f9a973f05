"""Chunked and batched prefill under a token budget (tiny model, CPU): outputs equal those of
the prefill-first engine (``check_logprobs_close``) for text, image and mixed prompts,
including chunk boundaries inside a group of image tokens and an image after the first chunk;
prompt logprobs over chunks; preemption and abort mid-chunk; priority order."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from PIL import Image

from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def _image(seed: int, w: int = 100, h: int = 60) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _llm(**kw) -> LLM:
    args = dict(
        model="demo/mllama-tiny",
        max_model_len=256,
        max_num_seqs=8,
        limit_mm_per_prompt={"image": 2},
    )
    args.update(kw)
    return LLM(**args)


def _chunked(budget: int, **kw) -> LLM:
    return _llm(enable_chunked_prefill=True, max_num_batched_tokens=budget, **kw)


@pytest.fixture(scope="module")
def prefill_first() -> LLM:
    return _llm()  # the LLM class's default: whole prompts, images encoded in the prefill


def _prompts() -> list:
    return [
        "A text prompt " + "about many things " * 6,
        {
            "prompt": "<|image|><|begin_of_text|>The first image shows",
            "multi_modal_data": {"image": _image(1)},
        },
        # Two image groups, the second after some text: tokens see different images.
        {
            "prompt": "<|image|><|begin_of_text|>Left " + "word " * 9 + "<|image|> and right",
            "multi_modal_data": {"image": [_image(2), _image(3)]},
        },
        "Short one",
        # Text before its image: the image comes after the first chunks.
        {
            "prompt": "<|begin_of_text|>" + "Context words " * 8 + "<|image|>now describe",
            "multi_modal_data": {"image": _image(4, 40, 90)},
        },
    ]


def _same(ref: list, got: list, name: str) -> None:
    """check_logprobs_close, and on CPU (float32, only the order of sums differs) the
    sampled tokens' logprobs agree to 1e-3 up to any divergence: a chunk that attended to
    the wrong keys or images would move them far more."""
    check_logprobs_close(vllm_greedy(ref), vllm_greedy(got), "prefill-first", name)
    for a, b in zip(vllm_greedy(ref), vllm_greedy(got), strict=True):
        for t0, t1, lp0, lp1 in zip(a[0], b[0], a[1], b[1], strict=False):
            if t0 != t1:
                break
            assert abs(lp0[t0] - lp1[t1]) < 1e-3, (lp0, lp1)


def _image_positions(llm: LLM, prompt) -> list[int]:
    ids = llm.llm_engine.process_inputs(prompt).prompt_token_ids
    image = llm.llm_engine.config.model_config.spec.image_token_id
    return [i for i, t in enumerate(ids) if t == image]


@pytest.mark.parametrize("budget,encoder", [(8, 2), (13, 0), (64, 4)])
def test_chunked_and_batched_equal_prefill_first(
    prefill_first: LLM, budget: int, encoder: int
) -> None:
    """Every prompt over several steps (8, 13: boundaries fall at many places, image tokens
    included) or several prompts per step (64), images encoded over steps or inside the
    prefill; all at once, so the decode of some runs next to the chunks of others."""
    prompts = _prompts()
    ref = prefill_first.generate(prompts, GREEDY, use_tqdm=False)
    llm = _chunked(budget, encoder_layers_per_step=encoder)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    _same(ref, got, "chunked")
    stats = llm.llm_engine.runner.stats
    assert stats.prefill_chunks > 0
    assert (stats.images_encoded_ahead == 3) == (encoder > 0)
    assert stats.eager_decode_steps == 0
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.block_manager.pool.usage() == 0.0


def test_chunk_boundaries_inside_and_before_images(prefill_first: LLM) -> None:
    """One prompt alone (nothing else decides the chunks): with a budget equal to the
    position of the second image token + 1, the first chunk ends between the two image
    tokens of a group; with a budget smaller than the text before an image, the image comes
    after the first chunk."""
    group = {
        "prompt": "<|begin_of_text|>Two views " + "<|image|><|image|> of one scene",
        "multi_modal_data": {"image": [_image(5), _image(6)]},
    }
    late = _prompts()[4]
    first, second = _image_positions(prefill_first, group)
    assert second == first + 1
    (late_pos,) = _image_positions(prefill_first, late)
    for prompt, budget in ((group, second), (late, late_pos // 2)):
        assert budget >= 8  # the engine's budget must hold max_num_seqs decode tokens
        (ref,) = prefill_first.generate(prompt, GREEDY, use_tqdm=False)
        llm = _chunked(budget)
        (got,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        _same([ref], [got], "chunked")
        assert llm.llm_engine.runner.stats.prefill_chunks >= 1


def test_prompt_logprobs_over_chunks(prefill_first: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    prompt = _prompts()[2]
    (ref,) = prefill_first.generate(prompt, params, use_tqdm=False)
    (got,) = _chunked(8).generate(prompt, params, use_tqdm=False)
    assert len(got.prompt_logprobs) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
    for a, b in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
        if a is None:  # an image token's position
            assert b is None
            continue
        assert set(a) == set(b)
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank


def test_n_siblings_sample_from_the_last_chunk(prefill_first: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True)
    prompt = _prompts()[1]
    (ref,) = prefill_first.generate(prompt, params, use_tqdm=False)
    llm = _chunked(8)
    (got,) = llm.generate(prompt, params, use_tqdm=False)
    # Seeded sampling gives each sibling its own generator: the same tokens either way
    # (the tiny model's float32 logits agree closely enough for seeded draws here).
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert llm.llm_engine.block_manager.pool.usage() == 0.0


def _run(engine, limit: int = 400) -> dict:
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        assert steps < limit
        engine.check_integrity()
    return outs


@pytest.mark.parametrize("event", ["abort", "preempt"])
def test_abort_and_preempt_mid_chunk(prefill_first: LLM, event: str) -> None:
    """A request part-way through its chunks is aborted or preempted (as the scheduler does
    when a decode lacks pages: between steps), and so is, when aborting, one whose images
    are being encoded; the others finish as they would have, the preempted one too, and
    every page, decode row and prefill record comes back."""
    llm = _chunked(8, encoder_layers_per_step=2, async_scheduling=False)
    engine = llm.llm_engine
    prompts = _prompts()
    work = {"long": prompts[0], "img": prompts[2], "other": prompts[1]}
    engine.add_request("long", work["long"], GREEDY)
    engine.add_request("img", work["img"], GREEDY)
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    mid = [r for r in sched.running if any(sched.tracker.is_prefilling(s) for s in r.seqs)]
    assert [r.request_id for r in mid] == ["long"]
    assert sched.tracker.get(sched.requests["img"]) is not None  # being encoded
    if event == "abort":
        engine.abort_request(["long", "img"])
    else:
        sched.preempt(sched.requests["long"])
        assert sched.tracker.get(sched.requests["long"]) is None
    engine.add_request("other", work["other"], GREEDY)
    outs = _run(engine)
    order = ["other"] if event == "abort" else ["long", "img", "other"]
    assert set(outs) == set(order)
    ref = prefill_first.generate([work[r] for r in order], GREEDY, use_tqdm=False)
    _same(ref, [outs[r] for r in order], event)
    assert len(sched.tracker) == 0
    assert engine.block_manager.pool.usage() == 0.0
    assert len(engine.runner.rows.free_rows) == engine.runner.rows.max_rows


def test_priority_order() -> None:
    """--scheduling-policy priority: with room for one prompt per step (and nothing
    decoding to share it), prompts are admitted by priority, then arrival."""
    llm = _llm(scheduling_policy="priority", max_num_batched_tokens=256, max_num_seqs=1)
    engine = llm.llm_engine
    first_scheduled = []
    launch = engine.runner.launch

    def logged(out):
        first_scheduled.extend(c.seq.request.request_id for c in out.chunks if c.start == 0)
        return launch(out)

    engine.runner.launch = logged
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(
        [f"prompt number {i}" for i in range(5)], params, use_tqdm=False, priority=[3, 1, 2, 1, 0]
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 5
    assert first_scheduled == ["4", "1", "3", "2", "0"]  # LLM ids are the prompt indices


def test_priority_needs_the_policy() -> None:
    llm = _llm()
    with pytest.raises(ValueError, match="scheduling_policy"):
        llm.generate(["x"], GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority has 2 values"):
        _llm(scheduling_policy="priority").generate(["x"], GREEDY, priority=[1, 2], use_tqdm=False)


def test_flags_validated() -> None:
    with pytest.raises(ValueError, match="encoder_layers_per_step"):
        _llm(encoder_layers_per_step=-1)
    with pytest.raises(ValueError, match="at least the images per prompt"):
        _llm(encoder_layers_per_step=1)  # two images per prompt allowed
    with pytest.raises(ValueError, match="max_num_seqs"):
        _chunked(4)  # fewer than max_num_seqs decode tokens
    with pytest.raises(ValueError, match="chunked prefill"):
        _llm(max_num_batched_tokens=64)  # prompts whole: the budget must hold max_model_len
    with pytest.raises(ValueError, match="scheduling_policy"):
        _llm(scheduling_policy="lifo")


def test_defaults_by_usage() -> None:
    """The LLM class prefills first; the engine arguments' defaults (the server's) chunk."""
    from vllm.engine.arg_utils import (
        DEFAULT_CHUNKED_BATCHED_TOKENS,
        DEFAULT_ENCODER_LAYERS_PER_STEP,
        EngineArgs,
    )

    sc = _llm().llm_engine.config.scheduler_config
    assert (sc.enable_chunked_prefill, sc.encoder_layers_per_step) == (False, 0)
    assert sc.max_num_batched_tokens == 8192
    served = EngineArgs(model="demo/mllama-tiny", max_model_len=256).create_engine_config()
    sc = served.scheduler_config
    assert sc.enable_chunked_prefill and sc.scheduling_policy == "fcfs"
    assert sc.max_num_batched_tokens == DEFAULT_CHUNKED_BATCHED_TOKENS
    assert sc.encoder_layers_per_step == DEFAULT_ENCODER_LAYERS_PER_STEP


def test_constrained_decode_next_to_chunks(prefill_first: LLM) -> None:
    """A constrained request decodes (its sampling deferred until the previous step's tokens
    reach its matcher) in the same steps as another request's prefill chunks: the output
    matches its grammar, and the other request's equals prefill-first."""
    import re

    from vllm.sampling_params import GuidedDecodingParams

    llm = _chunked(12)
    engine = llm.llm_engine
    launch, deferred_with_chunks = engine.runner.launch, []

    def logged(out):
        handle = launch(out)
        deferred_with_chunks.append(handle.finish is not None and bool(out.chunks))
        return handle

    engine.runner.launch = logged
    guided = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=30,
        guided_decoding=GuidedDecodingParams(regex="[ab]{3,8}c"),
    )
    engine.add_request("g", "Constrained " + "word " * 10, guided)
    for _ in range(6):
        engine.step()
    late = "A long free prompt " + "x " * 40
    engine.add_request("f", late, GREEDY)
    outs = _run(engine)
    assert re.fullmatch("[ab]{3,8}c", outs["g"].outputs[0].text)
    assert any(deferred_with_chunks)
    _same(prefill_first.generate([late], GREEDY, use_tqdm=False), [outs["f"]], "next to guided")
