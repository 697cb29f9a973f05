"""Fused elementwise Triton kernels against their torch references.

Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); on CUDA the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.fused_kernels import (
    add_layer_norm,
    gate_rows,
    rms_norm,
    rotary_inplace,
    silu_and_mul,
    vision_embed_norm,
)
from vllm.model_executor.layers.layernorm import rms_norm_ref
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.transformers_utils.config import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, shape, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[1], generator=g)).to(DEVICE, dtype)
    res = torch.randn(shape, generator=g).to(DEVICE, dtype) if with_residual else None
    expected_res = (res + x) if res is not None else None
    expected = rms_norm_ref(expected_res if res is not None else x, w, 1e-5)
    res_in = res.clone() if res is not None else None
    out = rms_norm(x, w, 1e-5, res_in)
    assert torch.allclose(out.float(), expected.float(), atol=_tol(dtype), rtol=_tol(dtype))
    if res is not None:  # residual updated in place, rounded as the reference rounds
        if DEVICE == "cpu" and dtype == torch.bfloat16:
            # Triton's interpreter rounds float32 -> bf16 differently from the GPU: 1 ulp.
            assert torch.allclose(res_in.float(), expected_res.float(), rtol=8e-3, atol=0)
        else:
            assert torch.equal(res_in, expected_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 128), (4, 2 * 1500)])
def test_silu_and_mul(dtype, shape) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    d = shape[1] // 2
    expected = (F.silu(x[:, :d].float()) * x[:, d:].float())
    assert torch.allclose(silu_and_mul(x).float(), expected, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 16), (32, 8, 128)])
def test_rotary_inplace_matches_reference(dtype, heads) -> None:
    hq, hkv, d = heads
    rope = RopeSpec(rope_type="llama3", theta=500000.0, factor=8.0)
    ref = RotaryEmbedding(d, 4096, rope)
    g = torch.Generator().manual_seed(2)
    t = 7
    positions = torch.tensor([0, 1, 5, 100, 2047, 4095, -1])
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]
    exp_q, exp_k = ref(positions.clamp(min=0), q.clone(), k.clone())  # torch path (CPU)
    dev_qkv = qkv.to(DEVICE)
    dq, dk = dev_qkv[:, :hq * d], dev_qkv[:, hq * d:(hq + hkv) * d]
    v_before = dev_qkv[:, (hq + hkv) * d:].clone()
    rotary_inplace(positions.to(DEVICE), dq, dk, ref.cos_cache.to(DEVICE),
                   ref.sin_cache.to(DEVICE), d)
    assert torch.allclose(dq.float().cpu(), exp_q.float(), atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.allclose(dk.float().cpu(), exp_k.float(), atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.equal(dev_qkv[:, (hq + hkv) * d:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rows_and_gated_residual_norm(dtype) -> None:
    """gate * where(mask, x, 0), alone and fused into the residual add + norm; NaN rows that
    are masked out stay out."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    x[1] = float("nan")
    res = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE, dtype)
    gate = torch.tensor([0.7], dtype=dtype, device=DEVICE)
    mask = torch.tensor([[True], [False], [True], [False], [True]], device=DEVICE)
    expected = gate * torch.where(mask, x, torch.zeros_like(x))
    got = gate_rows(x, gate, mask)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), expected.float(), atol=_tol(dtype), rtol=_tol(dtype))
    exp_res = res + expected
    exp_out = rms_norm_ref(exp_res, w, 1e-5)
    res_in = res.clone()
    out = rms_norm(x, w, 1e-5, res_in, gate=gate, row_mask=mask)
    assert torch.allclose(out.float(), exp_out.float(), atol=2 * _tol(dtype), rtol=2 * _tol(dtype))
    assert torch.allclose(res_in.float(), exp_res.float(), atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (2, 5, 96), (3, 1280)])
@pytest.mark.parametrize("mode", ["norm", "add", "gated"])
def test_add_layer_norm(dtype, shape, mode: str) -> None:
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    delta = torch.randn(shape, generator=g).to(DEVICE, dtype) if mode != "norm" else None
    gate = torch.randn(1, generator=g).tanh().to(DEVICE, dtype) if mode == "gated" else None
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    expected_sum = x if delta is None else x + (gate * delta if gate is not None else delta)
    expected = F.layer_norm(expected_sum, (shape[-1],), w, b, 1e-5)
    s, out = add_layer_norm(x, w, b, 1e-5, delta, gate)
    assert s.shape == out.shape == x.shape
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        # Triton's interpreter rounds float32 -> bf16 differently from the GPU: 1 ulp of the
        # operands (values ~N(0, 1)) per rounding, two with a gate.
        assert torch.allclose(s.float(), expected_sum.float(), rtol=1.6e-2, atol=3e-2)
    elif mode == "gated" and dtype == torch.float32:
        # float32: the compiler may contract the gated multiply and the add (one rounding
        # fewer than the two torch ops): at most one ulp of the operands (values ~N(0, 1)).
        ulp = 2.0**-23
        assert torch.allclose(s.float(), expected_sum.float(), rtol=ulp, atol=4 * ulp)
    else:
        # rounded as the torch ops round (bf16 gated products through integer rounding)
        assert torch.equal(s, expected_sum)
    assert torch.allclose(out.float(), expected.float(), atol=_tol(dtype), rtol=_tol(dtype))


def test_add_layer_norm_writes_into_given_rows() -> None:
    """sum_out / norm_out: the results land in the given (row-sliced) buffers, same values."""
    g = torch.Generator().manual_seed(7)
    x, delta = (torch.randn(6, 64, generator=g).to(DEVICE) for _ in range(2))
    w, b = torch.ones(64, device=DEVICE), torch.zeros(64, device=DEVICE)
    s_ref, n_ref = add_layer_norm(x[2:5], w, b, 1e-5, delta[2:5])
    s_buf, n_buf = torch.zeros(6, 64, device=DEVICE), torch.zeros(6, 64, device=DEVICE)
    s, n = add_layer_norm(x[2:5], w, b, 1e-5, delta[2:5], sum_out=s_buf[2:5],
                          norm_out=n_buf[2:5])
    assert s.data_ptr() == s_buf[2:5].data_ptr() and n.data_ptr() == n_buf[2:5].data_ptr()
    assert torch.equal(s_buf[2:5], s_ref) and torch.equal(n_buf[2:5], n_ref)
    assert not s_buf[:2].any() and not n_buf[5:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_embed_norm_matches_the_torch_steps(dtype) -> None:
    """The vision embedding stage in one kernel against its torch steps: pre-tile add, class
    token, gated position and tile embeddings, LayerNorm, zero padding rows."""
    n, t, p, d, padded, aspect_ratios = 2, 3, 5, 96, 8, 4
    g = torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

    patches, pre, cls = rand(n, t, p - 1, d), rand(n, t, d, scale=0.3), rand(d)
    position, table = rand(p, d, scale=0.5), rand(aspect_ratios, t * p * d, scale=0.5)
    gate = torch.tensor([0.7], device=DEVICE).tanh().to(dtype)
    ar = torch.tensor([3, 1], device=DEVICE)
    w, b = rand(d, scale=0.1) + 1, rand(d, scale=0.1)
    x = patches + pre.unsqueeze(2)
    x = torch.cat((cls.view(1, 1, 1, d).expand(n, t, 1, d), x), dim=2)
    x = x + (1 - gate) * position.view(1, 1, p, d)
    x = x + gate * table[ar].view(n, t, p, d)
    expected = F.pad(F.layer_norm(x, (d,), w, b, 1e-5), (0, 0, 0, padded - p))
    out = vision_embed_norm(patches, pre, cls, position, 1 - gate, gate, table, ar, w, b, 1e-5,
                            padded)
    assert out.shape == (n, t, padded, d)
    assert torch.equal(out[:, :, p:], torch.zeros_like(out[:, :, p:]))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    if DEVICE == "cuda" and dtype == torch.bfloat16:  # same roundings: nearly all bitwise
        assert (out == expected).float().mean() > 0.99
