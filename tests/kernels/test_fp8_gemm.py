"""The FP8 Triton kernels against the torch reference (Triton's interpreter on CPU, compiled on
CUDA).

Weights are quantized by compressed-tensors' own quantize (when installed) or the engine's
load-time quantizer, and loaded into an FP8 layer through its checkpoint loaders. The
dequantized matrix must equal the reference's ``(fp8 -> scale dtype) * scale`` bitwise; the
GEMM, which applies the channel scale to its float32 accumulator, ``x @ dequantize(W)^T`` to
within the reference's own weight rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from helpers.compare import assert_epilogue_matches

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers import fp8_gemm
from vllm.model_executor.layers.fp8_gemm import Fp8Config
from vllm.model_executor.layers.fused_kernels import silu_and_mul
from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.quantization.fp8 import Fp8Format, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def fp8_layer(
    shards: list[int],
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    scale_dtype: torch.dtype = torch.bfloat16,
    per_tensor: bool = False,
    seed: int = 0,
    bias: bool = False,
) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """An FP8 layer loaded with quantized shards; returns it, the fp8 matrix and its scales
    ([N], in ``scale_dtype``) as the checkpoint would hold them stacked."""
    g = torch.Generator().manual_seed(seed)
    fmt = Fp8Format(per_tensor=per_tensor, dtype=dtype)
    names = ["q", "k", "v"] if len(shards) == 3 else ["gate", "up"][: len(shards)]
    if len(shards) > 1:
        layer = MergedLinear(k, shards, names, fmt=fmt)
    else:
        layer = Linear(k, shards[0], bias=bias, fmt=fmt)
        names = [None]  # type: ignore[list-item]
    layer = layer.to(DEVICE)
    qs, ss = [], []
    for name, n in zip(names, shards, strict=True):
        # A spread of magnitudes so that FP8 subnormals and the top of the range occur.
        w = (
            torch.randn(n, k, generator=g)
            * torch.logspace(-4, 0, k)[torch.randperm(k, generator=g)]
        )
        q, s = quantize_fp8(w.to(scale_dtype), per_tensor=per_tensor)
        layer.weight.weight_loader(layer.weight, q.to(DEVICE), name)
        layer.weight_scale.weight_loader(layer.weight_scale, s.to(DEVICE), name)
        qs.append(q)
        ss.append(s.reshape(-1).expand(n))
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(shards[0], generator=g).to(dtype))
    return layer, torch.cat(qs).to(DEVICE), torch.cat(ss).to(DEVICE)


def reference_weight(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' decompression: ``q.to(scale.dtype) * scale``, then the dtype."""
    return (q.to(s.dtype) * s[:, None]).to(dtype)


def assert_close_to_reference(
    y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor
) -> None:
    """The reference rounds each weight to bf16 first (relative error <= 2^-9 each): the
    kernel's result differs from its product by at most that share of sum |x w|, plus the
    output roundings."""
    ref = x.float() @ reference_weight(q, s, torch.bfloat16).float().T
    bound = 2**-9 * (x.float().abs() @ (q.float().abs() * s[:, None]).T)
    assert ((y.float() - ref).abs() <= bound + 2**-7 * ref.abs() + 1e-6).all()


CASES = [
    ([80, 48, 48], 256, torch.bfloat16, torch.bfloat16, False),
    ([64], 128, torch.float16, torch.bfloat16, False),
    ([96], 384, torch.bfloat16, torch.float32, False),
    ([48, 48], 128, torch.bfloat16, torch.bfloat16, True),
    ([40], 64, torch.float32, torch.float32, True),
]


@pytest.mark.parametrize(("shards", "k", "dtype", "scale_dtype", "per_tensor"), CASES)
def test_dequantized_matrix_is_the_reference_bitwise(
    shards, k, dtype, scale_dtype, per_tensor
) -> None:
    layer, q, s = fp8_layer(shards, k, dtype, scale_dtype, per_tensor)
    fmt = layer.fmt
    assert isinstance(fmt, Fp8Format) and layer.fp8_scale_dtype == scale_dtype
    ref = reference_weight(q, s, dtype)
    out = torch.full_like(ref, float("nan"))
    fp8_gemm.dequantize(fmt.fp8_weight(layer), out)
    assert same_bits(out, ref)
    assert same_bits(fmt.dequantize(layer, dtype), ref)  # the torch path, the same values


CONFIGS = [
    Fp8Config(16, 32, 128, num_stages=2),  # tensor cores
    Fp8Config(32, 64, 64, num_stages=2),
    Fp8Config(1, 64, 128),  # CUDA cores
    Fp8Config(4, 16, 64, split_k=2),  # CUDA cores, K split over two programs
    Fp8Config(16, 16, 64, split_k=4),  # tensor cores, K split
    Fp8Config(16, 16, 64, swap=True),  # the weight tile as the dot's first operand
    Fp8Config(16, 32, 64, split_k=2, swap=True),  # and its K split summed in one launch
    Fp8Config(32, 64, 64, split_k=4, swap=True),
]


@pytest.mark.parametrize("m", [1, 3, 16, 21])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_gemm_matches_dequantize_and_matmul(m: int, cfg: Fp8Config) -> None:
    """Rows below, at and above the row block; N (176) not a multiple of the column block."""
    layer, q, s = fp8_layer([80, 48, 48], 256, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    y = fp8_gemm.fp8_gemm(x, layer.fmt.fp8_weight(layer, max_rows=32), cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 176)
    # The kernel's own math: exact products, the scale on the float32 sum, one rounding.
    exact = (x.float() @ q.float().T) * s.float()
    torch.testing.assert_close(y.float(), exact, rtol=2**-7, atol=1e-3)
    assert_close_to_reference(y, x, q, s)


def test_fp16_gemm_float32_scales_and_float32_out() -> None:
    """fp16 activations, float32 scales; an fp32 ``out`` gets the kernel's result widened."""
    layer, q, s = fp8_layer([96], 384, torch.float16, torch.float32)
    fw = layer.fmt.fp8_weight(layer)
    x = torch.randn(5, 384).to(DEVICE, torch.float16)
    cfg = Fp8Config(16, 32, 128, num_stages=2)
    out = torch.full((5, 96), float("nan"), device=DEVICE)
    fp8_gemm.fp8_gemm(x, fw, cfg, out=out)
    assert torch.equal(out, fp8_gemm.fp8_gemm(x, fw, cfg).float())
    torch.testing.assert_close(out, (x.float() @ q.float().T) * s, rtol=2**-9, atol=1e-3)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[6]], ids=str)
def test_silu_epilogue_equals_gemm_then_silu_and_mul(m: int, cfg: Fp8Config) -> None:
    """gate|up with SiLU-and-multiply in the epilogue: the GEMM (same config) then
    ``silu_and_mul``, bitwise on CUDA (``assert_epilogue_matches``); close to the torch
    reference."""
    layer, q, s = fp8_layer([80, 80], 256, seed=m + 3)
    fw = layer.fmt.fp8_weight(layer, max_rows=32)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g).to(DEVICE, torch.bfloat16)
    y = fp8_gemm.fp8_gemm_silu(x, fw, cfg)
    assert y.shape == (m, 80)
    assert_epilogue_matches(y, silu_and_mul(fp8_gemm.fp8_gemm(x, fw, cfg)))
    exact = (x.float() @ q.float().T) * s  # the kernel's math in float32
    expected = F.silu(exact[:, :80]) * exact[:, 80:]
    torch.testing.assert_close(y.float(), expected, rtol=2**-5, atol=2**-7)


@triton.jit
def _convert_tile(
    w_ptr, o_ptr, PTX: tl.constexpr, PACK: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    i = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(o_ptr + i, fp8_gemm._e4m3_to_bf16(tl.load(w_ptr + i), PTX, PACK))


@pytest.mark.parametrize("pack", [2, 4])
def test_e4m3_to_bf16_bit_moves_are_exact_for_every_code(pack: int) -> None:
    """The kernels' e4m3 -> bf16 conversion (either PTX form when compiled, its Triton form
    interpreted) equals torch's cast bitwise on every code but the two NaNs (which become
    +-480), subnormals and both zeros included, wherever a code sits in a tile."""
    g = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.arange(256), torch.randint(0, 256, (32 * 128 - 256,), generator=g)])
    codes = codes[torch.randperm(codes.numel(), generator=g)].to(torch.uint8).view(32, 128)
    w = codes.view(torch.float8_e4m3fn).to(DEVICE)
    out = torch.empty(32, 128, dtype=torch.bfloat16, device=DEVICE)
    _convert_tile[(1,)](w, out, PTX=not fp8_gemm._INTERPRETED, PACK=pack, R=32, C=128)
    expected = w.to(torch.bfloat16)
    nan = torch.isnan(expected)
    assert nan.sum() >= 2
    assert same_bits(out[~nan], expected[~nan])
    assert torch.equal(out[nan].abs().float().cpu(), torch.full((int(nan.sum()),), 480.0))


def test_swapped_split_sums_in_one_order_and_resets_its_counters() -> None:
    """The swapped kernel's in-launch K split: the same bits on every call (the last program
    of a tile adds the partials in split order whichever it is), every counter back at zero
    after a call, and a clear error for a weight without counters."""
    layer, q, s = fp8_layer([96], 512, seed=7)
    fw = layer.fmt.fp8_weight(layer, max_rows=16)
    x = torch.randn(3, 512).to(DEVICE, torch.bfloat16)
    cfg = Fp8Config(16, 16, 64, split_k=4, swap=True)
    first = fp8_gemm.fp8_gemm(x, fw, cfg)
    assert fw.counters is not None and not fw.counters.any()
    for _ in range(3):
        assert torch.equal(fp8_gemm.fp8_gemm(x, fw, cfg), first)
    assert not fw.counters.any()
    one = fp8_gemm.fp8_gemm(x, fw, Fp8Config(16, 16, 64, swap=True))
    torch.testing.assert_close(first.float(), one.float(), rtol=2**-7, atol=1e-3)
    with pytest.raises(ValueError, match="counters"):
        fp8_gemm.fp8_gemm(x, layer.fmt.fp8_weight(layer), cfg)
    with pytest.raises(ValueError, match="16 wide"):
        fp8_gemm.fp8_gemm(x, fw, Fp8Config(8, 16, 64, swap=True))


def test_default_configs() -> None:
    """Without a tuned table: up to 16 rows the tensor-core kernel with a 16-row tile (no K
    split for wide outputs, two otherwise), up to 64 the swapped kernel; every default divides
    the 11B and 90B shapes' K and its row tile covers the bucket (up to 64 rows)."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    shapes += ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672))  # 90B
    for m in (1, 2, 4, 8, 16, 24, 64, 256):
        for n, k in shapes:
            cfg = fp8_gemm.default_config(m, n, k)
            assert cfg.fits(k) and cfg.block_m >= min(m, 64) and not cfg.cuda_cores
            assert cfg.swap == (16 < m <= 64)
    one = fp8_gemm.default_config(1, 4096, 4096)
    assert (one.block_m, one.block_n, one.block_k, one.split_k) == (16, 32, 256, 2)
    assert fp8_gemm.default_config(4, 14336, 4096).split_k == 1
    assert fp8_gemm.default_config(64, 4096, 4096).split_k == 4  # 64 tiles: split
    assert fp8_gemm.default_config(64, 14336, 4096).split_k == 1


def test_default_config_runs_without_counters() -> None:
    """A weight without split counters still runs its default (the split dropped): the same
    values to rounding as with them."""
    layer, q, s = fp8_layer([96], 512, seed=3)
    x = torch.randn(2, 512).to(DEVICE, torch.bfloat16)
    plain = fp8_gemm.fp8_gemm(x, layer.fmt.fp8_weight(layer))
    split = fp8_gemm.fp8_gemm(x, layer.fmt.fp8_weight(layer, max_rows=8))
    torch.testing.assert_close(plain.float(), split.float(), rtol=2**-7, atol=1e-3)
    assert_close_to_reference(split, x, q, s)


def test_tuned_table_entries(tmp_path, monkeypatch) -> None:
    """A GPU model's tuned table gives a shape's row counts their config (the entry of the
    smallest tuned row count >= m) or the scratch path; other shapes, row counts above the
    table and configs that do not fit K fall back to the defaults."""
    monkeypatch.setattr(fp8_gemm.TUNED, "folder", tmp_path)
    fp8_gemm.TUNED.cache_clear()
    key = fp8_gemm.table_key(4096, 4096, False)
    table = {
        "configs": {
            key: {"1": vars(Fp8Config(1, 32, 128, split_k=4)), "8": "scratch"},
            fp8_gemm.table_key(64, 96, False): {"1": vars(Fp8Config(1, 32, 128))},
        }
    }
    fp8_gemm.tuned_table_path("Some GPU").write_text(json.dumps(table))
    try:
        assert fp8_gemm.decode_config(1, 4096, 4096, device_name="Some GPU") == Fp8Config(
            1, 32, 128, split_k=4
        )
        assert fp8_gemm.decode_config(4, 4096, 4096, device_name="Some GPU") is None
        for m, n, k, gpu in (
            (16, 4096, 4096, "Some GPU"),
            (1, 4096, 4096, ""),
            (1, 64, 96, "Some GPU"),
        ):
            got = fp8_gemm.decode_config(m, n, k, device_name=gpu)
            assert got == fp8_gemm.default_config(m, n, k)
    finally:
        fp8_gemm.TUNED.cache_clear()


def _kinds(table: list) -> list[str]:
    names = {
        "linear_kernel": "fp8",
        "silu_kernel": "fp8",
        "_scratch_kernel": "scratch",
        "torch_kernel": "torch",
    }
    return ["none" if k is None else names[k.__qualname__.split(".")[-3]] for k in table]


BUCKETS = (1, 8, 24)


def test_kernel_tables_and_their_results() -> None:
    """Decode buckets run the FP8 GEMM; any other row count dequantizes into the shared scratch
    and runs F.linear (bitwise the torch path); biased layers take the scratch path everywhere;
    torch targets the torch path. gate|up gets the SiLU epilogue per bucket."""
    layer, q, s = fp8_layer([80, 80], 256)
    fused = KernelTarget(torch.device(DEVICE), fused=True, row_buckets=BUCKETS)
    layer.select_kernels(fused)
    assert _kinds(layer._kernels) == ["fp8"] * 3 + ["scratch"]
    assert _kinds(layer._silu_kernels) == ["fp8"] * 3 + ["none"]
    torch_path = layer.fmt.torch_kernel(layer)
    assert torch.equal(
        torch_path(x := torch.randn(4, 256).to(DEVICE, torch.bfloat16), None),
        F.linear(x, reference_weight(q, s, torch.bfloat16)),
    )
    for bucket, rows in enumerate(BUCKETS):
        x = torch.randn(rows, 256).to(DEVICE, torch.bfloat16)
        with set_forward_context(None, row_bucket=bucket):
            assert_close_to_reference(layer(x), x, q, s)
    x = torch.randn(2, 7, 256).to(DEVICE, torch.bfloat16)  # prefill-shaped input
    assert torch.equal(layer(x), torch_path(x, None))
    layer.select_kernels(KernelTarget(torch.device(DEVICE), fused=False, row_buckets=BUCKETS))
    assert _kinds(layer._kernels) == ["torch"] * 4
    biased, _, _ = fp8_layer([64], 128, bias=True)
    biased.select_kernels(fused)
    assert _kinds(biased._kernels) == ["scratch"] * 4
    x = torch.randn(3, 128).to(DEVICE, torch.bfloat16)
    with set_forward_context(None, row_bucket=0):
        assert torch.equal(biased(x), biased.fmt.torch_kernel(biased)(x, None))


def test_compressed_tensors_quantize_is_the_load_time_quantizer() -> None:
    """The load-time quantizer gives compressed-tensors' own FP8 values and scales, bitwise."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = ct.preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights
    w = (torch.randn(64, 96) * torch.logspace(-5, 1, 96)).to(torch.bfloat16)
    w[3] = 0  # an all-zero row: its scale is replaced by eps
    scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    expected = quantize(w, scale, zp, args, dtype=torch.float8_e4m3fn)
    q, s = quantize_fp8(w)
    assert same_bits(s, scale) and torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_graph_replay_equals_eager() -> None:
    """Same bucket, same kernel: a captured FP8 GEMM replays bitwise what eager computes."""
    layer, _, _ = fp8_layer([4096, 1024, 1024], 4096)
    layer.select_kernels(KernelTarget(torch.device("cuda"), fused=True, row_buckets=(1, 16)))
    for bucket, rows in enumerate((1, 16)):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), set_forward_context(None, row_bucket=bucket):
            eager = layer(x)
            graph, static_x = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                static_y = layer(static_x)
            graph.replay()
        assert torch.equal(static_y, eager)
