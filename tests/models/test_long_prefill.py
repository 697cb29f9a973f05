"""Prefills of the model's whole context on the 11B shape (GPU only).

Past about 75k tokens, a kernel offset of ``row * 28,672`` (the gate|up rows) no longer fits in
32 bits. These run whole prefills of 81,920 and 131,072 tokens through the fused kernels and
compare the logits at sampled positions with the same weights under plain torch kernels, and
serve a prompt of nearly ``max_model_len`` = 131,072 tokens through the engine (with its
serving defaults: chunked prefill, the memory profile one step of the token budget).
"""

from __future__ import annotations

import pytest
import torch

from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.kernel_target import KernelTarget, select_kernels
from vllm.worker.loaded_model import load_model
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_LEN = 131_072


@pytest.fixture(scope="module")
def loaded():
    cfg = EngineArgs(model="demo/mllama-11b", load_format="dummy", dtype="bfloat16",
                     max_model_len=MAX_LEN, max_num_seqs=1, enforce_eager=True,
                     gpu_memory_utilization=0.6).create_engine_config()
    model = load_model(cfg)
    yield cfg, model
    del model
    torch.cuda.empty_cache()


def _prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return [1, *torch.randint(min(1000, vocab // 2), vocab - 1, (n - 1,), generator=g).tolist()]


@torch.inference_mode()
def _logits(cfg, loaded, ids: list[int], positions: list[int]) -> torch.Tensor:
    from vllm.multimodal.cross_attention import image_runs, last_group
    from vllm.multimodal.processing import ProcessedInputs

    spec = cfg.model_config.spec
    inputs = ProcessedInputs(ids, None, image_runs(ids, spec.image_token_id),
                             last_group(ids, spec.image_token_id),
                             tokens_per_tile=spec.vision.tokens_per_tile)
    lo = loaded.layout
    batch = build_prefill_batch([PrefillItem(ids, inputs, 0)], lo.block_size,
                                lo.cross_block_size, torch.device("cuda"), pad_rows=True)
    with set_forward_context(batch.metadata):
        hidden = loaded.model(batch.input_ids, batch.positions, None)
    return loaded.model.compute_logits(hidden[torch.tensor(positions, device="cuda")])


@pytest.mark.parametrize("n", [81_920, MAX_LEN])
def test_full_context_prefill_matches_torch_kernels(loaded, n: int) -> None:
    cfg, lm = loaded
    ids = _prompt(n, cfg.model_config.spec.text.vocab_size)
    positions = [0, 1, 4095, 32_767, 65_535, 74_897, 74_899, n // 2, n - 2, n - 1]
    positions = sorted({p for p in positions if p < n})
    fused = _logits(cfg, lm, ids, positions)
    assert lm.kernels.fused and torch.isfinite(fused).all()
    select_kernels(lm.model, KernelTarget(torch.device("cuda"), fused=False,
                                          row_buckets=lm.kernels.row_buckets))
    try:
        plain = _logits(cfg, lm, ids, positions)
    finally:
        select_kernels(lm.model, lm.kernels)
    # bf16 activations through 40 layers: the two orders of rounding drift apart by about 2%
    # (random weights), the same on either side of row 74,898, where 32-bit offsets of the
    # gate|up rows would wrap (a wrapped offset reads other rows: an error of order 1, or NaN).
    err = ((fused - plain).norm(dim=-1) / plain.norm(dim=-1)).tolist()
    below = [e for p, e in zip(positions, err, strict=True) if p < 74_898]
    above = [e for p, e in zip(positions, err, strict=True) if p >= 74_898]
    assert max(err) < 5e-2, dict(zip(positions, err, strict=True))
    assert max(above) < 1.5 * max(below) + 1e-2, dict(zip(positions, err, strict=True))


def test_engine_serves_a_full_context_prompt(loaded) -> None:
    """The engine (chunked prefill, the serving default) serves a prompt of nearly
    max_model_len tokens. Built without the start-up warm-up, which is not what is tested
    here."""
    from vllm import SamplingParams
    from vllm.engine.llm_engine import LLMEngine

    cfg, _ = loaded
    engine = LLMEngine(EngineArgs(model="demo/mllama-11b", load_format="dummy",
                                  dtype="bfloat16", max_model_len=MAX_LEN, max_num_seqs=2,
                                  gpu_memory_utilization=0.9).create_engine_config(),
                       warmup=False)
    ids = _prompt(MAX_LEN - 100, cfg.model_config.spec.text.vocab_size)
    engine.add_request("long", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = []
    for _ in range(2 * MAX_LEN // 512):  # 256 chunks of the 512-token budget
        done += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert len(done) == 1 and done[0].error is None
    assert len(done[0].outputs[0].token_ids) == 4
