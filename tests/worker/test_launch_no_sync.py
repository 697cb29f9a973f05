"""Launching a step never waits for the GPU: prefill with images, chunks, decode, and images
encoded ahead over steps. On CUDA every synchronising call (a pageable copy, ``.item()``, a
stream or event wait) raises inside the launch; on CPU host reads of tensor data do."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers.no_sync import NoHostSync
from PIL import Image

from vllm import LLM, SamplingParams

CUDA = torch.cuda.is_available()


@contextlib.contextmanager
def strict():
    if CUDA:
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with NoHostSync():
            yield


def _strictly(fn):
    def wrapped(*args, **kwargs):
        with strict():
            return fn(*args, **kwargs)
    return wrapped


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (70, 120, 3), dtype=np.uint8))


@pytest.mark.parametrize("budget", [8, 256])
def test_step_launches_do_not_synchronise(budget: int) -> None:
    """Chunks of every kind (8: prompts over several steps, image tokens inside chunks) and
    whole prompts batched with decode (256)."""
    llm = LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8,
              limit_mm_per_prompt={"image": 2}, enable_chunked_prefill=True,
              max_num_batched_tokens=budget, encoder_layers_per_step=2)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    image = {"prompt": "<|image|><|begin_of_text|>What is it", "multi_modal_data":
             {"image": _image(0)}}
    llm.generate([image, "warm up"], params, use_tqdm=False)  # first-use allocations
    runner = engine.runner
    runner.launch = _strictly(runner.launch)
    engine.add_request("long", "A long text request", params)
    engine.step()
    engine.step()
    engine.add_request("img", {"prompt": "<|image|><|image|><|begin_of_text|>Two of them",
                               "multi_modal_data": {"image": [_image(1), _image(2)]}}, params)
    engine.add_request("txt", "Another text request", params)
    # Scored, not continued (max_tokens=0): its prompt logprobs take the same result path.
    engine.add_request("score", "Scored while others decode",
                       SamplingParams(max_tokens=0, prompt_logprobs=2))
    done = {}
    for _ in range(200):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {"long", "img", "txt", "score"}
    score = done.pop("score")
    assert score.error is None and score.outputs[0].token_ids == []
    assert len(score.prompt_logprobs) == len(score.prompt_token_ids)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in done.values())
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in done.values())
    assert runner.stats.images_encoded_ahead >= 1
    assert (runner.stats.prefill_chunks > 0) == (budget == 8)


def test_prompt_logprobs_reach_the_host_only_at_collect() -> None:
    """A launched prefill holds its prompt logprobs as device results being copied, like the
    sampled tokens; the lists appear when the step is collected (CPU and CUDA alike, where
    the sync check above covers only CUDA: a CPU tensor's ``tolist`` is no dispatched op)."""
    llm = LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    engine.add_request("p", {"prompt": "<|begin_of_text|>Look at <|image|>this",
                             "multi_modal_data": {"image": _image(3)}}, params)
    out = engine.scheduler.schedule()
    assert out is not None and len(out.chunks) == 1 and out.chunks[0].samplers
    handle = engine.runner.launch(out)
    assert handle.result.prompt_logprobs == {}
    vals, ids, ranks, images = handle.prompt_logprobs["p"]
    n = len(out.chunks[0].seq.token_ids) - 1
    assert all(isinstance(t, torch.Tensor) for t in (vals, ids, ranks))
    assert vals.shape == ids.shape == (n, 4) and ranks.shape == (n,)
    result = engine.runner.collect(handle)
    got_vals, got_ids, got_ranks = result.prompt_logprobs["p"]
    assert len(got_vals) == len(got_ids) == len(got_ranks) == n
    # The image token's position has rank 0 (no logprob); every other rank is a real rank.
    assert sum(images) == 1 and [r == 0 for r in got_ranks] == images


def test_constrained_decode_does_not_synchronise() -> None:
    """Rows under a grammar next to free rows: the forward is replayed, then the masks are
    filled and the step sampled (``finish_launch``) without waiting for the GPU."""
    from vllm.sampling_params import GuidedDecodingParams

    llm = LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8)
    engine = llm.llm_engine
    guided = GuidedDecodingParams(regex=r"[a-z]{30,40}", disable_any_whitespace=True)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=12, logprobs=2,
                                 guided_decoding=guided)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(["warm up", "warm up too"], [constrained, free], use_tqdm=False)
    runner = engine.runner
    runner.launch = _strictly(runner.launch)
    runner.finish_launch = _strictly(runner.finish_launch)
    engine.add_request("c", "Constrained", constrained)
    engine.add_request("f", "Free", free)
    done = {}
    for _ in range(100):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {"c", "f"}
    text = done["c"].outputs[0].text
    assert len(text) == 12 and text.isalpha() and text.islower()
    assert runner.stats.eager_decode_steps == 0 and runner.grammar_rows.masked_steps >= 11
