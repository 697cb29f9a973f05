"""Tensor parallelism of the model on CPU: two ranks over gloo, each holding its slice of the
tiny demo checkpoint (heads, MLP columns, vocabulary rows), give the prefill logits of one
rank (float32) for prompts with no, one and two images, to the last rounding of the sums."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from helpers.hf_runner import demo_path
from helpers.tp_worker import prefill_logits, run_rank
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


def _run_ranks(size: int, processed: list, tmp_path, paths: list | None = None) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    paths = paths or [demo_path()] * size
    procs = [
        ctx.Process(target=run_rank, args=(r, size, init, paths[r], processed, results))
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


def test_two_ranks_equal_one(tmp_path) -> None:
    processed = _processed()
    want = prefill_logits(demo_path(), processed)
    got = _run_ranks(2, processed, tmp_path)
    for rank in (0, 1):
        assert not isinstance(got[rank], str), got[rank]
        for w, g in zip(want, got[rank], strict=True):
            assert g.shape == w.shape
            # Partial sums of the row-parallel layers add in another order: float32 rounding.
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # Both ranks see the same gathered logits, bitwise.
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)


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


def test_a_failing_rank_fails_the_other_instead_of_hanging(tmp_path) -> None:
    """Rank 1 cannot load its checkpoint; rank 0, already waiting in the first collective,
    gets an error (its peer left the group) rather than waiting forever."""
    processed = _processed()[:1]
    got = _run_ranks(2, processed, tmp_path, [demo_path(), tmp_path / "missing"])
    assert isinstance(got[1], str) and "config.json" in got[1], got[1]
    assert isinstance(got[0], str), "rank 0 finished without its peer"
