"""The Triton decode GEMM against torch (in Triton's interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_kernels import silu_and_mul
from vllm.model_executor.layers.kernel_target import KernelTarget, select_kernels
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.skinny_gemm import (
    _TUNED,
    _TUNED_SILU,
    GemmConfig,
    row_bucket,
    skinny_gemm,
    skinny_gemm_silu,
    tuned_config,
    tuned_silu_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m", [1, 3, 16, 21])
@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 128, num_stages=2),
                                 GemmConfig(32, 64, 256, num_stages=2)])
def test_matches_torch(m: int, cfg: GemmConfig) -> None:
    """Row counts below, at and above the row block; N not a multiple of the column block."""
    x, w = _inputs(m, 80, 512, torch.bfloat16, seed=m)
    y = skinny_gemm(x, w, cfg)
    ref = (x.float() @ w.float().T)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 80)
    # fp32 accumulation in another order, then one bf16 rounding: within 2 bf16 ulps.
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3)


def test_float32_output_is_the_rounded_result_widened() -> None:
    """An fp32 ``out`` gets exactly ``linear(x).float()`` of the kernel's own bf16 result."""
    x, w = _inputs(5, 64, 256, torch.bfloat16)
    cfg = GemmConfig(16, 32, 128, num_stages=2)
    out = torch.full((5, 64), float("nan"), device=DEVICE)
    skinny_gemm(x, w, cfg, out=out)
    assert torch.equal(out, skinny_gemm(x, w, cfg).float())


def test_rejects_k_not_a_multiple_of_the_block() -> None:
    x, w = _inputs(2, 32, 192, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_k"):
        skinny_gemm(x, w, GemmConfig(16, 32, 128))


def _kernel_kinds(layer: Linear, silu: bool = False) -> list[str]:
    """What each kernel-table entry runs: ``skinny``, ``cublaslt`` or ``torch``."""
    names = {"linear_kernel": "skinny", "silu_kernel": "skinny", "_cublaslt_linear": "cublaslt",
             "_torch_linear": "torch"}
    table = layer._silu_kernels if silu else layer._kernels
    return ["none" if k is None else names[k.__qualname__.split(".")[0]] for k in table]


BUCKETS = (1, 8, 16, 24, 64, 128)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kernel_table_takes_the_tuned_gemm_only_where_it_was_faster(device: str) -> None:
    """Chosen at load per row bucket: the Triton GEMM for the tuned (bucket, N, K), cuBLASLt for
    the other decode buckets on CUDA, the default GEMM for any other row count (the last entry)
    and for every entry with torch kernels; fp32 weights never take the Triton GEMM. (Building
    the table launches nothing, so the CUDA target is checked without a GPU too.)"""
    lin = Linear(4096, 4096).to(torch.bfloat16)
    decode = "cublaslt" if device == "cuda" else "torch"
    lin.select_kernels(KernelTarget(torch.device(device), fused=True, row_buckets=BUCKETS))
    assert _kernel_kinds(lin) == ["skinny"] * 3 + [decode] * 3 + ["torch"]  # 16-row tiles
    assert row_bucket(1) == row_bucket(16) == 16 and row_bucket(64) == 64 and row_bucket(65) == 0
    for (bucket, _n, k), cfg in _TUNED.items():
        assert k % cfg.block_k == 0 and cfg.block_m >= min(bucket, 16)
        assert tuned_config(bucket, _n, k, torch.bfloat16) == cfg
        assert tuned_config(bucket, _n, k, torch.float32) is None
    lin.select_kernels(KernelTarget(torch.device(device), fused=False, row_buckets=BUCKETS))
    assert _kernel_kinds(lin) == ["torch"] * 7
    lin32 = Linear(4096, 4096)
    lin32.select_kernels(KernelTarget(torch.device(device), fused=True, row_buckets=BUCKETS))
    assert _kernel_kinds(lin32) == [decode] * 6 + ["torch"]


def test_forward_runs_the_bucket_kernel() -> None:
    """``Linear.forward`` indexes its table with the forward context's row bucket."""
    from vllm.forward_context import set_forward_context

    lin = Linear(8, 4)
    calls = []
    lin._kernels = [lambda x, out, i=i: calls.append(i) or x[:, :4] for i in range(3)]
    x = torch.zeros(2, 8)
    lin(x)  # outside a step: any row count, the last entry
    for bucket in (0, 1):
        with set_forward_context(None, row_bucket=bucket):
            lin(x)
    assert calls == [2, 0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cublaslt_kernel_restores_the_blas_library() -> None:
    from vllm.model_executor.layers.linear import _cublaslt_linear

    lin = Linear(64, 32).cuda().to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_()
    before = torch.backends.cuda.preferred_blas_library()
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(_cublaslt_linear(lin)(x, None), F.linear(x, lin.weight))
    assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(RuntimeError):
        _cublaslt_linear(lin)(torch.randn(8, 63, device="cuda", dtype=torch.bfloat16), None)
    assert torch.backends.cuda.preferred_blas_library() == before


def test_linear_out_argument_matches_float_of_result() -> None:
    """``Linear(x, out=fp32)`` equals ``Linear(x).float()`` whichever kernel serves it."""
    lin = Linear(256, 48).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(0.05 * torch.randn(48, 256))
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    out = torch.empty(3, 48, device=DEVICE)
    assert lin(x, out=out) is out
    assert torch.equal(out, lin(x).float())
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize("m", [1, 5, 16, 21])
def test_silu_epilogue_equals_gemm_then_silu_and_mul(m: int) -> None:
    """The gate|up GEMM with SiLU-and-multiply in its epilogue: bitwise the separate GEMM
    (same config, same accumulation order) followed by ``silu_and_mul``; close to torch."""
    x, w = _inputs(m, 2 * 80, 512, torch.bfloat16, seed=m + 1)
    cfg = GemmConfig(16, 32, 128, num_stages=2)
    y = skinny_gemm_silu(x, w, cfg)
    assert y.shape == (m, 80) and y.dtype == torch.bfloat16
    assert torch.equal(y, silu_and_mul(skinny_gemm(x, w, cfg)))
    ref = F.silu(F.linear(x, w[:80]).float()) * F.linear(x, w[80:]).float()
    # Gate and up within a bf16 rounding of torch's each, then one more rounding: ~3 ulps.
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -5, atol=2 ** -7)


def test_silu_table_only_for_tuned_shapes() -> None:
    """The gate|up layer's fused SiLU kernel where it measured faster (decode buckets up to 64
    rows of the 11B shape); None elsewhere (the GEMM and the activation kernel)."""
    from vllm.model_executor.layers.linear import MergedLinear

    gate_up = MergedLinear(4096, [14336, 14336], ["gate", "up"]).to(torch.bfloat16)
    gate_up.select_kernels(KernelTarget(torch.device("cpu"), fused=True, row_buckets=BUCKETS))
    assert _kernel_kinds(gate_up, silu=True) == ["skinny"] * 5 + ["none"] * 2
    for (bucket, n2, k), cfg in _TUNED_SILU.items():
        assert n2 % 2 == 0 and k % cfg.block_k == 0 and cfg.block_m >= min(bucket, 16)
    for m, bucket in ((1, 16), (16, 16), (24, 32), (64, 64)):
        cfg = tuned_silu_config(m, 2 * 14336, 4096, torch.bfloat16)
        assert cfg == _TUNED_SILU[(bucket, 2 * 14336, 4096)]
    assert tuned_silu_config(65, 2 * 14336, 4096, torch.bfloat16) is None
    qkv = MergedLinear(4096, [4096, 1024, 1024], ["q", "k", "v"]).to(torch.bfloat16)
    qkv.select_kernels(KernelTarget(torch.device("cpu"), fused=True, row_buckets=BUCKETS))
    assert _kernel_kinds(qkv, silu=True) == ["none"] * 7
    with pytest.raises(ValueError, match="input of shape"):
        skinny_gemm_silu(torch.empty(2, 64, dtype=torch.bfloat16, device=DEVICE),
                         torch.empty(63, 64, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.gpu
def test_11b_mlp_with_the_fused_epilogue() -> None:
    """The 11B MLP at decode sizes takes the fused gate|up + SiLU kernel; its output is the
    unfused MLP's within bf16 rounding, and the same in a CUDA graph as eagerly."""
    from types import SimpleNamespace

    from vllm.model_executor.models.mllama import LlamaMLP

    mlp = LlamaMLP(SimpleNamespace(hidden_size=4096, intermediate_size=14336)).cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    mlp = mlp.to(torch.bfloat16)
    sizes = (1, 16, 24, 64)
    select_kernels(mlp, KernelTarget(torch.device("cuda"), fused=True, row_buckets=sizes))
    for bucket, m in enumerate(sizes):
        x = torch.randn(m, 4096, generator=g, device="cuda").bfloat16()
        assert mlp.gate_up_proj._silu_kernels[bucket] is not None
        with torch.no_grad(), set_forward_context(None, row_bucket=bucket):
            y = mlp(x)
            unfused = mlp.down_proj(silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)))
            torch.testing.assert_close(y.float(), unfused.float(), rtol=2 ** -5, atol=1e-2)
            graph, static_x = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                static_y = mlp(static_x)
            graph.replay()
        assert torch.equal(static_y, y)
