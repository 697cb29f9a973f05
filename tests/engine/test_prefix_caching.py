"""Prefix caching in the engine (tiny model, CPU): multi-turn chats whose next turn resends
the whole conversation give the outputs of an engine without caching
(``check_logprobs_close``), while the model computes only the tokens past the cached pages;
images with the same token ids, or another salt, share nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.spies import PrefillTokens
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.model_executor.models.mllama_vision import ImagesEncoding
from vllm.worker import model_runner

GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3)
BLOCK = 16


def _image(seed: int, w: int = 100, h: int = 60) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _llm(**kw) -> LLM:
    args = dict(
        model="demo/mllama-tiny",
        dtype="float32",  # the logprob tolerance below is float32's, on CUDA too
        max_model_len=256,
        max_num_seqs=8,
        limit_mm_per_prompt={"image": 2},
        block_size=BLOCK,
    )
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm()


@pytest.fixture(scope="module")
def cached() -> LLM:
    return _llm(enable_prefix_caching=True)


def _same(ref: list, got: list, name: str) -> None:
    check_logprobs_close(vllm_greedy(ref), vllm_greedy(got), "no caching", name)
    for a, b in zip(vllm_greedy(ref), vllm_greedy(got), strict=True):
        for t0, t1, lp0, lp1 in zip(a[0], b[0], a[1], b[1], strict=False):
            if t0 != t1:
                break
            assert abs(lp0[t0] - lp1[t1]) < 1e-3, (lp0, lp1)


class _VisionImages:
    """Counts the images the vision tower encodes: inside a prefill step (its forward, or on
    CUDA a replay of a vision graph, one image each) or ahead of it, over several steps
    (``ImagesEncoding``)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = llm.llm_engine.runner
        vision = runner.model.vision_model
        self.images = 0
        graphs = runner.vision_graphs
        if graphs is not None:
            replay = graphs._replay

            def replayed(num_tiles):
                self.images += 1
                return replay(num_tiles)

            monkeypatch.setattr(graphs, "_replay", replayed)
        forward = vision.forward

        def spy(pixel_values, *args, **kwargs):
            self.images += pixel_values.shape[0]
            return forward(pixel_values, *args, **kwargs)

        def encoding(model, pixel_values, *args, **kwargs):
            self.images += pixel_values.shape[0]
            return ImagesEncoding(model, pixel_values, *args, **kwargs)

        monkeypatch.setattr(vision, "forward", spy)
        monkeypatch.setattr(model_runner, "ImagesEncoding", encoding)


def _conversations() -> list[dict]:
    return [
        {"prompt": "A text chat " + "about many things " * 5},
        {
            "prompt": "<|image|><|begin_of_text|>The first image shows " + "a cat " * 6,
            "multi_modal_data": {"image": _image(1)},
        },
        {
            "prompt": "<|image|><|begin_of_text|>Left " + "word " * 9 + "<|image|> and right",
            "multi_modal_data": {"image": [_image(2), _image(3)]},
        },
        {
            "prompt": "<|begin_of_text|>" + "Context words " * 8 + "<|image|>now describe",
            "multi_modal_data": {"image": _image(4, 40, 90)},
        },
    ]


def _as_ids(llm: LLM, prompt: dict, ids: list[int] | None = None) -> dict:
    out = {k: v for k, v in prompt.items() if k != "prompt"}
    out["prompt_token_ids"] = (
        ids if ids is not None else llm.llm_engine.process_inputs(prompt).prompt_token_ids
    )
    return out


@pytest.mark.parametrize("chunked", [False, True])
def test_second_turn_equals_no_caching_and_computes_only_new_tokens(
    plain: LLM, monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    llm = (
        _llm(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=24,
            encoder_layers_per_step=2,
        )
        if chunked
        else _llm(enable_prefix_caching=True)
    )
    engine = llm.llm_engine
    pool = engine.block_manager.pool
    first = [_as_ids(llm, p) for p in _conversations()]
    vision = _VisionImages(llm, monkeypatch)
    out1 = llm.generate(first, GREEDY, use_tqdm=False)
    assert vision.images == 4  # the spy sees this engine's encodings
    _same(plain.generate(first, GREEDY, use_tqdm=False), out1, "turn 1")
    new = engine.process_inputs("and then what happened next?").prompt_token_ids[1:]
    second = [
        _as_ids(llm, p, p["prompt_token_ids"] + list(o.outputs[0].token_ids) + new)
        for p, o in zip(first, out1, strict=True)
    ]
    spy = PrefillTokens(llm, monkeypatch)
    vision.images = 0
    cross_hits = pool.cross_cache_hits
    queries, hits = pool.prefix_cache_queries, pool.prefix_cache_hits
    out2 = []
    expected_computed = expected_hits = 0
    for p1, p2 in zip(first, second, strict=True):
        # Turn 1 wrote the K/V of all its tokens but the last output; full pages of those
        # are cached, and the last prompt token of turn 2 is always computed.
        written = len(p1["prompt_token_ids"]) + GREEDY.max_tokens - 1
        n2 = len(p2["prompt_token_ids"])
        pages = min(written // BLOCK, (n2 - 1) // BLOCK)
        assert pages > 0
        expected_hits += pages * BLOCK
        expected_computed += n2 - pages * BLOCK
        out2 += llm.generate([p2], GREEDY, use_tqdm=False)  # one at a time: own hits only
    assert pool.prefix_cache_hits - hits == expected_hits
    assert pool.prefix_cache_queries - queries == sum(len(p["prompt_token_ids"]) for p in second)
    assert spy.tokens == expected_computed
    # Every turn-2 image request found its cross group: no image was encoded again (the
    # two-group chat too: its first group is seen only by cached tokens).
    assert vision.images == 0
    assert pool.cross_cache_hits - cross_hits == 3
    _same(plain.generate(second, GREEDY, use_tqdm=False), out2, "turn 2")
    engine.check_integrity()
    assert pool.usage() == 0.0  # cached pages count as free


def test_same_ids_other_image_or_salt_share_nothing(
    plain: LLM, cached: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = cached.llm_engine
    pool = engine.block_manager.pool
    base = {
        "prompt": "<|image|><|begin_of_text|>Describe " + "this picture " * 8,
        "multi_modal_data": {"image": _image(5)},
    }
    ids = engine.process_inputs(base).prompt_token_ids
    assert len(ids) > 2 * BLOCK
    a = {"prompt_token_ids": ids, "multi_modal_data": {"image": _image(5)}}
    cached.generate([a], GREEDY, use_tqdm=False)
    variants = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": _image(6)}},  # other image
        {"prompt_token_ids": ids, "multi_modal_data": {"image": _image(5, 101, 60)}},
        {**a, "cache_salt": "tenant-b"},
    ]
    for v in variants:
        hits = pool.prefix_cache_hits
        got = cached.generate([v], GREEDY, use_tqdm=False)
        assert pool.prefix_cache_hits == hits, v
        _same(plain.generate([v], GREEDY, use_tqdm=False), got, "variant")
    # The same image again does hit (the test above is not vacuous).
    hits = pool.prefix_cache_hits
    cached.generate([a], GREEDY, use_tqdm=False)
    assert pool.prefix_cache_hits - hits == (len(ids) - 1) // BLOCK * BLOCK
    engine.check_integrity()


def test_prompt_logprobs_requests_compute_every_token(plain: LLM, cached: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    prompt = "Prompt logprobs " * 12
    cached.generate([prompt], params, use_tqdm=False)
    pool = cached.llm_engine.block_manager.pool
    hits = pool.prefix_cache_hits
    got = cached.generate([prompt], params, use_tqdm=False)[0]
    ref = plain.generate([prompt], params, use_tqdm=False)[0]
    assert pool.prefix_cache_hits == hits
    assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()


def test_on_for_the_server_off_for_llm_by_default(plain: LLM) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.cli_args import FlexibleArgumentParser
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    def caching(flags: list[str]) -> bool:
        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(["--model", "demo/mllama-tiny", *flags])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        return config.scheduler_config.enable_prefix_caching

    assert caching([]) is True
    assert caching(["--no-enable-prefix-caching"]) is False
    assert caching(["--enable-prefix-caching"]) is True
    assert plain.llm_engine.config.scheduler_config.enable_prefix_caching is False


def _cross_rows(engine, pages: list[int]) -> list[tuple]:
    _, crosses = engine.runner.model.attention_layers()
    return [(a.kv_cache[0][pages].clone(), a.kv_cache[1][pages].clone()) for a in crosses]


def test_a_reused_cross_group_is_bitwise_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other text, the same image: the second request reads the first one's cross pages
    (no vision) and its outputs equal a fresh encoding's; those pages hold bitwise what a
    fresh encoding (another salt) writes."""
    llm = _llm(enable_prefix_caching=True)
    engine = llm.llm_engine
    pool = engine.block_manager.pool
    image = _image(7)
    one = {"prompt": "<|image|><|begin_of_text|>One", "multi_modal_data": {"image": image}}
    other = {
        "prompt": "<|image|><|begin_of_text|>Another text " + "entirely " * 5,
        "multi_modal_data": {"image": image},
    }
    llm.generate([one], GREEDY, use_tqdm=False)
    (entry,) = pool._cross.values()
    first = _cross_rows(engine, entry.pages)
    vision = _VisionImages(llm, monkeypatch)
    reused = llm.generate([other], GREEDY, use_tqdm=False)
    assert vision.images == 0 and pool.cross_cache_hits == 1
    fresh = llm.generate([{**other, "cache_salt": "s"}], GREEDY, use_tqdm=False)
    assert vision.images == 1
    _same(fresh, reused, "cross group reused")
    (salted,) = [e for e in pool._cross.values() if e is not entry]
    for (k0, v0), (k1, v1) in zip(first, _cross_rows(engine, salted.pages), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    engine.check_integrity()


def test_preempted_request_finds_its_pages_and_n_siblings(plain: LLM) -> None:
    """A request preempted mid-decode resumes from its own cached pages; n > 1 siblings
    (seeded sampling) sample as without caching."""
    llm = _llm(enable_prefix_caching=True, async_scheduling=False)
    engine = llm.llm_engine
    pool = engine.block_manager.pool
    prompts = [c for c in _conversations()[:2]]
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    for _ in range(4):
        engine.step()
    sched = engine.scheduler
    hits = pool.prefix_cache_hits
    sched.preempt(sched.requests["a"])
    for s in sched.requests["a"].seqs:
        engine.runner.release(s)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.check_integrity()
    assert pool.prefix_cache_hits > hits  # "a" took its own pages back
    ref = plain.generate(prompts, GREEDY, use_tqdm=False)
    _same(ref, [outs["a"], outs["b"]], "preempted")
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, logprobs=2)
    for _ in range(2):  # the second time from the cache
        got = llm.generate(prompts, params, use_tqdm=False)
        want = plain.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want, strict=True):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    engine.check_integrity()


def test_reset_prefix_cache() -> None:
    llm = _llm(enable_prefix_caching=True)
    pool = llm.llm_engine.block_manager.pool
    prompt = "Reset the cache " * 12
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache()
    hits = pool.prefix_cache_hits
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert pool.prefix_cache_hits == hits  # nothing was left to find
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert pool.prefix_cache_hits > hits  # and caching goes on
    llm.llm_engine.check_integrity()
