"""The memory profile's synthetic worst-case prefill looks like a step the scheduler can run."""

from __future__ import annotations

import pytest
import torch
from helpers.cuda_paths import use_fused_kernels

from vllm.engine.arg_utils import EngineArgs
from vllm.worker.memory import profile_inputs


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
    prompts = profile_inputs(cfg)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's checks are CPU-only")
def test_profile_prefill_stays_in_bounds(monkeypatch) -> None:
    """The profile prefill with the model's CUDA-only paths (fused RoPE + KV write, norms,
    vision kernels, key-split cross prefill) in the bounds-checked Triton interpreter. With
    prompts past max_model_len (as before the cap) the RoPE kernel reads past its tables here;
    then the CUDA wrapper's bookkeeping around it (no GPU: its torch.cuda calls stubbed)."""
    pytest.importorskip("triton")
    from vllm.worker import memory
    from vllm.worker.loaded_model import load_model

    cfg = EngineArgs(model="demo/mllama-tiny", max_model_len=128, max_num_seqs=2,
                     max_num_batched_tokens=256, max_num_encoder_tiles=4,
                     limit_mm_per_prompt={"image": 1}).create_engine_config()
    with monkeypatch.context() as m:
        use_fused_kernels(m)
        loaded = load_model(cfg)
    assert loaded.kernels.fused
    logits = memory.run_profile_prefill(cfg, loaded.model, loaded.layout)
    assert logits.shape[0] == len(profile_inputs(cfg)) and torch.isfinite(logits).all()
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 12345)
    monkeypatch.setattr(memory, "run_profile_prefill", lambda *args: torch.zeros(1))
    assert memory.profile_prefill_peak(cfg, loaded) == 12345
