"""The memory profile's synthetic worst-case prefill looks like a step the scheduler can run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.worker.memory import _profile_inputs


@pytest.mark.parametrize(("max_model_len", "max_num_seqs", "batched"),
                         [(256, 1, 512), (256, 8, None), (4096, 64, None), (1024, 3, 4096)])
def test_profile_prompts_fit_max_model_len_and_the_budgets(
        max_model_len: int, max_num_seqs: int, batched: int | None) -> None:
    """No profile prompt is longer than max_model_len: past it the RoPE tables end (on the GPU
    the fused RoPE + KV-write kernel read past its cos/sin tables there: an illegal memory
    access or garbage, depending on what lies behind them)."""
    cfg = EngineArgs(model="demo/mllama-tiny", max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                     limit_mm_per_prompt={"image": 2}).create_engine_config()
    sc, v = cfg.scheduler_config, cfg.model_config.spec.vision
    prompts = _profile_inputs(SimpleNamespace(config=cfg))
    lengths = [len(p.prompt_token_ids) for p in prompts]
    assert len(prompts) <= max_num_seqs
    assert max(lengths) <= max_model_len
    assert sum(lengths) <= sc.max_num_batched_tokens
    # Still the worst case: the token budget (or every sequence at full length) and every
    # image the per-step vision budget admits.
    full = min(sc.max_num_batched_tokens, max_num_seqs * max_model_len)
    assert sum(lengths) > full - len(prompts)
    images = sum(len(p.images.num_tiles) for p in prompts if p.images is not None)
    assert images == sc.max_num_encoder_tiles // v.max_num_tiles
