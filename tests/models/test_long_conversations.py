"""Two 100k-token conversations with images through the serving engine (11B shape, dummy bf16
weights, GPU only): one 4-tile image at the start of the prompt, so that every chunk of the
rest cross-attends to it; and three 4-tile images spread through it, each chunk seeing the
group its tokens follow. The engine prefills them in chunks of the serving default's token
budget; its prompt logprobs at sampled positions are compared with one whole-prompt prefill of
the same weights (a second copy drawn from the same seed) under plain torch kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.kernel_target import KernelTarget, select_kernels
from vllm.worker.loaded_model import load_model
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch, step_images

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
LENGTH = 100_000


def _args(**kw) -> EngineArgs:
    # The serving defaults (chunked prefill, the default token budget, the whole context),
    # with room for a second copy of the weights and the whole-prompt reference.
    return EngineArgs(
        model="demo/mllama-11b",
        load_format="dummy",
        dtype="bfloat16",
        max_num_seqs=2,
        limit_mm_per_prompt={"image": 3},
        gpu_memory_utilization=0.45,
        **kw,
    )


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(_args().create_engine_config(), warmup=False)
    assert eng.config.scheduler_config.enable_chunked_prefill
    assert eng.config.model_config.max_model_len == 131_072
    yield eng
    del eng
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference():
    cfg = _args(enforce_eager=True, max_model_len=LENGTH + 16).create_engine_config()
    loaded = load_model(cfg)
    select_kernels(
        loaded.model,
        KernelTarget(torch.device("cuda"), fused=False, row_buckets=loaded.kernels.row_buckets),
    )
    yield cfg, loaded
    del loaded
    torch.cuda.empty_cache()


def _image(seed: int, tile: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (2 * tile, 2 * tile, 3), dtype=np.uint8))


def _conversation(engine: LLMEngine, image_at: list[int]) -> dict:
    spec = engine.config.model_config.spec
    rng = np.random.default_rng(len(image_at))
    ids = [1, *rng.integers(1000, 20000, LENGTH - 1).tolist()]
    for pos in image_at:
        ids[pos] = spec.image_token_id
    images = [_image(i, spec.vision.image_size) for i in range(len(image_at))]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


@torch.inference_mode()
def _reference_logprobs(reference, processed, positions: list[int]) -> torch.Tensor:
    """log-softmax of the whole-prompt prefill's logits predicting each of ``positions``."""
    cfg, loaded = reference
    lo = loaded.layout
    items = [PrefillItem(list(processed.prompt_token_ids), processed, 0)]
    batch = build_prefill_batch(
        items, lo.block_size, lo.cross_block_size, torch.device("cuda"), pad_rows=True
    )
    images = step_images(items, torch.device("cuda"))
    vision = loaded.model.encode_images(
        images.pixel_values, images.aspect_ratio_ids, images.num_tiles
    )
    with set_forward_context(batch.metadata):
        hidden = loaded.model(batch.input_ids, batch.positions, vision)
    rows = torch.tensor([p - 1 for p in positions], device="cuda")
    return torch.log_softmax(loaded.model.compute_logits(hidden[rows]).float(), dim=-1)


@pytest.mark.parametrize(
    "image_at", [[1], [1, 33_000, 66_000]], ids=["one-image-at-start", "three-images-spread"]
)
def test_long_conversation_chunked_matches_whole_prefill(
    engine, reference, image_at: list[int]
) -> None:
    prompt = _conversation(engine, image_at)
    processed = engine.process_inputs(prompt)
    ids = processed.prompt_token_ids
    assert len(ids) == LENGTH
    engine.add_request(
        "long",
        None,
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5),
        processed=processed,
    )
    budget = engine.config.scheduler_config.max_num_batched_tokens
    done = []
    for _ in range(2 * LENGTH // budget + 8):
        done += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert len(done) == 1 and done[0].error is None
    got = done[0].prompt_logprobs
    # Positions near each image, at chunk boundaries, and far from any image.
    positions = sorted(
        {
            p
            for base in [*image_at, 2]
            for p in (base + 1, base + 2, base + budget - 1, base + budget + 1)
        }
        | {4096, 50_000, 65_535, 99_998, LENGTH - 1}
    )
    positions = [p for p in positions if 0 < p < LENGTH and ids[p] != ids[image_at[0]]]
    ref = _reference_logprobs(reference, processed, positions)
    for row, p in enumerate(positions):
        entries = got[p]
        token_ids = list(entries)
        want = ref[row, token_ids].cpu()
        have = torch.tensor([entries[t].logprob for t in token_ids])
        # bf16 through 40 layers in two orders of sums: a small drift against the spread of
        # the logprobs; a chunk that lost its image or its earlier keys moves them by its
        # order.
        spread = ref[row].std().item()
        assert (have - want).abs().max().item() < 0.1 * spread + 0.05, (p, have, want)
