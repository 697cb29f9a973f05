"""The fused GEMM + bias + exact GELU against torch: ``F.gelu(F.linear(x, w, b))``.

Without a GPU it runs in Triton's interpreter on CPU tensors (tests/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.gemm_gelu import GemmGeluConfig, _tma_ok, linear_gelu

CUDA = torch.cuda.is_available()
SMALL = GemmGeluConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4,
                       num_stages=2)
TMA = dataclasses.replace(SMALL, tma=True)
PERSISTENT = dataclasses.replace(SMALL, tma=True, persistent=True)


@pytest.mark.parametrize("cfg", [SMALL, TMA, PERSISTENT], ids=["pointers", "tma", "persistent"])
@pytest.mark.parametrize("m,k,n", [(37, 40, 52), (37, 48, 56), (64, 32, 96), (1, 16, 16),
                                   (0, 16, 32)])
def test_matches_torch_in_float32(m: int, k: int, n: int, cfg: GemmGeluConfig) -> None:
    """Ragged rows, columns and K (masks or descriptor bounds), several row groups and tiles
    per persistent program, an empty input."""
    g = torch.Generator().manual_seed(m + k + n)
    dev = "cuda" if CUDA else "cpu"
    x = torch.randn(m, k, generator=g).to(dev)
    w = torch.randn(n, k, generator=g).to(dev)
    b = torch.randn(n, generator=g).to(dev)
    ref = F.gelu(x.double() @ w.double().T + b.double()).float()
    if cfg.tma and m:
        assert _tma_ok(x, w, torch.empty(m, n, device=dev))  # the descriptor path is taken
    out = linear_gelu(x, w, b, cfg)
    # Float32 inputs: the GPU's tensor cores may use TF32; the interpreter is exact.
    tol = 3e-2 if CUDA else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_batched_input_keeps_its_leading_dims() -> None:
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if CUDA else "cpu"
    x = torch.randn(2, 9, 32, generator=g).to(dev)
    w, b = torch.randn(48, 32, generator=g).to(dev), torch.randn(48, generator=g).to(dev)
    out = linear_gelu(x, w, b, SMALL)
    assert out.shape == (2, 9, 48)
    torch.testing.assert_close(out[1], linear_gelu(x[1], w, b, SMALL))


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core path: CUDA only")
def test_bf16_within_one_rounding_of_exact() -> None:
    """At the vision MLP's shape in bf16: one rounding of the exact value (torch's two-rounding
    path is at most one ulp further)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6432, 1280, generator=g) * 0.5).to("cuda", torch.bfloat16)
    w = (torch.randn(5120, 1280, generator=g) * 0.03).to("cuda", torch.bfloat16)
    b = (torch.randn(5120, generator=g) * 0.1).to("cuda", torch.bfloat16)
    exact = F.gelu(x.float() @ w.float().T + b.float())
    ours = linear_gelu(x, w, b).float()
    torch_path = F.gelu(F.linear(x, w, b)).float()
    ulp = exact.abs().clamp(min=2.0 ** -126) * 2.0 ** -7  # bf16 spacing (upper bound)
    assert ((ours - exact).abs() <= ulp).float().mean() > 0.999
    assert (ours - exact).abs().max() <= (torch_path - exact).abs().max() * 1.01 + 1e-6
