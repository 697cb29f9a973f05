"""The fused RoPE + KV-cache write against the two kernels it replaces, and the self-attention
layer's two RoPE paths (fused in the back-end, or applied by the layer) against each other.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); on CUDA the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from vllm.attention.backends.torch_attn import TorchBackend
from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.layer import Attention
from vllm.attention.metadata import DecodeMetadata, PrefillMetadata
from vllm.attention.ops.triton_kv_write import rope_and_write_kv_cache, write_kv_cache
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_kernels import rotary_inplace
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.transformers_utils.config import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROPE = RopeSpec(rope_type="llama3", theta=500000.0, factor=8.0)
PAGE_SIZE = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN poison compares equal to itself."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _pool(num_pages: int, hkv: int, d: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer, K view, V view): layer 1 of a 2-layer page pool laid out like ``CacheEngine``
    (the page stride spans both layers, plus an unaligned slack), NaN-poisoned except for some
    finite garbage, so a stray write anywhere shows in the buffer's bits."""
    layer = 2 * hkv * PAGE_SIZE * d
    buffer = torch.randn(num_pages, 2 * layer + 5, generator=gen).to(DEVICE, dtype)
    buffer[::2] = float("nan")
    view = buffer[:, : 2 * layer].view(num_pages, 2, 2, hkv, PAGE_SIZE, d)
    return buffer, view[:, 1, 0], view[:, 1, 1]


def _fused_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
               gen: torch.Generator) -> torch.Tensor:
    """[T, (Hq + 2 Hkv) D] like the QKV projection's output; q/k/v are strided column views."""
    return torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)


def _split(qkv: torch.Tensor, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    return tuple(qkv.split([hq * d, hkv * d, hkv * d], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 16), (6, 3, 32)])
@pytest.mark.parametrize("view_3d", [False, True])
def test_rope_kv_write_bitwise_equals_unfused(dtype: torch.dtype, hq: int, hkv: int, d: int,
                                              view_3d: bool) -> None:
    """q, k (in place), v (untouched) and the whole page pool, bit for bit, with padding slots
    (-1, which still rotate q/k) and a padding position (-1, rotated as position 0)."""
    gen = torch.Generator().manual_seed(hq * 100 + d)
    rotary = RotaryEmbedding(d, 4096, ROPE).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 100, 2047, 4095, -1], device=DEVICE)
    slots = torch.tensor([9, -1, 4, 30, -1, 17, -1], dtype=torch.int64, device=DEVICE)
    qkv = _fused_qkv(7, hq, hkv, d, dtype, gen)
    buffer, kc, vc = _pool(9, hkv, d, dtype, gen)
    exp_qkv, exp_buffer = qkv.clone(), buffer.clone()
    exp_kc, exp_vc = (exp_buffer.as_strided(c.shape, c.stride(), c.storage_offset())
                      for c in (kc, vc))

    eq, ek, ev = _split(exp_qkv, hq, hkv, d)
    rotary_inplace(positions, eq, ek, rotary.cos_cache, rotary.sin_cache, d)
    write_kv_cache(ek.view(7, hkv, d), ev.view(7, hkv, d), exp_kc, exp_vc, slots)

    q, k, v = _split(qkv, hq, hkv, d)
    if view_3d:  # the layer passes [T, H, D] views
        q, k, v = q.view(7, hq, d), k.view(7, hkv, d), v.view(7, hkv, d)
    rope_and_write_kv_cache(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, kc, vc,
                            slots)
    assert torch.equal(_bits(qkv), _bits(exp_qkv))
    assert torch.equal(_bits(buffer), _bits(exp_buffer))
    # The write really happened (not two no-ops agreeing): slot 9 is page 2, row 1.
    assert torch.equal(kc[2, :, 1], exp_qkv[0, hq * d:(hq + hkv) * d].view(hkv, d))
    assert torch.equal(vc[2, :, 1], exp_qkv[0, (hq + hkv) * d:].view(hkv, d))


def test_rope_kv_write_rejects_copying_views() -> None:
    """A layout ``view`` cannot flatten would be rotated in a copy: refused, not ignored."""
    rotary = RotaryEmbedding(16, 64, ROPE).to(DEVICE)
    _, kc, vc = _pool(3, 2, 16, torch.float32, torch.Generator().manual_seed(0))
    q = torch.zeros(3, 16, 4, device=DEVICE).transpose(1, 2)  # heads not contiguous
    k = v = torch.zeros(3, 32, device=DEVICE)
    slots = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(RuntimeError):
        rope_and_write_kv_cache(torch.zeros(3, dtype=torch.int64, device=DEVICE), q, k, v,
                                rotary.cos_cache, rotary.sin_cache, kc, vc, slots)


class _TritonWithReferenceDecode(TritonBackend):
    """TRITON's KV write (the fused one here) with TORCH's decode attention: the layer test
    is about RoPE and the cache contents, the decode kernel has tests of its own."""

    def decode_self(self, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, md: DecodeMetadata,
                    scale: float) -> torch.Tensor:
        return TorchBackend().decode_self(query, key_cache, value_cache, md, scale)

    def write_kv(self, *args: torch.Tensor) -> None:
        raise AssertionError("a bound self-attention layer must take the fused write")


def _layer_step(backend: TritonBackend | TorchBackend, is_prefill: bool,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None, qkv: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
    """One Attention.forward (Hq=4, Hkv=2, D=16) on q/k/v views of ``qkv``."""
    layer = Attention(4, 2, 16)
    layer.backend, layer.kv_cache = backend, kv_cache
    t = qkv.shape[0]
    md: PrefillMetadata | DecodeMetadata
    if is_prefill:
        md = PrefillMetadata(num_tokens=t, slot_mapping=slots, seq_lens=[5, 4])
    else:
        md = DecodeMetadata(
            slot_mapping=slots,
            seq_lens_tensor=torch.tensor([6, 5, 0], dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor([[1, 2], [3, 4], [0, 0]], dtype=torch.int32,
                                      device=DEVICE),
            encoder_seq_lens_tensor=torch.zeros(t, dtype=torch.int32, device=DEVICE),
            cross_block_tables=torch.zeros(t, 1, dtype=torch.int32, device=DEVICE),
            kv_ids=torch.arange(t, dtype=torch.int32, device=DEVICE),
            max_seq_len=6, max_encoder_seq_len=0)
    with set_forward_context(md):
        return layer(*_split(qkv, 4, 2, 16), positions, rotary)


@pytest.mark.parametrize("bound", [True, False])
def test_attention_layer_fused_rope_matches_reference_backend(bound: bool) -> None:
    """A prompt step then a decode step through the layer: TRITON (RoPE fused into the KV write)
    against TORCH (the layer rotates with the torch RoPE); unbound = the profile run."""
    gen = torch.Generator().manual_seed(7)
    rotary = RotaryEmbedding(16, 64, ROPE).to(DEVICE)
    pools = [_pool(6, 2, 16, torch.float32, torch.Generator().manual_seed(1)) for _ in range(2)]
    for buf, _, _ in pools:
        buf.zero_()  # the torch reference decode reads whole pages: keep them finite
    backends = [_TritonWithReferenceDecode(), TorchBackend()]
    # Prompts of 5 and 4 tokens in pages [1, 2] and [3, 4]; then one token each (third: padding).
    steps = [
        (True, [0, 1, 2, 3, 4, 0, 1, 2, 3], [4, 5, 6, 7, 8, 12, 13, 14, 15]),
        (False, [5, 4, -1], [9, 16, -1]),
    ]
    for is_prefill, pos, slot in steps:
        if not is_prefill and not bound:
            break  # decode needs a KV cache
        qkv = _fused_qkv(len(pos), 4, 2, 16, torch.float32, gen)
        positions = torch.tensor(pos, device=DEVICE)
        slots = torch.tensor(slot, dtype=torch.int64, device=DEVICE)
        outs = [_layer_step(be, is_prefill, (kc, vc) if bound else None, qkv.clone(),
                            positions, slots, rotary)
                for be, (_, kc, vc) in zip(backends, pools, strict=True)]
        real = len(pos) if is_prefill else 2  # a padding row's output is unused
        torch.testing.assert_close(outs[0][:real], outs[1][:real], atol=1e-5, rtol=1e-5)
        # The reference diverts padding into the null page 0, which nobody reads.
        torch.testing.assert_close(pools[0][0][1:], pools[1][0][1:], atol=1e-5, rtol=1e-5)
        if not bound:
            assert not pools[0][0].any()


class _StalePadding(TorchBackend):
    """TORCH whose prefill leaves stale memory (NaN) in the rows outside every sequence,
    as every back-end's ``empty_like`` output may."""

    def prefill_self(self, query, key, value, md: PrefillMetadata,
                     scale: float, kv_cache=None) -> torch.Tensor:
        out = super().prefill_self(query, key, value, md, scale, kv_cache)
        out[sum(md.seq_lens):] = float("nan")
        return out


def test_prefill_padding_rows_leave_the_layer_zeroed() -> None:
    """Padding rows (prefill_inputs.prefill_rows) come out of self-attention as zeros, so they
    stay finite through the layers; the real rows equal an unpadded step's."""
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(16, 64, ROPE).to(DEVICE)
    qkv = _fused_qkv(12, 4, 2, 16, torch.float32, gen)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0], device=DEVICE)

    def run(rows: int, pad: int) -> torch.Tensor:
        layer = Attention(4, 2, 16)
        layer.backend = _StalePadding()
        md = PrefillMetadata(
            num_tokens=rows, slot_mapping=torch.full((rows,), -1, dtype=torch.int64,
                                                     device=DEVICE),
            seq_lens=[5, 4], num_padding=pad)
        with set_forward_context(md):
            return layer(*_split(qkv[:rows].clone(), 4, 2, 16), positions[:rows], rotary)

    padded, exact = run(12, 3), run(9, 0)
    assert not padded[9:].any() and torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:9], exact, atol=0, rtol=0)
