"""Randomised engine run: async scheduling, preemption under a tight cache, chunked and
batched prefill, n > 1, images, stop strings and aborts at random points. Everything not
aborted finishes as it would alone, and every page and decode row comes back."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.compare import check_logprobs_close
from PIL import Image

from vllm import LLM, SamplingParams


def _image(rng: random.Random) -> Image.Image:
    w, h = rng.choice([(30, 30), (60, 20), (20, 90), (112, 112)])
    arr = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (h, w, 3), np.uint8)
    return Image.fromarray(arr)


def _request(rng: random.Random, i: int) -> tuple[dict | str, SamplingParams]:
    n_img = rng.choice([0, 0, 1, 2])
    text = f"request {i} " + "word " * rng.randint(1, 12)
    prompt: dict | str = text
    if n_img:
        prompt = {"prompt": "<|image|>" * n_img + "<|begin_of_text|>" + text,
                  "multi_modal_data": {"image": [_image(rng) for _ in range(n_img)]}}
    greedy = rng.random() < 0.6
    params = SamplingParams(
        temperature=0 if greedy else 0.9, seed=None if greedy else i,
        n=1 if greedy else rng.choice([1, 2, 3]), max_tokens=rng.randint(1, 24),
        ignore_eos=rng.random() < 0.7, logprobs=5 if greedy else None,
        stop=[rng.choice(["a", "b", "qq"])] if rng.random() < 0.2 else None)
    return prompt, params


@pytest.mark.parametrize("seed,budget,pages", [(0, 16, 24), (1, 24, 24), (0, 192, 24)])
def test_random_workload_with_preemption_and_aborts(seed: int, budget: int, pages: int) -> None:
    """Small budgets cut prompts into chunks of a few tokens (image tokens inside them);
    192 batches whole prompts next to the decode."""
    rng = random.Random(seed)
    work = [_request(rng, i) for i in range(28)]
    tight = LLM(model="demo/mllama-tiny", max_model_len=192, max_num_seqs=8,
                limit_mm_per_prompt={"image": 2}, num_gpu_blocks_override=pages,
                enable_chunked_prefill=True, max_num_batched_tokens=budget,
                encoder_layers_per_step=4)  # the server's mode
    engine = tight.llm_engine
    aborted: set[str] = set()
    finished = {}
    pending = list(enumerate(work))
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
        if rng.random() < 0.05 and engine.scheduler.requests:
            victim = rng.choice(sorted(engine.scheduler.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 5000
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.stats.images_encoded_ahead > 0  # images were encoded over steps
    assert (engine.runner.stats.prefill_chunks > 0) == (budget < 192)
    assert len(engine.scheduler.tracker) == 0  # no prefill record outlives its request
    assert engine.block_manager.pool.usage() == 0.0
    rows = engine.runner.rows
    assert len(rows.free_rows) == rows.max_rows
    done = {rid: o for rid, o in finished.items() if rid not in aborted}
    assert len(done) + len(aborted) >= len(work) - 0  # every request accounted for
    roomy = LLM(model="demo/mllama-tiny", max_model_len=192, max_num_seqs=8,
                limit_mm_per_prompt={"image": 2}, async_scheduling=False)
    for rid, out in done.items():
        prompt, params = work[int(rid)]
        assert out.error is None
        assert len(out.outputs) == params.n
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= params.max_tokens
            if params.ignore_eos and not params.stop:
                assert len(c.token_ids) == params.max_tokens
        if params.temperature == 0:
            (ref,) = roomy.generate(prompt, params, use_tqdm=False)
            a = [(list(ref.outputs[0].token_ids),
                  [{t: lp.logprob for t, lp in s.items()} for s in ref.outputs[0].logprobs])]
            b = [(list(out.outputs[0].token_ids),
                  [{t: lp.logprob for t, lp in s.items()} for s in out.outputs[0].logprobs])]
            check_logprobs_close(a, b, "alone", "stressed")
