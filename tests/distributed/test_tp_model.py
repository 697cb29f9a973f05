"""Tensor parallelism of the model on CPU: two ranks over gloo, each holding its slice of the
tiny demo checkpoint (heads, MLP columns, vocabulary rows), give the prefill logits of one
rank (float32) for prompts with no, one and two images, to the last rounding of the sums."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from helpers.hf_runner import demo_path
from helpers.tp_worker import prefill_logits, run_rank, write_wide_tiny
from PIL import Image

from vllm.distributed.parallel_state import TensorParallel
from vllm.distributed.tensor_parallel import rank_slice, split_dim
from vllm.multimodal.processing import MllamaInputProcessor
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.tokenizer import get_image_processor, get_tokenizer

PROMPTS = [
    ("The color of the sky is blue but sometimes it can also be", []),
    ("<|image|><|begin_of_text|>Describe the image in a few words.", [(2, 2)]),
    (
        "<|begin_of_text|>Between the first image <|image|> and the second <|image|>, which?",
        [(1, 2), (1, 1)],
    ),
]


def _processed() -> list:
    path = demo_path()
    spec = load_mllama_config(path)
    proc = MllamaInputProcessor(spec, get_tokenizer(path), get_image_processor(path), 4, 4096)
    out = []
    for i, (text, ratios) in enumerate(PROMPTS):
        rng = np.random.default_rng(i)
        images = [
            Image.fromarray(rng.integers(0, 256, (56 * h, 56 * w, 3), dtype=np.uint8))
            for h, w in ratios
        ]
        prompt = {"prompt": text, **({"multi_modal_data": {"image": images}} if images else {})}
        out.append(proc.process(prompt))
    return out


def _run_ranks(
    size: int, processed: list, tmp_path, paths: list | None = None, quantization=None
) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    paths = paths or [demo_path()] * size
    procs = [
        ctx.Process(
            target=run_rank, args=(r, size, init, paths[r], processed, results, quantization)
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return {
        r: v if isinstance(v, str) else [torch.from_numpy(a) for a in v] for r, v in got.items()
    }


def _check_two_ranks_equal_one(want: list, got: dict) -> None:
    for rank in (0, 1):
        assert not isinstance(got[rank], str), got[rank]
        for w, g in zip(want, got[rank], strict=True):
            assert g.shape == w.shape
            # Partial sums of the row-parallel layers add in another order: float32 rounding.
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # Both ranks see the same gathered logits, bitwise.
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)


def test_two_ranks_equal_one(tmp_path) -> None:
    processed = _processed()
    _check_two_ranks_equal_one(
        prefill_logits(demo_path(), processed), _run_ranks(2, processed, tmp_path)
    )


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory) -> dict:
    """The wide tiny model's bf16 folder (``tp_worker.write_wide_tiny``) and NF4 / FP4 folders
    that transformers + bitsandbytes write from it."""
    from helpers.bnb_checkpoints import VARIANTS, make_checkpoint

    root = tmp_path_factory.mktemp("wide_tiny")
    bf16 = write_wide_tiny(root / "bf16")
    return {
        "bf16": bf16,
        "nf4": make_checkpoint(root / "nf4", VARIANTS["nf4"], src=bf16),
        "fp4": make_checkpoint(root / "fp4", VARIANTS["fp4"], src=bf16),
    }


@pytest.mark.parametrize(
    "source", ["compressed-tensors", "fp8", "bnb-nf4", "bnb-fp4", "bitsandbytes"]
)
def test_two_ranks_equal_one_with_quantized_weights(
    source, fp8_checkpoint, wide_tiny, tmp_path
) -> None:
    """Quantized weights split across ranks. FP8: a compressed-tensors folder (weights and
    their per-channel scales sliced with the rows) and a bf16 folder quantized at load (a
    row-parallel matrix quantized from whole rows, so every channel has one rank's scale).
    bitsandbytes: pre-quantized NF4 (double quantization) and FP4 (float32 scales) folders
    written by transformers + bitsandbytes, sliced by rows or by whole blocks of columns with
    the block scales decoded, and a bf16 folder quantized at load (each matrix quantized
    whole, as with one rank, then sliced)."""
    path, quantization = {
        "compressed-tensors": (fp8_checkpoint("fp8-dynamic"), source),
        "fp8": (demo_path(), source),
        "bnb-nf4": (wide_tiny["nf4"], "bitsandbytes"),
        "bnb-fp4": (wide_tiny["fp4"], "bitsandbytes"),
        "bitsandbytes": (wide_tiny["bf16"], source),
    }[source]
    processed = _processed()
    want = prefill_logits(path, processed, quantization=quantization)
    got = _run_ranks(2, processed, tmp_path, [path, path], quantization=quantization)
    _check_two_ranks_equal_one(want, got)


def test_rank_slices() -> None:
    """Column-parallel weights split along rows, row-parallel along columns, in rank order;
    the vision tower, norms and gates stay whole."""
    w = torch.arange(8 * 6).reshape(8, 6)
    qkv = "language_model.model.layers.0.self_attn.qkv_proj.weight"
    down = "language_model.model.layers.0.mlp.down_proj.weight"
    assert split_dim(qkv) == 0 and split_dim(down) == 1
    assert split_dim("language_model.lm_head.weight") == 0
    assert split_dim("language_model.model.embed_tokens.weight") == 0
    for name in (
        "vision_model.transformer.layers.0.self_attn.qkv_proj.weight",
        "language_model.model.layers.0.input_layernorm.weight",
        "language_model.model.layers.3.cross_attn.q_norm.weight",
    ):
        assert split_dim(name) is None
    two = [TensorParallel(r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat([rank_slice(qkv, w, t) for t in two]), w)
    assert torch.equal(torch.cat([rank_slice(down, w, t) for t in two], dim=1), w)
    with pytest.raises(ValueError, match="does not divide"):
        rank_slice(qkv, w, TensorParallel(0, 3))
    # FP8 channel scales follow their rows; a per-tensor scale is one value for every rank.
    assert split_dim(qkv + "_scale") == 0 and split_dim(down + "_scale") is None
    scale = torch.arange(8.0).reshape(8, 1)
    assert torch.equal(torch.cat([rank_slice(qkv + "_scale", scale, t) for t in two]), scale)
    one = torch.ones(1)
    assert all(rank_slice(qkv + "_scale", one, t) is one for t in two)


def test_a_failing_rank_fails_the_other_instead_of_hanging(tmp_path) -> None:
    """Rank 1 cannot load its checkpoint; rank 0, already waiting in the first collective,
    gets an error (its peer left the group) rather than waiting forever."""
    processed = _processed()[:1]
    got = _run_ranks(2, processed, tmp_path, [demo_path(), tmp_path / "missing"])
    assert isinstance(got[1], str) and "config.json" in got[1], got[1]
    assert isinstance(got[0], str), "rank 0 finished without its peer"
