"""Every Triton kernel of the engine addresses memory past 2^31 elements correctly.

A long prefill makes ``row * stride`` products larger than a 32-bit integer holds (81,920 tokens
x the 28,672-wide gate|up output is 2.3e9): computed in int32 they wrap, and the kernel reads or
writes far outside its tensors (on the GPU: "an illegal memory access", which kills the CUDA
context). Here each kernel runs on views whose strides put some rows past 2^31 elements, over
buffers that are allocated but never touched except at those rows (on CPU the pages stay
virtual, so a 4-8 GiB buffer costs a few KiB). In Triton's interpreter a wrapped offset is an
access outside every argument tensor, which the bounds checks (``tests/conftest.py``) reject;
on a GPU the same tests run compiled, with real allocations of a few GiB.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.attention.ops import reference as ref
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_kv_write import rope_and_write_kv_cache, write_kv_cache
from vllm.attention.ops.triton_prefill import PrefillConfig, ranged_cross_attention
from vllm.model_executor.layers.fused_kernels import (
    add_layer_norm,
    gate_rows,
    rms_norm,
    rotary_inplace,
    silu_and_mul,
)
from vllm.model_executor.layers.layernorm import masked_gate_ref, rms_norm_ref
from vllm.model_executor.layers.skinny_gemm import GemmConfig, skinny_gemm
from vllm.model_executor.layers.triton_argmax import argmax_rows
from vllm.worker.row_advance import advance_rows, gather_rows

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BIG = 1 << 30  # a row stride in elements: row 2 starts at 2^31
DT = torch.float16  # half precision where the interpreter computes it right (bf16 it does not)
TOL = {"atol": 2e-2, "rtol": 2e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows_past_2_31(
    n: int, width: int, dtype: torch.dtype = DT, seed: int = 0, stride: int = BIG
) -> torch.Tensor:
    """[n, width] with row stride ``stride`` (rows 2.. start past 2^31 elements); only the
    rows themselves are written."""
    storage = torch.empty((n - 1) * stride + width, dtype=dtype, device=DEVICE)
    view = storage.as_strided((n, width), (stride, 1))
    values = torch.randn(n, width, generator=_gen(seed))
    view.copy_(values.to(dtype) if dtype.is_floating_point else values.abs().to(dtype))
    return view


def test_views_reach_past_2_31() -> None:
    x = rows_past_2_31(3, 8)
    assert x.stride(0) * (x.shape[0] - 1) >= 1 << 31


def test_rms_norm() -> None:
    x, res = rows_past_2_31(3, 64, seed=1), rows_past_2_31(3, 64, seed=2)
    w = (1 + 0.1 * torch.randn(64, generator=_gen(3))).to(DEVICE, DT)
    expected_res = (x + res).clone()
    expected = rms_norm_ref(expected_res, w, 1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL)
    out = rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(res, expected_res, **TOL)
    gate = torch.tensor([0.7], dtype=DT, device=DEVICE)
    mask = torch.tensor([[True], [False], [True]], device=DEVICE)
    res2 = rows_past_2_31(3, 64, seed=4)
    expected_res2 = res2 + masked_gate_ref(x, gate, mask)
    rms_norm(x, w, 1e-5, res2, gate=gate, row_mask=mask)
    torch.testing.assert_close(res2, expected_res2, **TOL)


def test_gate_rows() -> None:
    x = rows_past_2_31(3, 96, seed=5)
    gate = torch.tensor([1.3], dtype=DT, device=DEVICE)
    mask = torch.tensor([[False], [True], [True]], device=DEVICE)
    torch.testing.assert_close(gate_rows(x, gate, mask), masked_gate_ref(x, gate, mask), **TOL)


def test_silu_and_mul() -> None:
    """The kernel behind the 81,920-token crash: gate|up rows of 28,672 elements."""
    x = rows_past_2_31(3, 96, seed=5)
    expected = (F.silu(x[:, :48].float()) * x[:, 48:].float()).to(DT)
    torch.testing.assert_close(silu_and_mul(x), expected, **TOL)


def test_rotary_inplace() -> None:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.transformers_utils.config import RopeSpec

    rope = RotaryEmbedding(16, 64, RopeSpec(theta=10000.0)).to(DEVICE)
    q, k = rows_past_2_31(3, 4 * 16, seed=6), rows_past_2_31(3, 2 * 16, seed=7)
    positions = torch.tensor([3, 0, 17], device=DEVICE)
    expected_q, expected_k = rope(positions, q.clone(), k.clone())  # torch path
    rotary_inplace(positions, q, k, rope.cos_cache, rope.sin_cache, 16)
    torch.testing.assert_close(q, expected_q, **TOL)
    torch.testing.assert_close(k, expected_k, **TOL)


def test_add_layer_norm() -> None:
    x, delta = rows_past_2_31(3, 80, seed=8), rows_past_2_31(3, 80, seed=9)
    w = (1 + 0.1 * torch.randn(80, generator=_gen(10))).to(DEVICE, DT)
    b = (0.1 * torch.randn(80, generator=_gen(11))).to(DEVICE, DT)
    gate = torch.tensor([0.5], dtype=DT, device=DEVICE)
    s, y = add_layer_norm(x, w, b, 1e-5, delta, gate)
    expected_s = x + gate * delta
    torch.testing.assert_close(s, expected_s, **TOL)
    torch.testing.assert_close(
        y, F.layer_norm(expected_s.float(), (80,), w.float(), b.float(), 1e-5).to(DT), **TOL
    )


def test_skinny_gemm() -> None:
    x = rows_past_2_31(3, 256, seed=12)
    w = (0.05 * torch.randn(32, 256, generator=_gen(13))).to(DEVICE, DT)
    got = skinny_gemm(x, w, GemmConfig(16, 32, 128, num_stages=2))
    torch.testing.assert_close(got, F.linear(x.contiguous(), w), **TOL)


@pytest.mark.parametrize("kernel", ["cuda-cores", "mma"])
def test_nf4_gemm(kernel: str) -> None:
    """The 4-bit GEMMs reading activations and writing outputs past 2^31 elements."""
    pytest.importorskip("bitsandbytes")  # builds the layer (a test dependency)
    from helpers.bnb_checkpoints import bnb_layer

    from vllm.model_executor.layers.nf4_gemm import Nf4Config, nf4_gemm

    layer, w = bnb_layer([48, 16], 256, dtype=DT)
    x = rows_past_2_31(3, 256, seed=15)
    out = rows_past_2_31(3, 64, seed=16)
    cfg = Nf4Config(4, 32, num_stages=2)
    if kernel == "mma":  # blocks of 64, four an iteration; 32 weight rows on two warps
        cfg = Nf4Config(8, 32, 4, num_warps=2, mma=True)
    nf4_gemm(x, layer.fmt.quantized_weight(layer), cfg, out)
    torch.testing.assert_close(out, F.linear(x.contiguous(), w), **TOL)


def test_fp8_gemm_and_dequantize() -> None:
    """The FP8 GEMM reading activations and writing outputs past 2^31 elements, and the
    dequantization writing matrix rows there."""
    from vllm.model_executor.layers.fp8_gemm import Fp8Config, Fp8Weight, dequantize, fp8_gemm
    from vllm.model_executor.layers.quantization.fp8 import quantize_fp8

    w = (0.05 * torch.randn(64, 256, generator=_gen(17))).to(DEVICE, DT)
    q, s = quantize_fp8(w)
    fw = Fp8Weight(q, s.view(-1).float(), DT)
    dense = (q.to(DT) * s).to(DT)
    x = rows_past_2_31(3, 256, seed=18)
    out = rows_past_2_31(3, 64, seed=19)
    for cfg in (Fp8Config(16, 32, 128, num_stages=2), Fp8Config(2, 32, 64, split_k=2)):
        fp8_gemm(x, fw, cfg, out)
        torch.testing.assert_close(out, F.linear(x.contiguous(), dense), **TOL)
    matrix = rows_past_2_31(17, 256, seed=20, stride=BIG // 8)  # row 16 starts at 2^31
    dequantize(Fp8Weight(q[:17], fw.scale[:17], DT), matrix)
    assert torch.equal(matrix.contiguous(), dense[:17])


def test_argmax_rows() -> None:
    logits = rows_past_2_31(3, 5000, dtype=torch.float32, seed=14)
    assert torch.equal(argmax_rows(logits, block=2048), logits.argmax(dim=-1))


def _cache_past_2_31(pages: int, hkv: int, page: int, d: int, seed: int) -> torch.Tensor:
    """[pages, hkv, page, d] with a page stride that puts pages 2.. past 2^31 elements."""
    flat = rows_past_2_31(pages, hkv * page * d, seed=seed)
    return flat.as_strided((pages, hkv, page, d), (BIG, page * d, d, 1))


def test_kv_write_and_paged_decode() -> None:
    hq, hkv, d, page = 4, 2, 16, 4
    kc, vc = _cache_past_2_31(3, hkv, page, d, 15), _cache_past_2_31(3, hkv, page, d, 16)
    key, value = rows_past_2_31(2, hkv * d, seed=17), rows_past_2_31(2, hkv * d, seed=18)
    slots = torch.tensor([2 * page + 1, 1 * page + 3], dtype=torch.int64, device=DEVICE)
    k3, v3 = key.view(2, hkv, d), value.view(2, hkv, d)
    write_kv_cache(k3, v3, kc, vc, slots)
    assert torch.equal(kc[2, :, 1], k3[0]) and torch.equal(vc[1, :, 3], v3[1])
    q = rows_past_2_31(3, hq * d, seed=19).view(3, hq, d)
    tables = torch.tensor([[2, 1], [1, 2], [2, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([8, 5, 3], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(
        q, kc, vc, tables, lens, 0.3, config=DecodeConfig(num_segments=2, block_n=16, min_chunk=16)
    )
    torch.testing.assert_close(got, ref.paged_decode_attention(q, kc, vc, tables, lens, 0.3), **TOL)


def test_rope_and_write_kv_cache() -> None:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.transformers_utils.config import RopeSpec

    hq, hkv, d, page = 4, 2, 16, 4
    rope = RotaryEmbedding(d, 64, RopeSpec(theta=10000.0)).to(DEVICE)
    qkv = rows_past_2_31(3, (hq + 2 * hkv) * d, seed=20)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    kc, vc = _cache_past_2_31(3, hkv, page, d, 21), _cache_past_2_31(3, hkv, page, d, 22)
    positions = torch.tensor([5, 1, 9], device=DEVICE)
    slots = torch.tensor([2 * page, -1, page + 2], dtype=torch.int64, device=DEVICE)
    expected_q, expected_k = rope(positions, q.clone(), k.clone())
    rope_and_write_kv_cache(positions, q, k, v, rope.cos_cache, rope.sin_cache, kc, vc, slots)
    torch.testing.assert_close(q, expected_q, **TOL)
    torch.testing.assert_close(kc[2, :, 0], expected_k[0].view(hkv, d), **TOL)
    assert torch.equal(vc[1, :, 2], v[2].view(hkv, d))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_ranged_cross_attention(num_splits: int) -> None:
    hq, hkv, d = 4, 2, 16
    q = rows_past_2_31(3, hq * d, seed=23).view(3, hq, d)
    k, v = (
        rows_past_2_31(40, hkv * d, seed=s, stride=BIG // 16).view(40, hkv, d) for s in (24, 25)
    )
    ranges = torch.tensor([[0, 40], [0, 0], [5, 33]], dtype=torch.int32, device=DEVICE)
    got = ranged_cross_attention(
        q,
        k,
        v,
        ranges,
        0.3,
        num_splits=num_splits,
        config=PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    )
    expected = ref.ranged_cross_attention(q, k, v, [(0, 1, 0, 40), (2, 3, 5, 33)], 0.3)
    torch.testing.assert_close(got, expected, **TOL)


def test_decode_rows_gather_and_advance() -> None:
    tables = rows_past_2_31(4, 8, dtype=torch.int32, seed=26)
    cross = rows_past_2_31(4, 4, dtype=torch.int32, seed=27)
    tokens = torch.tensor([5, 6, 7, 8], device=DEVICE)
    positions = torch.tensor([3, 9, 0, -1], device=DEVICE)
    enc = torch.tensor([0, 4, 2, 0], dtype=torch.int32, device=DEVICE)
    kv_ids = torch.tensor([0, 1, 1, 3], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([2, 1, 3], device=DEVICE)
    ids, pos, lens, slots, bt, enc_out, ct, kv_out = gather_rows(
        rows, tokens, positions, tables, enc, cross, kv_ids, 4, 3, 2
    )
    assert kv_out.tolist() == [1, 1, 3]
    assert torch.equal(bt, tables[rows, :3]) and torch.equal(ct, cross[rows, :2])
    assert ids.tolist() == [7, 6, 8] and enc_out.tolist() == [2, 4, 0]
    assert slots.tolist() == [int(tables[2, 0]) * 4, int(tables[1, 2]) * 4 + 1, -1]
    advance_rows(rows, torch.tensor([1, 2, 3], device=DEVICE), tokens, positions, null_row=3)
    assert tokens.tolist() == [5, 2, 1, 8] and positions.tolist() == [3, 10, 1, -1]
