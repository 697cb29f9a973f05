"""The FP8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) in the attention kernels.

Writes (Triton, the fused RoPE write, torch) against ``x.clamp(-max, max).to(fp8)``; reads
(Triton decode, row chunks, the torch decode, prefill chunks reading context from pages)
against the float64 oracle (``reference.py``) over the same FP8 pages, which it widens.

Triton's interpreter casts to FP8 wrongly where rounding carries into the exponent (a value
just under 0.5 becomes 0.25), so on CPU the Triton writes get values FP8 holds exactly (and
out-of-range ones, which clamp); on CUDA they get random values and must round like torch.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.backends.torch_attn import TorchBackend
from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.kv_cache_dtype import (
    fp8_max,
    resolve_kv_cache_dtype,
    round_kv,
    to_cache,
)
from vllm.attention.metadata import ContextGroup, PrefillMetadata
from vllm.attention.ops import reference as ref
from vllm.attention.ops import torch_paged
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_kv_write import rope_and_write_kv_cache, write_kv_cache
from vllm.model_executor.layers.fused_kernels import rotary_inplace
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.transformers_utils.config import RopeSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]
SMALL = DecodeConfig(num_segments=4, block_n=16, min_chunk=16)
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _values(shape: tuple[int, ...], fp8: torch.dtype, gen: torch.Generator,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """K/V rows to write, with some out of FP8's range (both signs). Random on CUDA; on the
    interpreter values FP8 holds exactly (see the module docstring)."""
    x = torch.randn(*shape, generator=gen) * 4
    if DEVICE.type == "cpu":
        x = x.to(fp8).float()
    flat = x.view(-1)
    flat[::17] = 3 * fp8_max(fp8)
    flat[5::17] = -3 * fp8_max(fp8)
    return x.to(DEVICE, dtype)


def _pool(num_pages: int, hkv: int, page: int, d: int, fp8: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer, K view, V view) of layer 1 of a 2-layer FP8 pool laid out like CacheEngine,
    filled with finite garbage."""
    layer = 2 * hkv * page * d
    buffer = (torch.randn(num_pages, 2 * layer + 3, generator=gen) * 3).to(DEVICE, fp8)
    view = buffer[:, : 2 * layer].view(num_pages, 2, 2, hkv, page, d)
    return buffer, view[:, 1, 0], view[:, 1, 1]


def _exponent(x: torch.Tensor) -> torch.Tensor:
    return torch.frexp(x.float())[1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_names_resolve_like_vllm() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(torch.bfloat16) == 0.0


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
def test_to_cache_clamps_and_rounds_to_nearest(fp8: torch.dtype) -> None:
    big = fp8_max(fp8)
    x = torch.tensor([0.0, -0.0, 1.0, 3 * big, -3 * big, float("nan"), 0.49, 1.0 / 3])
    got = to_cache(x, fp8).float()
    assert got[3] == big and got[4] == -big and got[5].isnan()
    # Nearest of the two neighbours FP8 holds (e4m3: 0.46875 / 0.5; e5m2: 0.4375 / 0.5).
    assert got[6] == 0.5
    fine = torch.linspace(-4, 4, 4001)
    err = (to_cache(fine, fp8).float() - fine).abs()
    ulp = 2.0 ** (torch.floor(torch.log2(fine.abs().clamp(min=2**-6))) - (3 if fp8 ==
                  torch.float8_e4m3fn else 2))
    assert (err <= ulp / 2 + 1e-9).all()
    assert round_kv(x, torch.bfloat16) is x  # not FP8: untouched
    assert round_kv(x[:5], fp8).dtype == torch.float32


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
@pytest.mark.parametrize("src", [torch.float32, torch.float16,
                                 pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("writer", ["triton", "torch"])
def test_write_stores_the_clamped_rounding(fp8: torch.dtype, src: torch.dtype,
                                           writer: str) -> None:
    """Every written slot holds ``clamp + cast`` of its row, padding slots write nothing
    (Triton) or only into the null page (torch), and no other byte of the pool changes."""
    gen, hkv, page, d, n = _gen(3), 2, 4, 24, 11
    buffer, kc, vc = _pool(9, hkv, page, d, fp8, gen)
    before = buffer.clone()
    key = _values((n, hkv, d), fp8, gen, src)
    value = _values((n, hkv, d), fp8, gen, src)
    slots = (torch.randperm(8 * page, generator=gen)[:n] + page).tolist()
    slots[4] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    write = write_kv_cache if writer == "triton" else torch_paged.write_kv_cache
    write(key, value, kc, vc, slot_mapping)
    big = fp8_max(fp8)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        for cache, rows in ((kc, key), (vc, value)):
            want = rows[i].float().clamp(-big, big).to(fp8)
            assert torch.equal(_bytes(cache[s // page, :, s % page]), _bytes(want))
    # Nothing else changed (the torch writer also wrote the padding row into page 0).
    mask = torch.ones(9, dtype=torch.bool)
    mask[[s // page for s in slots if s >= 0] + [0]] = False
    assert torch.equal(_bytes(buffer[mask.to(DEVICE)]), _bytes(before[mask.to(DEVICE)]))
    if writer == "triton":
        assert torch.equal(_bytes(buffer[0]), _bytes(before[0]))


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
def test_rope_write_stores_the_rotated_rows_rounded(fp8: torch.dtype) -> None:
    """The fused RoPE + write into an FP8 pool: q and k rotated in place as ``rotary_inplace``
    rotates them, and the cache holding ``to_cache`` of the rotated k (what prefill then
    attends to, ``round_kv``) and of v."""
    gen, hq, hkv, d, t = _gen(4), 4, 2, 16, 6
    rotary = RotaryEmbedding(d, 4096, RopeSpec(rope_type="llama3", theta=500000.0,
                                               factor=8.0)).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 300, 4095, -1], device=DEVICE)
    slots = torch.tensor([5, 9, -1, 20, 31, -1], dtype=torch.int64, device=DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE) * 3
    if DEVICE.type == "cpu":  # rotated values are not FP8-exact: widen them instead
        qkv = qkv.to(fp8).float()
    _, kc, vc = _pool(9, hkv, 4, d, fp8, gen)
    expect = qkv.clone()
    eq, ek, ev = expect.split([hq * d, hkv * d, hkv * d], dim=1)
    rotary_inplace(positions, eq, ek, rotary.cos_cache, rotary.sin_cache, d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    rope_and_write_kv_cache(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, kc, vc,
                            slots)
    assert torch.equal(qkv, expect)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        got_k, got_v = kc[s // 4, :, s % 4], vc[s // 4, :, s % 4]
        want_k = to_cache(ek[i].view(hkv, d), fp8)
        check = torch.ones_like(want_k, dtype=torch.bool)
        if DEVICE.type == "cpu":  # the interpreter is exact where rounding stays in a binade
            check = _exponent(want_k.float()) == _exponent(ek[i].view(hkv, d))
            assert check.float().mean() > 0.8
        assert torch.equal(_bytes(got_k)[check], _bytes(want_k)[check])
        assert torch.equal(_bytes(got_v), _bytes(to_cache(ev[i].view(hkv, d), fp8)))


def _decode_batch(fp8: torch.dtype, lens: list[int], hq: int, hkv: int, d: int, page: int,
                  qdtype: torch.dtype, seed: int):
    gen = _gen(seed)
    need = [math.ceil(n / page) for n in lens]
    num_pages = sum(need) + 2
    _, kc, vc = _pool(num_pages, hkv, page, d, fp8, gen)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(pages[:k], dtype=torch.int32)
        pages = pages[k:]
    q = torch.randn(len(lens), hq, d, generator=gen).to(DEVICE, qdtype)
    return q, kc, vc, tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
@pytest.mark.parametrize(("hq", "hkv", "d", "page"), [(4, 2, 32, 4), (8, 1, 64, 16)])
@pytest.mark.parametrize("qdtype", [torch.float32,
                                    pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_decode_reads_fp8_pages(fp8: torch.dtype, hq: int, hkv: int, d: int, page: int,
                                qdtype: torch.dtype) -> None:
    """Triton decode and the torch decode over FP8 pages: the oracle over the same pages;
    a zero-length KV gives exact zeros. The products run in the query's dtype, so the fp32
    case is as close as an fp32 cache's."""
    lens = [0, 1, page, page + 1, 45, 70]
    q, kc, vc, tables, seq_lens = _decode_batch(fp8, lens, hq, hkv, d, page, qdtype, d + page)
    expected = ref.paged_decode_attention(q.float(), kc, vc, tables, seq_lens, 0.3)
    tol = TOL if qdtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    triton_out = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, config=SMALL)
    torch_out = torch_paged.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    for out in (triton_out, torch_out):
        assert out.dtype == qdtype
        torch.testing.assert_close(out.float(), expected, **tol)
        assert not out[0].any()


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
def test_decode_row_chunks_read_fp8_pages(fp8: torch.dtype) -> None:
    """Rows of one row chunk (same id, lengths a few tokens apart) served by one program over
    FP8 pages: what each row alone gives, within fp32 rounding (the merge order differs)."""
    lens = [33, 34, 35, 36, 9, 60]
    q, kc, vc, tables, seq_lens = _decode_batch(fp8, lens, 8, 2, 32, 4, torch.float32, 11)
    tables[1:4] = tables[0]
    kv_ids = torch.tensor([0, 0, 0, 0, 4, 5], dtype=torch.int32, device=DEVICE)
    together = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, kv_ids=kv_ids,
                                      config=SMALL)
    alone = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, config=SMALL)
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=0)  # |out| up to 10
    expected = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    torch.testing.assert_close(together, expected, **TOL)


@pytest.mark.parametrize("fp8", FP8, ids=IDS)
@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend(SMALL)],
                         ids=["torch", "triton"])
def test_prefill_chunks_read_fp8_context(fp8: torch.dtype, backend) -> None:
    """Prefill chunks after 5 and 40 cached tokens read their context from FP8 pages (the
    gathered rows widened to the queries' dtype), a whole prompt beside them attends to its
    fresh K/V as the layer hands them (rounded): all against the oracle over the pages."""
    gen, page, hq, hkv, d = _gen(8), 4, 4, 2, 16
    contexts, lens = [0, 5, 40], [6, 3, 9]
    totals = [c + n for c, n in zip(contexts, lens, strict=True)]
    need = [math.ceil(t / page) for t in totals]
    num_pages = sum(need) + 2
    _, kc, vc = _pool(num_pages, hkv, page, d, fp8, gen)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = []
    for k in need:
        tables.append(pages[:k])
        pages = pages[k:]
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE)
    k = round_kv(torch.randn(t, hkv, d, generator=gen).to(DEVICE) * 3, fp8)
    v = round_kv(torch.randn(t, hkv, d, generator=gen).to(DEVICE) * 3, fp8)
    slots = []
    for table, ctx, n in zip(tables, contexts, lens, strict=True):
        slots += [table[i // page] * page + i % page for i in range(ctx, ctx + n)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    torch_paged.write_kv_cache(k, v, kc, vc, slot_mapping)
    # One group of both chunks (ContextGroup's definition): each chunk's pages, page
    # after page; its queries see gathered keys [its first, its position].
    group_pages, runs, ranges, rows = [], [], [], []
    for i in (1, 2):
        ctx, n, q0, k0 = contexts[i], lens[i], sum(lens[:i]), len(group_pages) * page
        group_pages += tables[i]
        runs.append((q0, q0 + n, k0, k0 + ctx + n))
        ranges += [(k0, k0 + ctx + j + 1) for j in range(n)]
        rows += range(q0, q0 + n)
    group = ContextGroup(torch.tensor(group_pages, device=DEVICE), runs,
                         torch.tensor(ranges, dtype=torch.int32, device=DEVICE),
                         torch.tensor(rows, device=DEVICE))
    md = PrefillMetadata(num_tokens=t, slot_mapping=slot_mapping, seq_lens=lens,
                         context_lens=contexts, context_groups=[group])
    out = backend.prefill_self(q, k, v, md, 0.3, (kc, vc))
    expected = ref.chunked_causal_attention(q, kc, vc, tables, contexts, lens, 0.3)
    torch.testing.assert_close(out, expected, **TOL)
