"""The Triton back-end's warm-up runs the ranged prefill kernel at every key-split count a
prefill can choose, so that no count is compiled for the first time while serving."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.ops.triton_prefill import (
    default_prefill_config,
    split_count,
    split_counts,
)


@pytest.mark.parametrize("num_heads, num_sms", [(32, 132), (64, 132), (32, 78), (16, 8)])
def test_split_counts_cover_every_choice(num_heads: int, num_sms: int) -> None:
    """Over prefill sizes up to 4,096 rows and 40,000 keys (the 11B and 90B head counts on an
    H200, and smaller GPUs), ``split_count`` only ever returns listed counts, and reaches
    each of them."""
    for dtype in (torch.bfloat16, torch.float32):
        cfg = default_prefill_config(dtype)
        reachable = {
            split_count(t, num_heads, s, num_sms, cfg)
            for t in range(1, 4097, 7)
            for s in range(1, 40_000, 97)
        }
        assert reachable == set(split_counts(num_heads, num_sms))


def test_warm_up_is_a_no_op_off_cuda() -> None:
    assert TritonBackend(num_sms=132).warm_up(32, 8, 128, torch.float32, torch.device("cpu")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_runs_each_count_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.backends import triton_attn

    ran = []
    real = triton_attn.ranged_cross_attention

    def spy(q, k, v, ranges, scale, *, num_splits=1, **kw):
        ran.append(num_splits)
        out = real(q, k, v, ranges, scale, num_splits=num_splits, **kw)
        # Enough keys that the kernel would choose this count itself.
        assert (
            split_count(q.shape[0], q.shape[1], k.shape[0], 132, default_prefill_config(q.dtype))
            >= num_splits
        )
        return out

    monkeypatch.setattr(triton_attn, "ranged_cross_attention", spy)
    counts = TritonBackend(num_sms=132).warm_up(32, 8, 128, torch.bfloat16, torch.device("cuda"))
    assert counts == ran == split_counts(32, 132)
