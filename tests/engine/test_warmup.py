"""Start-up warm-up (vllm/engine/warmup.py): it drives the engine through the spread encoder
and chunked prefill paths, leaves no trace (no request, no page, zeroed counters) and does not
change what the engine generates afterwards (tiny model, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.engine.warmup import warm_up

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def _llm() -> LLM:
    # The serving mode: chunked prefill (a budget small enough to cut the warm-up's prompts)
    # with the encoder spread over steps.
    return LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8,
               limit_mm_per_prompt={"image": 2}, enable_chunked_prefill=True,
               max_num_batched_tokens=32, encoder_layers_per_step=4)


def _prompts() -> list:
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (90, 150, 3), dtype=np.uint8))
    return ["A text prompt about the weather",
            {"prompt": "<|image|><|begin_of_text|>This image shows",
             "multi_modal_data": {"image": image}}]


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    outs = llm.generate(_prompts(), PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def reference() -> list:
    return _generate(_llm())


def test_warmup_covers_spread_paths_and_leaves_engine_clean(reference: list) -> None:
    llm = _llm()
    engine = llm.llm_engine
    seen = {}
    reset = engine.reset_counters

    def snapshot() -> None:
        s = engine.runner.stats
        seen.update(chunks=s.prefill_chunks, ahead=s.images_encoded_ahead,
                    encoder=s.encoder_steps, prefills=s.prefill_steps, steps=s.steps,
                    finished=sum(engine.stats.snapshot()["request_success"].values()))
        reset()

    engine.reset_counters = snapshot
    stats = warm_up(engine)
    spec = engine.config.model_config.spec
    tile_counts = {w * h for w, h in spec.vision.supported_aspect_ratios}
    assert stats.requests >= 6 + len(tile_counts) and stats.steps > 0
    # Images of every tile count were encoded over steps, and prompts prefilled in chunks.
    assert seen["ahead"] >= max(len(tile_counts), 3)
    assert seen["encoder"] > seen["ahead"] and seen["chunks"] >= 4
    assert seen["steps"] > seen["prefills"] > 0
    # Nothing left behind: no request, every page free, counters zeroed.
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv_cache_usage() == 0.0
    assert len(engine.scheduler.tracker) == 0 and engine.runner.stats.steps == 0
    assert not engine.runner.stats.graph_replays and engine.scheduler.num_preemptions == 0
    assert len(engine.input_processor.image_cache) == 0  # the random images are dropped
    # The warm-up's requests were counted as they ran, and are not served traffic: /metrics
    # starts from zero.
    assert seen["finished"] >= stats.requests - 1  # all but the aborted long-running one
    after = engine.stats.snapshot()
    assert after["prompt_tokens"] == after["generation_tokens"] == 0
    assert not after["request_success"]
    assert all(total == 0 for _, _, total in after["histograms"].values())
    engine.check_integrity()
    # And the engine generates what a fresh one does.
    assert _generate(llm) == reference


def test_warmup_refuses_a_busy_engine() -> None:
    llm = _llm()
    engine = llm.llm_engine
    engine.add_request("busy", "Hello", PARAMS)
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)
    engine.abort_request("busy")
    assert not engine.has_unfinished_requests()


def test_warmup_with_one_sequence_and_short_context() -> None:
    """A batch of one (nothing can interleave) and a context shorter than the warm-up's
    prompts: the warm-up clips its prompts, finishes and leaves the engine idle."""
    llm = LLM(model="demo/mllama-tiny", max_model_len=48, max_num_seqs=1,
              limit_mm_per_prompt={"image": 1}, enable_chunked_prefill=True,
              max_num_batched_tokens=16, encoder_layers_per_step=4)
    engine = llm.llm_engine
    stats = warm_up(engine)
    assert stats.steps > 0 and not engine.has_unfinished_requests()
    assert engine.kv_cache_usage() == 0.0
    engine.check_integrity()


def test_warmup_runs_every_prefill_gemm_shape_served_later(monkeypatch) -> None:
    """Served prefills of new prompt lengths only reach GEMM row counts the warm-up ran (per
    text-layer weight shape): the padded rows (prefill_inputs.prefill_rows) are what makes
    that possible, so this fails if a prefill step's rows are left unpadded."""
    from vllm.model_executor.layers.linear import Linear

    # Whole prompts (the budget is max_model_len's): steps of every row count up to it.
    llm = LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8,
              limit_mm_per_prompt={"image": 2})
    engine = llm.llm_engine
    runner = engine.runner
    text_linears = {id(m) for name, m in runner.model.language_model.model.layers.named_modules()
                    if isinstance(m, Linear) and not name.endswith("cross_attn.kv_proj")}
    phase = [""]
    seen: dict[str, set] = {"warm": set(), "prefill": set()}
    forward = Linear.forward

    def recording_forward(self, x, out=None):
        if phase[0] and id(self) in text_linears:
            seen[phase[0]].add((x.shape[0], tuple(self.weight.shape)))
        return forward(self, x, out)

    def in_phase(name: str, fn):
        def wrapped(*args, **kwargs):
            outer, phase[0] = phase[0], phase[0] or name
            try:
                return fn(*args, **kwargs)
            finally:
                phase[0] = outer
        return wrapped

    monkeypatch.setattr(Linear, "forward", recording_forward)
    monkeypatch.setattr(runner, "warm_up_prefill_gemms",
                        in_phase("warm", runner.warm_up_prefill_gemms))
    stats = warm_up(engine)
    assert stats.prefill_gemms == len(seen["warm"]) > 0
    monkeypatch.setattr(runner, "_prefill", in_phase("prefill", runner._prefill))
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    lengths = (1, 4, 9, 17, 30)  # words: about five tokens each
    prompts = [" ".join(words[i % 10] for i in range(n)) for n in lengths] + _prompts()[1:]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    served = seen["prefill"]
    assert {m for m, _ in served} - {16 * k for k in range(1, 17)}, "no long step reached"
    assert served and served <= seen["warm"], sorted(served - seen["warm"])
