"""Interleaved prefill: while sequences decode, prefill steps are bounded and alternate with
decode steps, and images of waiting requests are encoded over decode steps before their
prefill. Outputs equal those of the prefill-first engine (tiny model, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.compare import check_logprobs_close, vllm_greedy
from PIL import Image

from vllm import LLM, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _image(seed: int, w: int = 100, h: int = 60) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _image_prompt(i: int, images: int = 1) -> dict:
    return {"prompt": "<|image|>" * images + f"<|begin_of_text|>Image {i} shows",
            "multi_modal_data": {"image": [_image(i + k) for k in range(images)]}}


def _text_prompt(i: int, words: int = 4) -> str:
    return f"Text prompt {i} " + "about things " * words


def _llm(**kw) -> LLM:
    args = dict(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8,
                limit_mm_per_prompt={"image": 2})
    args.update(kw)
    return LLM(**args)


class StepLog:
    """Records every launched step: (is_prefill, request ids, prompt tokens)."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[bool, list[str], int]] = []
        launch = engine.runner.launch

        def logged(out):
            seqs = out.prefill_seqs if out.is_prefill else out.decode_seqs
            tokens = sum(len(s) for s in out.prefill_seqs)
            self.steps.append((out.is_prefill, [s.request.request_id for s in seqs], tokens))
            return launch(out)

        engine.runner.launch = logged

    def first_prefill(self, rid: str) -> int:
        return next(i for i, (pre, ids, _) in enumerate(self.steps) if pre and rid in ids)


def _run_busy(llm: LLM, late: list[tuple[str, object, SamplingParams]]):
    """A long request decodes; the ``late`` ones arrive together once it does."""
    engine = llm.llm_engine
    log = StepLog(engine)
    engine.add_request("long", _text_prompt(0), LONG)
    finished = {}
    for _ in range(3):
        for o in engine.step():
            finished[o.request_id] = o
    for rid, prompt, params in late:
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        steps += 1
        assert steps < 500
        engine.check_integrity()
    return finished, log


LATE = [("img", _image_prompt(1), SHORT), ("txt1", _text_prompt(2, 3), SHORT),
        ("img2", _image_prompt(3, images=2), SHORT), ("txt2", _text_prompt(4, 3), SHORT)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bounded_prefill_between_tokens(async_scheduling: bool) -> None:
    llm = _llm(decode_interleave_tokens=64, encoder_layers_per_step=2,
               async_scheduling=async_scheduling)
    finished, log = _run_busy(llm, LATE)
    stats = llm.llm_engine.runner.stats
    # Both image requests were encoded over decode steps, not inside their prefill.
    assert stats.images_encoded_ahead == 2
    layers = 4 + 2  # the tiny vision tower: 4 local + 2 global layers
    assert stats.encoder_chunks >= layers // 2 + layers * 2 // 2
    # While "long" runs, no two prefill steps are adjacent, and each carries <= 64 tokens
    # unless it holds a single request.
    end = max(i for i, (pre, ids, _) in enumerate(log.steps) if not pre and "long" in ids)
    for i, (pre, ids, tokens) in enumerate(log.steps[:end]):
        if pre and i > 0:
            assert not log.steps[i - 1][0], f"two prefill steps in a row at {i}"
            assert tokens <= 64 or len(ids) == 1, (tokens, ids)
    # Text requests behind an image request being encoded went first.
    assert log.first_prefill("txt1") < log.first_prefill("img")
    # Same outputs as the prefill-first engine.
    ref_llm = _llm(decode_interleave_tokens=0, encoder_layers_per_step=0,
                   async_scheduling=async_scheduling)
    ref, ref_log = _run_busy(ref_llm, LATE)
    assert ref_llm.llm_engine.runner.stats.images_encoded_ahead == 0
    late_ids = {rid for rid, _, _ in LATE}
    assert any(pre and late_ids <= set(ids) for pre, ids, _ in ref_log.steps)  # one big prefill
    order = ["long"] + [rid for rid, _, _ in LATE]
    check_logprobs_close(vllm_greedy([ref[r] for r in order]),
                         vllm_greedy([finished[r] for r in order]), "prefill-first",
                         "interleaved")
    for r in order:
        assert len(finished[r].outputs[0].token_ids) == len(ref[r].outputs[0].token_ids)


def test_encoding_ahead_only_while_busy() -> None:
    """An idle engine prefills image requests at once (encoding inside the prefill)."""
    llm = _llm(decode_interleave_tokens=256, encoder_layers_per_step=4)
    out = llm.generate([_image_prompt(5), _text_prompt(6)], SHORT, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert llm.llm_engine.runner.stats.images_encoded_ahead == 0
    assert llm.llm_engine.runner.stats.prefill_steps == 1


def test_abort_while_encoding_ahead() -> None:
    llm = _llm(decode_interleave_tokens=256, encoder_layers_per_step=1)
    engine = llm.llm_engine
    engine.add_request("long", _text_prompt(0), LONG)
    engine.step()
    engine.step()
    engine.add_request("img", _image_prompt(1), SHORT)
    engine.step()
    engine.step()
    assert engine._encoder_job is not None and engine._encoder_job.request.request_id == "img"
    engine.abort_request("img")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert engine._encoder_job is None
    assert set(outs) == {"long"} and len(outs["long"].outputs[0].token_ids) == 40
    assert engine.runner.stats.images_encoded_ahead == 0
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0


def test_flags_validated() -> None:
    with pytest.raises(ValueError, match="encoder_layers_per_step"):
        _llm(encoder_layers_per_step=-1)


def test_offline_default_is_prefill_first() -> None:
    """The LLM class defaults to prefill-first (throughput); the engine args default (the
    server's) interleaves."""
    from vllm.engine.arg_utils import EngineArgs

    sc = _llm().llm_engine.config.scheduler_config
    assert (sc.decode_interleave_tokens, sc.encoder_layers_per_step,
            sc.prefill_layers_per_step) == (0, 0, 0)
    served = EngineArgs(model="demo/mllama-tiny", max_model_len=256).create_engine_config()
    sc = served.scheduler_config
    assert (sc.decode_interleave_tokens, sc.encoder_layers_per_step,
            sc.prefill_layers_per_step) == (256, 4, 5)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_spread_prefill_matches_one_step(async_scheduling: bool) -> None:
    """--prefill-layers-per-step: admitted prefills run a layer per decode step; the request
    does not decode before its prefill is done, and outputs equal the one-step prefill."""
    flags = dict(decode_interleave_tokens=64, encoder_layers_per_step=2,
                 async_scheduling=async_scheduling)
    spread = _llm(prefill_layers_per_step=1, **flags)
    finished, log = _run_busy(spread, LATE)
    stats = spread.llm_engine.runner.stats
    assert stats.spread_prefills >= len(LATE)
    for rid in ("img", "txt1"):  # the prefill launch comes several decode steps after
        i = log.first_prefill(rid)
        assert not any(rid in ids for _, ids, _ in log.steps[:i])
    ref, _ = _run_busy(_llm(**flags), LATE)
    order = ["long"] + [rid for rid, _, _ in LATE]
    check_logprobs_close(vllm_greedy([ref[r] for r in order]),
                         vllm_greedy([finished[r] for r in order]), "one step", "spread")
    engine = spread.llm_engine
    assert engine.runner.prefill_job is None and engine.scheduler.sliced_prefill is None


def test_abort_during_spread_prefill() -> None:
    llm = _llm(decode_interleave_tokens=256, encoder_layers_per_step=4,
               prefill_layers_per_step=1)
    engine = llm.llm_engine
    engine.add_request("long", _text_prompt(0), LONG)
    engine.step()
    engine.step()
    engine.add_request("a", _text_prompt(1), SHORT)
    for _ in range(3):
        engine.step()
        if engine.runner.prefill_job is not None:
            break
    assert engine.runner.prefill_job is not None
    engine.abort_request("a")
    assert engine.runner.prefill_job is None and engine.scheduler.sliced_prefill is None
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert set(outs) == {"long"} and len(outs["long"].outputs[0].token_ids) == 40
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0
