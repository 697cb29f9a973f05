"""The engine end to end on the tiny model: preemption, fairness, aborts, limits, n > 1."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.core.scheduler import RequestTooLarge

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompts(k: int) -> list:
    out = []
    for i in range(k):
        if i % 3 == 0:
            out.append(f"Text prompt number {i} talks about")
        else:
            out.append({"prompt": f"<|image|><|begin_of_text|>Image {i} shows",
                        "multi_modal_data": {"image": _image(30 + 20 * (i % 4), 60, i)}})
    return out


def _llm(**kw) -> LLM:
    args = dict(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8, enforce_eager=True)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def roomy() -> LLM:
    return _llm()


def test_preemption_recomputes_and_matches(roomy: LLM) -> None:
    prompts = _prompts(9)
    ref = roomy.generate(prompts, GREEDY, use_tqdm=False)
    # 24 pages of 16 tokens: a sequence needs up to 3 pages, plus 5 cross pages with an image.
    tight = _llm(num_gpu_blocks_override=24)
    out = tight.generate(prompts, GREEDY, use_tqdm=False)
    engine = tight.llm_engine
    assert engine.scheduler.num_preemptions > 0
    check_logprobs_close(vllm_greedy(ref), vllm_greedy(out), "roomy", "tight")
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    engine.check_integrity()
    assert engine.block_manager.pool.num_free == 24


def test_no_request_starves(roomy: LLM) -> None:
    """FCFS admission under continuous load: every request finishes, none waits forever."""
    engine = roomy.llm_engine
    finished_at: dict[str, int] = {}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pending = list(enumerate(_prompts(24)))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # new arrivals keep coming
            i, p = pending.pop(0)
            engine.add_request(f"s{i}", p, params)
        for o in engine.step():
            if o.finished:
                finished_at[o.request_id] = step
        step += 1
        assert step < 2000
    assert len(finished_at) == 24
    # Arrival order is roughly respected: nobody finishes far behind later arrivals.
    order = [finished_at[f"s{i}"] for i in range(24)]
    assert max(order[i] - order[j] for i in range(24) for j in range(i, 24)) < 40
    engine.check_integrity()


def test_abort_mid_prefill_and_mid_decode(roomy: LLM) -> None:
    engine = roomy.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompts = _prompts(4)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    engine.abort_request("a0")  # waiting, never prefilled
    engine.step()  # prefill of the rest
    engine.abort_request("a1")  # prefilled, holding pages and a decode row
    for _ in range(5):
        engine.step()
    engine.abort_request(["a2", "a3"])  # mid-decode
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0
    assert sorted(engine.runner.rows.free_rows) == list(range(engine.runner.rows.max_rows))


def test_requests_that_can_never_fit(roomy: LLM) -> None:
    engine = roomy.llm_engine
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("x", "word " * 300, SamplingParams())
    # 8 pages hold one sequence of at most 48 tokens: a longer max_model_len is refused up
    # front, naming the largest that fits.
    with pytest.raises(ValueError, match="largest max_model_len that fits is 48"):
        _llm(num_gpu_blocks_override=8)
    small = _llm(num_gpu_blocks_override=8, max_model_len=48)
    with pytest.raises(RequestTooLarge, match="KV pages"):
        small.llm_engine.add_request("y", "hello", SamplingParams(n=8, max_tokens=200))
    with pytest.raises(ValueError, match="image items"):
        engine.add_request("z", {"prompt": "<|image|><|image|>two",
                                 "multi_modal_data": {"image": [_image(20, 20, 0)] * 2}})
    with pytest.raises(ValueError, match=r"number of image tokens \(2\).*images \(1\)"):
        engine.add_request("w", {"prompt": "<|image|> <|image|> Compare",
                                 "multi_modal_data": {"image": _image(20, 20, 0)}})
    assert not engine.has_unfinished_requests()


def test_n_siblings_share_prompt_pages(roomy: LLM) -> None:
    engine = roomy.llm_engine
    p = {"prompt": "<|image|><|begin_of_text|>" + "A fairly long prompt that spans pages. " * 2,
         "multi_modal_data": {"image": _image(50, 50, 1)}}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine.add_request("n4", p, params)
    engine.step()  # prefill + fork
    req = engine.scheduler.requests["n4"]
    assert len(req.seqs) == 4
    first = req.seqs[0].block_table[0]
    assert engine.block_manager.pool.ref[first] == 4
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # samples differ
    engine.check_integrity()
    again = roomy.generate(p, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_sampling_independent_of_batch(roomy: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    prompts = _prompts(4)
    alone = roomy.generate(prompts[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = roomy.generate(prompts, [other, seeded, other, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_async_scheduling_matches_sync(roomy: LLM) -> None:
    """Launching step N+1 before reading step N changes nothing users see: EOS and stop
    strings discovered a step late discard the extra token; pages and rows all come back."""
    sync = _llm(async_scheduling=False)
    prompts = _prompts(7)
    params = [SamplingParams(temperature=0, max_tokens=30),  # stops at EOS when it comes
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=30, stop=["a", "e", "o"]),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=10),
              SamplingParams(temperature=0, max_tokens=25, logprobs=2)]
    a = roomy.generate(prompts, params, use_tqdm=False)
    b = sync.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs]
    assert roomy.llm_engine.async_scheduling and not sync.llm_engine.async_scheduling
    for llm in (roomy, sync):
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.block_manager.pool.usage() == 0.0
        rows = llm.llm_engine.runner.rows
        assert len(rows.free_rows) == rows.max_rows


def test_abort_while_a_step_is_in_flight(roomy: LLM) -> None:
    engine = roomy.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(3)):
        engine.add_request(f"f{i}", p, params)
    for _ in range(4):
        engine.step()
    assert engine._pending is not None
    engine.abort_request(["f0", "f1", "f2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0
