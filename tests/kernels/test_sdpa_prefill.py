"""Bucketed SDPA prefill (``vllm/attention/ops/sdpa_prefill.py``) against the unpadded torch
reference: same results whatever the padding memory holds, and only bucket shapes (in one
layout) ever reach SDPA, so cuDNN plans a bounded set of shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.attention.backends.torch_ref import TorchReferenceBackend
from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.ops import reference as ref
from vllm.attention.ops import sdpa_prefill
from vllm.attention.ops.sdpa_prefill import bucket_len, buckets_up_to

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D = 4, 2, 16
# fp32 on CPU is exact to rounding; CUDA's fp32 SDPA kernels may use TF32 products.
TOL = {"atol": 2e-6, "rtol": 2e-6} if DEVICE.type == "cpu" else {"atol": 3e-3, "rtol": 3e-3}


def _fused_qkv(t: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q/k/v as the model hands them over: strided views of one fused projection output."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen).to(DEVICE)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
    return q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)


@pytest.fixture
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the module allocates starts as NaN: padding must never reach a real row."""
    real = torch.Tensor.new_empty

    def poisoned(self: torch.Tensor, *size, **kwargs) -> torch.Tensor:
        return real(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(q shape, k shape, q/k/v strides) of every SDPA call the module makes."""
    calls: list[tuple] = []
    real = F.scaled_dot_product_attention

    def record(q, k, v, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), (q.stride(), k.stride(), v.stride())))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa_prefill.F, "scaled_dot_product_attention", record)
    return calls


def test_buckets_bound_padding_and_count() -> None:
    lengths = range(1, 9000)
    assert all(n <= bucket_len(n) <= max(64, 1.25 * n) for n in lengths)
    assert all(bucket_len(bucket_len(n)) == bucket_len(n) for n in lengths)
    assert all(bucket_len(n) <= bucket_len(n + 1) for n in lengths)
    assert buckets_up_to(8192) == sorted({bucket_len(n) for n in range(1, 8193)})
    assert len(buckets_up_to(8192)) == 32  # 16..64 by 16, then four per octave
    with pytest.raises(ValueError, match="n >= 1"):
        bucket_len(0)


def test_causal_matches_reference_with_poisoned_padding(nan_buffers: None) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [1, 16, 17, 65, 130, 7]
    q, k, v = _fused_qkv(sum(lens), gen)
    expected = ref.varlen_causal_attention(q, k, v, lens, 0.25)
    out = sdpa_prefill.causal_attention(q, k, v, lens, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL)


def test_cross_matches_reference_with_poisoned_padding(nan_buffers: None) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(50, HQ, D, generator=gen).to(DEVICE)
    kv = torch.randn(30, 2, HKV, D, generator=gen).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]  # strided, like the projected vision K/V
    runs = [(0, 3, 0, 0), (3, 20, 0, 12), (20, 21, 0, 30), (21, 50, 12, 30)]
    expected = ref.ranged_cross_attention(q, k, v, runs, 0.3)
    out = sdpa_prefill.ranged_cross_attention(q, k, v, runs, 0.3)
    assert torch.isfinite(out).all() and torch.equal(out[:3], torch.zeros_like(out[:3]))
    torch.testing.assert_close(out, expected, **TOL)


def test_only_bucket_shapes_in_one_layout_reach_sdpa(sdpa_calls: list[tuple]) -> None:
    gen = torch.Generator().manual_seed(2)
    vis = torch.randn(24, 2, HKV, D, generator=gen).to(DEVICE)
    buckets = set(buckets_up_to(149))
    for kind in ("causal", "cross"):
        sdpa_calls.clear()
        for n in range(1, 150):
            q, k, v = _fused_qkv(n, gen)
            # Strided views and contiguous copies of the same lengths: one layout per shape.
            for q_, k_, v_ in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
                if kind == "causal":
                    sdpa_prefill.causal_attention(q_, k_, v_, [n], 1.0)
                else:
                    sdpa_prefill.ranged_cross_attention(q_, vis[:, 0], vis[:, 1],
                                                        [(0, n, 0, 24)], 1.0)
        assert {c[0][2] for c in sdpa_calls} == buckets, kind
        assert len(set(sdpa_calls)) == len(buckets), kind


def test_warm_up_plans_covers_every_bucket(sdpa_calls: list[tuple]) -> None:
    calls = sdpa_prefill.warm_up_plans(300, HQ, HKV, D, torch.float32, DEVICE, [20, 40])
    buckets = buckets_up_to(300)
    assert calls == len(sdpa_calls) == 3 * len(buckets)
    assert {(c[0][2], c[1][2]) for c in sdpa_calls} == (
        {(b, b) for b in buckets} | {(b, s) for b in buckets for s in (20, 40)})
    for other in (TorchReferenceBackend(), TritonBackend(), TritonBackend(prefill="triton")):
        assert other.warm_up_prefill(300, HQ, HKV, D, torch.float32, DEVICE, [20]) == 0


def test_backend_sdpa_prefill_matches_reference_backend(nan_buffers: None) -> None:
    """The bucketed-SDPA Triton back-end's prefill methods give TORCH_REF's results."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 40]
    q, k, v = _fused_qkv(sum(lens), gen)
    vis = torch.randn(2, 24, HKV, D, generator=gen).to(DEVICE)
    runs = [(0, 5, 0, 0), (5, 45, 0, 24)]
    md = AttentionMetadata(
        is_prefill=True, num_seqs=2, num_tokens=45,
        slot_mapping=torch.full((45,), -1, dtype=torch.int64, device=DEVICE),
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int32, device=DEVICE), max_seq_len=40,
        block_tables=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), seq_lens=lens,
        cross_kv_ranges=torch.tensor([[0, 0]] * 5 + [[0, 24]] * 40, dtype=torch.int32,
                                     device=DEVICE),
        cross_range_runs=runs)
    fast, oracle = TritonBackend(prefill="sdpa_buckets"), TorchReferenceBackend()
    torch.testing.assert_close(fast.prefill_self(q, k, v, md, 0.2),
                               oracle.prefill_self(q, k, v, md, 0.2), **TOL)
    if DEVICE.type == "cpu":  # on CUDA, 45 queries take the key-split kernel instead
        torch.testing.assert_close(fast.prefill_cross(q, vis[0], vis[1], md, 0.2),
                                   oracle.prefill_cross(q, vis[0], vis[1], md, 0.2),
                                   **TOL)


def test_fused_rows_only_for_adjacent_views() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = _fused_qkv(9, gen)
    fused = sdpa_prefill._fused_rows(q, k, v)
    assert fused is not None and fused.shape == (9, HQ + 2 * HKV, D)
    assert torch.equal(fused[:, :HQ], q) and torch.equal(fused[:, HQ + HKV:], v)
    assert sdpa_prefill._fused_rows(q, v, k) is None  # not in q, k, v order
    assert sdpa_prefill._fused_rows(q.contiguous(), k, v) is None


def test_selector_reads_the_prefill_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention import selector

    cuda = torch.device("cuda")
    for choice in ("sdpa", "sdpa_buckets", "triton"):
        monkeypatch.setenv("VLLM_PREFILL_ATTENTION", choice)
        backend = selector.get_attn_backend(cuda)
        assert isinstance(backend, TritonBackend) and backend.prefill == choice
    monkeypatch.setenv("VLLM_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="VLLM_PREFILL_ATTENTION must be one of"):
        selector.get_attn_backend(cuda)
    monkeypatch.delenv("VLLM_PREFILL_ATTENTION")
    assert selector.get_attn_backend(cuda).prefill == "sdpa"
    assert isinstance(selector.get_attn_backend(torch.device("cpu")), TorchReferenceBackend)
