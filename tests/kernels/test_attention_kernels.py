"""Triton attention kernels against the torch oracle (``vllm/attention/ops/reference.py``).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``tests/conftest.py``
sets ``TRITON_INTERPRET=1``) on tiny shapes; the same tests run compiled on CUDA, and the
``gpu``-marked ones add the real shapes (11B heads, lengths past 10k), bf16 and CUDA graphs.
The interpreter computes bf16 wrongly (its ``tl.dot`` multiplies bf16 bit patterns as integers
and its fp32 -> bf16 cast truncates), so on CPU the half-precision path is checked in fp16.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from vllm.attention.backends.torch_attn import TorchBackend
from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.metadata import ContextGroup, DecodeMetadata, PrefillMetadata
from vllm.attention.ops import reference as ref
from vllm.attention.ops import sdpa
from vllm.attention.ops.triton_decode import (
    DEFAULT_DECODE_CONFIG,
    DecodeConfig,
    active_segments,
    alloc_decode_workspace,
    default_decode_config,
    paged_decode_attention,
    rows_per_program,
)
from vllm.attention.ops.triton_kv_write import write_kv_cache
from vllm.attention.ops.triton_prefill import (
    PrefillConfig,
    default_prefill_config,
    ranged_cross_attention,
    split_count,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = pytest.mark.gpu
# Several active segments even at interpreter lengths (the default splits only past 128 tokens).
SMALL = DecodeConfig(num_segments=4, block_n=16, min_chunk=16)
MEDIUM = DecodeConfig(num_segments=8, block_n=16, min_chunk=32)
HALF_TOL = {"atol": 2e-2, "rtol": 2e-2}
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(
    *shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaN poison compares equal to itself."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def make_pool(
    num_pages: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    num_layers: int = 3,
    layer: int = 1,
    slack: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's K/V views of a page pool built like ``CacheEngine``: one
    ``[num_pages, page_elems]`` buffer (with slack, as cross pages may have), viewed as
    ``[pages, layers, 2, Hkv, page, D]`` and sliced, so the page stride spans all layers.
    Filled with finite garbage (the null page included): nothing may depend on it. A slack
    that is not a multiple of 16 elements gives the kernels an unaligned page stride."""
    layer_elems = num_layers * 2 * num_kv_heads * page_size * head_dim
    buffer = _randn(num_pages, layer_elems + slack, gen=gen, dtype=dtype, scale=3.0)
    view = buffer[:, :layer_elems].view(num_pages, num_layers, 2, num_kv_heads, page_size, head_dim)
    return buffer, view[:, layer, 0], view[:, layer, 1]


def make_tables(
    lens: list[int], page_size: int, num_pages: int, gen: torch.Generator, extra_cols: int = 0
) -> torch.Tensor:
    """[B, W] distinct random pages (never the null page); unused entries point at page 0."""
    need = [math.ceil(n / page_size) for n in lens]
    assert sum(need) < num_pages
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(need + [1]) + extra_cols, dtype=torch.int32)
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(pages[:k], dtype=torch.int32)
        pages = pages[k:]
    return tables.to(DEVICE)


def decode_inputs(
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    extra_cols: int = 0,
    slack: int = 16,
) -> tuple[torch.Tensor, ...]:
    """(pool buffer, query, K view, V view, block tables, lengths) of a decode batch."""
    gen = _gen(seed)
    num_pages = sum(math.ceil(n / page_size) for n in lens) + 3
    buffer, kc, vc = make_pool(
        num_pages, num_kv_heads, page_size, head_dim, dtype, gen, slack=slack
    )
    tables = make_tables(lens, page_size, num_pages, gen, extra_cols)
    q = _randn(len(lens), num_heads, head_dim, gen=gen, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return buffer, q, kc, vc, tables, seq_lens


def run_decode(q, kc, vc, tables, seq_lens, config: DecodeConfig | None) -> torch.Tensor:
    """The kernel with its output and workspace poisoned: every element must be written, and
    no partial result of an inactive segment may be read."""
    out = torch.full_like(q, float("nan"))
    config = config or default_decode_config(kc.dtype)
    ws = alloc_decode_workspace(q.shape[0], q.shape[1], q.shape[2], q.device, config)
    ws.fill_(float("nan"))
    return paged_decode_attention(
        q, kc, vc, tables, seq_lens, 0.3, out=out, workspace=ws, config=config
    )


def _lens(page_size: int, gen: torch.Generator, count: int = 3, high: int = 71) -> list[int]:
    edge = [0, 1, page_size, page_size + 1, 70]
    return edge + torch.randint(0, high, (count,), generator=gen).tolist()


# ----------------------------------------------------------------------------- decode
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size", "config"),
    [
        (4, 4, 16, 4, SMALL),
        (4, 2, 32, 16, SMALL),
        (8, 2, 80, 4, MEDIUM),
        (8, 1, 64, 16, SMALL),
        (4, 2, 16, 4, None),  # the per-dtype default
        (8, 2, 128, 16, SMALL),
        (6, 3, 32, 4, SMALL),  # a group of 3 heads (padded for tl.dot)
        # the combine takes the segments two at a time: several blocks, the last part empty
        (8, 2, 32, 4, DecodeConfig(num_segments=8, block_n=16, min_chunk=16, combine_segments=2,
                                   combine_num_warps=2)),
    ],
)
def test_decode_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, config: DecodeConfig | None
) -> None:
    lens = _lens(page_size, _gen(head_dim))
    _, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, num_heads, num_kv_heads, head_dim, page_size, torch.float32, seed=head_dim
    )
    out = run_decode(q, kc, vc, tables, seq_lens, config)
    expected = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **FP32_TOL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # zero-length row: exact zeros


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=GPU)])
def test_decode_half_precision(dtype: torch.dtype) -> None:
    lens = _lens(16, _gen(1))
    _, q, kc, vc, tables, seq_lens = decode_inputs(lens, 8, 2, 64, 16, dtype, seed=1)
    out = run_decode(q, kc, vc, tables, seq_lens, SMALL)
    expected = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **HALF_TOL)


def test_decode_reads_nothing_past_length() -> None:
    """NaN in every cache row past the lengths (null page, tails of last pages, unused pages)
    and in the table's unused columns' pages must not change a single bit of the output."""
    lens = [0, 3, 16, 21, 64, 70]
    buffer, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, 4, 2, 32, 4, torch.float32, 7, extra_cols=2, slack=5
    )
    clean = run_decode(q, kc, vc, tables, seq_lens, SMALL)
    keep = torch.zeros(kc.shape[0], kc.shape[2], dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(lens):
        for t in range(n):
            keep[tables[i, t // 4], t % 4] = True
    for cache in (kc, vc):
        cache.masked_fill_(~keep[:, None, :, None], float("nan"))
    poisoned = run_decode(q, kc, vc, tables, seq_lens, SMALL)
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("config", [SMALL, None])
def test_decode_batch_invariant(config: DecodeConfig | None) -> None:
    """A sequence's output is bitwise the same alone (narrow table) or in a batch of other
    lengths with a wider table whose extra columns hold real pages."""
    lens = [70, 0, 53, 3, 33]
    _, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, 8, 2, 32, 4, torch.float32, 3, extra_cols=4
    )
    tables[:, -4:] = tables[0, :4]  # unread columns that would change results if read
    batch = run_decode(q, kc, vc, tables, seq_lens, config)
    target = 2
    alone = run_decode(
        q[target : target + 1],
        kc,
        vc,
        tables[target : target + 1, :14],
        seq_lens[target : target + 1],
        config,
    )
    assert torch.equal(alone[0], batch[target])


def _row_chunk_batch(num_heads: int, num_kv_heads: int, seed: int):
    """A decode batch with three row chunks (one sequence's tokens as rows over its pages):
    rows 0-15 a self-attention chunk at positions 51-66 (under SMALL a segment holds 16
    tokens up to a length of 64, then 32: the split changes at row 13); rows 16-21 a
    cross-attention chunk (six rows of one length); rows 22-24 sequences of their own;
    rows 25-30 a chunk that starts off every program's window; one padding row last."""
    lens = list(range(52, 68)) + [50] * 6 + [40, 23, 7] + list(range(10, 16)) + [0]
    ids = [10] * 16 + [20] * 6 + [1, 2, 3] + [30] * 6 + [99]
    _, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, num_heads, num_kv_heads, 32, 4, torch.float32, seed, extra_cols=2
    )
    for first, last in ((0, 15), (16, 21), (25, 30)):
        tables[first + 1 : last + 1] = tables[first]
    kv_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    return q, kc, vc, tables, seq_lens, kv_ids


def run_decode_rows(q, kc, vc, tables, seq_lens, kv_ids, config: DecodeConfig) -> torch.Tensor:
    """``run_decode`` with page-sharing ids (output and workspace poisoned the same way)."""
    out = torch.full_like(q, float("nan"))
    ws = alloc_decode_workspace(q.shape[0], q.shape[1], q.shape[2], q.device, config)
    ws.fill_(float("nan"))
    return paged_decode_attention(
        q, kc, vc, tables, seq_lens, 0.3, out=out, workspace=ws, config=config, kv_ids=kv_ids
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "config"),
    [
        (8, 2, SMALL),  # 4 heads a KV head: 4 rows a program
        (4, 4, SMALL),  # 1 head a KV head: 16 rows a program
        (6, 2, SMALL),  # 3 heads: 4 rows fill 12 of the 16 tile rows
        (8, 2, DecodeConfig(num_segments=4, block_n=16, min_chunk=16, rows=8)),  # 32-row tile
    ],
)
def test_decode_row_chunks_served_together(
    num_heads: int, num_kv_heads: int, config: DecodeConfig
) -> None:
    """Rows of one chunk served by one program give what each row's own program gives (and
    the oracle's result); rows of other ids and padding rows are untouched. Bitwise on a GPU
    where the served tile has the per-row kernel's 16 rows (the default); a wider tile
    (``rows`` override) reduces in another order there (within 2e-6 in float32 on an H100).
    Triton's interpreter (3.7.1) is not bitwise even at 16 rows (its dot differs with the
    tile's other rows), so on CPU both are checked within 1e-5."""
    q, kc, vc, tables, seq_lens, kv_ids = _row_chunk_batch(num_heads, num_kv_heads, 5)
    together = run_decode_rows(q, kc, vc, tables, seq_lens, kv_ids, config)
    alone = run_decode(q, kc, vc, tables, seq_lens, config)
    expected = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    assert not together.isnan().any()
    torch.testing.assert_close(together, expected, **FP32_TOL)
    group = triton.next_power_of_2(num_heads // num_kv_heads)
    if DEVICE.type == "cuda" and rows_per_program(group, config) * group <= 16:
        assert torch.equal(together, alone)
    else:
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_decode_row_chunk_reads_its_leaders_pages() -> None:
    """The sharing is real: a row served by its chunk's first row is read through that row's
    table, whatever its own says; a row its split keeps apart reads its own."""
    q, kc, vc, tables, seq_lens, kv_ids = _row_chunk_batch(8, 2, 6)  # 4 rows a program
    expected = run_decode(q, kc, vc, tables, seq_lens, SMALL)
    swapped = tables.clone()
    swapped[1] = tables[22]  # served by row 0
    swapped[13] = tables[22]  # length 65: a 32-token split, not its leader's (row 12) 16
    got = run_decode_rows(q, kc, vc, swapped, seq_lens, kv_ids, SMALL)
    own = run_decode(q, kc, vc, swapped, seq_lens, SMALL)
    # Served by row 0 (through row 0's table): its own program's result over the original
    # table, within fp32 rounding (bitwise on a GPU, not in the 3.7.1 interpreter).
    if DEVICE.type == "cuda":
        assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)
    assert (own[1] - expected[1]).abs().max() > 1e-2  # the swapped table reads other pages
    assert torch.equal(got[13], own[13]) and not torch.equal(own[13], expected[13])


def test_segment_split_fills_the_gpu() -> None:
    """Host mirror of the device split: bounded by num_segments, zero for an empty KV, and a
    batch of one over 6,404 cross tokens spreads over >= 2 programs per SM of an H200."""
    cfg = DEFAULT_DECODE_CONFIG
    assert active_segments(0) == 0
    assert all(1 <= active_segments(n) <= cfg.num_segments for n in range(1, 200_000, 997))
    assert active_segments(6404) * 8 >= 2 * 132
    assert active_segments(100_000) * 8 >= 2 * 132


# ----------------------------------------------------------------------------- KV write
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        pytest.param(torch.bfloat16, torch.bfloat16, marks=GPU),
        pytest.param(torch.float32, torch.bfloat16, marks=GPU),
    ],
)
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_write_kv_writes_only_target_slots(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int
) -> None:
    gen, page_size, head_dim, n = _gen(5), 4, 24, 13
    buffer, kc, vc = make_pool(9, num_kv_heads, page_size, head_dim, cache_dtype, gen)
    buffer.fill_(float("nan"))  # every layer, the null page and the slack included
    before = buffer.clone()
    # Key and value are slices of one fused projection (non-contiguous rows), as in a layer.
    fused = _randn(n, 3 * num_kv_heads * head_dim, gen=gen, dtype=src_dtype)
    w = num_kv_heads * head_dim
    key = fused[:, w : 2 * w].view(n, num_kv_heads, head_dim)
    value = fused[:, 2 * w :].view(n, num_kv_heads, head_dim)
    slots = (torch.randperm(8 * page_size, generator=gen)[:n] + page_size).tolist()
    for i in (0, 5, 12):
        slots[i] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    write_kv_cache(key, value, kc, vc, slot_mapping)
    # Expected: the reference applied to the real tokens only, on the untouched pool.
    real = slot_mapping >= 0
    ekc, evc = _views_like(before, kc, vc)
    ref.write_kv_cache(key[real], value[real], ekc, evc, slot_mapping[real])
    assert torch.equal(_bits(buffer), _bits(before))


def _views_like(buffer: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor):
    """The same strided K/V views over another buffer of the same shape."""
    return (
        buffer.as_strided(kc.shape, kc.stride(), kc.storage_offset()),
        buffer.as_strided(vc.shape, vc.stride(), vc.storage_offset()),
    )


# ----------------------------------------------------------------------------- prefill
def _packed_qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
):
    """q/k/v as views of one fused projection output (row stride > heads * head_dim)."""
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    fused = _randn(num_tokens, sum(widths), gen=gen, dtype=dtype)
    q, k, v = fused.split(widths, dim=1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (4, 4, 16, torch.float32),
        (4, 2, 80, torch.float32),
        (8, 1, 32, torch.float32),
        (8, 2, 64, torch.float16),
        pytest.param(8, 2, 128, torch.bfloat16, marks=GPU),
    ],
)
def test_sdpa_prefill_causal_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """The production causal prefill (SDPA, both back-ends) against the float64 oracle, on
    q/k/v views of one fused projection and with padding rows after the last sequence."""
    lens = [1, 17, 70, 33, 5, 16]
    q, k, v = _packed_qkv(sum(lens) + 3, num_heads, num_kv_heads, head_dim, dtype,
                          _gen(head_dim))
    out = sdpa.varlen_causal_attention(q, k, v, lens, 0.3)
    expected = ref.varlen_causal_attention(q, k, v, lens, 0.3)
    real = sum(lens)
    assert not out[:real].isnan().any()
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out[:real], expected[:real], **tol)


def _context_groups(tables: list[list[int]], contexts: list[int], lens: list[int], page: int,
                    split: list[list[int]]) -> list[ContextGroup]:
    """The chunks with context (indices into the step's sequences) grouped as ``split``
    says, built from the definition in ``ContextGroup``'s docstring."""
    firsts = [sum(lens[:i]) for i in range(len(lens))]
    groups = []
    for members in split:
        pages, runs, ranges, rows = [], [], [], []
        for i in members:
            ctx, n, q0 = contexts[i], lens[i], firsts[i]
            k0 = len(pages) * page
            pages += tables[i][:math.ceil((ctx + n) / page)]
            runs.append((q0, q0 + n, k0, k0 + ctx + n))
            ranges += [(k0, k0 + ctx + j + 1) for j in range(n)]
            rows += range(q0, q0 + n)
        groups.append(ContextGroup(
            torch.tensor(pages, device=DEVICE), runs,
            torch.tensor(ranges, dtype=torch.int32, device=DEVICE),
            torch.tensor(rows, device=DEVICE) if len(members) > 1 else None))
    return groups


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [(4, 2, 32, torch.float32), (8, 1, 16, torch.float32), (8, 2, 64, torch.float16)],
)
@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend(SMALL),
                                     TritonBackend(SMALL, num_sms=132)],
                         ids=["torch", "triton", "triton-key-splits"])
@pytest.mark.parametrize("split", [[[1], [2], [3], [5]], [[1, 2, 3, 5]], [[3, 1], [5, 2]]],
                         ids=["alone", "one-group", "reordered-pairs"])
def test_prefill_chunks_read_their_context_from_pages(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, backend, split
) -> None:
    """Chunked prefill: chunks after 5, 16, 150 and 520 cached tokens (page boundaries inside
    and on the edge), packed with whole prompts and padding rows; each chunk's K/V is written to
    its pages first, as the layer does. The chunks read their context alone, all in one
    group (one gather, one kernel call), or in groups whose order is not the step's (a
    query tile then spans chunks whose keys are apart); with an H200's SM count the ranged
    kernel splits the longer groups' keys (1 to 11 splits here). Against the oracle reading
    everything from pages."""
    page, gen = 4, _gen(head_dim + num_heads)
    contexts, lens = [0, 5, 16, 150, 0, 520], [6, 7, 1, 12, 9, 21]
    totals = [c + n for c, n in zip(contexts, lens, strict=True)]
    num_pages = sum(math.ceil(t / page) for t in totals) + 2
    _, kc, vc = make_pool(num_pages, num_kv_heads, page, head_dim, dtype, gen)
    tables = make_tables(totals, page, num_pages, gen).tolist()
    q, k, v = _packed_qkv(sum(lens) + 3, num_heads, num_kv_heads, head_dim, dtype, gen)
    # The earlier chunks' K/V (finite garbage past it on each page is never read).
    slots = []
    for table, ctx, n in zip(tables, contexts, lens, strict=True):
        slots += [table[t // page] * page + t % page for t in range(ctx, ctx + n)]
    slot_mapping = torch.tensor(slots + [-1] * 3, dtype=torch.int64, device=DEVICE)
    ref.write_kv_cache(k, v, kc, vc, slot_mapping)
    md = PrefillMetadata(num_tokens=sum(lens) + 3, slot_mapping=slot_mapping, seq_lens=lens,
                         num_padding=3, context_lens=contexts,
                         context_groups=_context_groups(tables, contexts, lens, page, split))
    out = backend.prefill_self(q, k, v, md, 0.3, (kc, vc))
    expected = ref.chunked_causal_attention(q, kc, vc, tables, contexts, lens, 0.3)
    real = sum(lens)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out[:real], expected[:real], **tol)
    # A chunk with no context is the ordinary causal prefill of its own tokens.
    torch.testing.assert_close(
        expected[:6], ref.varlen_causal_attention(q[:6], k[:6], v[:6], [6], 0.3), **tol)


def _cross_runs() -> tuple[int, int, list[tuple[int, int, int, int]]]:
    """(text tokens, vision tokens, runs): two requests, nested and empty ranges, tokens
    outside every run, runs that straddle query tiles."""
    runs = [(2, 9, 0, 20), (9, 30, 0, 45), (30, 31, 12, 12), (40, 61, 45, 47), (61, 75, 45, 90)]
    return 80, 90, runs


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (4, 2, 32, torch.float32),
        (8, 8, 80, torch.float32),
        (8, 2, 64, torch.float16),
        pytest.param(32, 8, 128, torch.bfloat16, marks=GPU),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_ranged_cross_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int
) -> None:
    num_tokens, num_vision, runs = _cross_runs()
    gen = _gen(11)
    q = _randn(num_tokens, num_heads, head_dim, gen=gen, dtype=dtype)
    k = _randn(num_vision, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    v = _randn(num_vision, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    ranges = torch.zeros(num_tokens, 2, dtype=torch.int32)
    for q0, q1, kv0, kv1 in runs:
        ranges[q0:q1] = torch.tensor([kv0, kv1], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    ranged_cross_attention(
        q,
        k,
        v,
        ranges.to(DEVICE),
        0.3,
        out=out,
        config=PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2),
        num_splits=num_splits,  # 3: key splits of 16 keys or less, some empty
    )
    expected = ref.ranged_cross_attention(q, k, v, runs, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **(FP32_TOL if dtype == torch.float32 else HALF_TOL))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))  # outside every run
    assert torch.equal(out[30], torch.zeros_like(out[30]))  # empty range


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, dtype, tokens",
    [(4, 2, 32, torch.float32, 48), pytest.param(32, 8, 128, torch.bfloat16, 256, marks=GPU)],
)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_ranged_cross_with_a_tile_that_sees_nothing(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int,
    num_splits: int,
) -> None:
    """A budget-sized prefill step whose first query tiles are text that sees no image and
    whose last rows see a 4-tile image: the shape that took the H200 down with an illegal
    memory access (256 tokens, 2 splits, only 2 rows with a range) before empty tiles were
    kept off the key arithmetic. Empty rows give zeros; the others the reference."""
    cfg = default_prefill_config(dtype)
    num_vision = 6404 if dtype != torch.float32 else 300
    gen = _gen(47)
    q = _randn(tokens, num_heads, head_dim, gen=gen, dtype=dtype)
    k = _randn(num_vision, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    v = _randn(num_vision, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    seeing = tokens - 2  # only the last tile sees the image, with its last two rows
    assert seeing >= cfg.block_m
    ranges = torch.zeros(tokens, 2, dtype=torch.int32)
    ranges[seeing:] = torch.tensor([0, num_vision], dtype=torch.int32)
    runs = [(seeing, tokens, 0, num_vision)]
    out = ranged_cross_attention(q, k, v, ranges.to(DEVICE), 0.3, num_splits=num_splits)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    expected = ref.ranged_cross_attention(q, k, v, runs, 0.3)
    torch.testing.assert_close(out.float(), expected.float(),
                               **(FP32_TOL if dtype == torch.float32 else HALF_TOL))
    assert torch.equal(out[:seeing], torch.zeros_like(out[:seeing]))


def test_split_count() -> None:
    cfg = PrefillConfig(block_m=128, block_n=64)
    assert split_count(128, 32, 6404, 132, cfg) == 4  # 32 programs: 4 splits fill 132 SMs
    assert split_count(200, 32, 6404, 132, cfg) == 2
    assert split_count(1024, 32, 6404, 132, cfg) == 1  # the grid already fills the GPU
    assert split_count(16, 32, 300, 132, cfg) == 1  # too few keys to split


@GPU
def test_split_cross_prefill_at_the_ttft_shape() -> None:
    """128 text tokens over one 4-tile image (6,404 vision tokens), 11B heads, with the split
    count the back-end picks on this GPU: the reference's result, split or not."""
    q = _randn(128, 32, 128, gen=_gen(43), dtype=torch.bfloat16)
    vis_k, vis_v = (_randn(6404, 8, 128, gen=_gen(44), dtype=torch.bfloat16) for _ in "kv")
    runs = [(0, 1, 0, 0), (1, 128, 0, 6404)]  # the image token sees nothing
    ranges = torch.tensor([[0, 0]] + [[0, 6404]] * 127, dtype=torch.int32, device=DEVICE)
    expected = ref.ranged_cross_attention(q, vis_k, vis_v, runs, 0.3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = split_count(128, 32, 6404, sms, default_prefill_config(torch.bfloat16))
    assert splits > 1  # an H200 has 132 SMs: 32 (tile, head) programs leave most idle
    for n in (1, splits):
        out = ranged_cross_attention(q, vis_k, vis_v, ranges, 0.3, num_splits=n)
        torch.testing.assert_close(out.float(), expected.float(), **HALF_TOL)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    md = PrefillMetadata(  # the default (SDPA) back-end takes the split kernel here
        num_tokens=128, slot_mapping=torch.full((128,), -1, dtype=torch.int64, device=DEVICE),
        seq_lens=[128], max_encoder_seq_len=6404, cross_kv_ranges=ranges,
        cross_range_runs=runs[1:])
    got = TritonBackend().prefill_cross(q, vis_k, vis_v, md, 0.3)
    assert torch.equal(got, ranged_cross_attention(q, vis_k, vis_v, ranges, 0.3,
                                                   num_splits=splits))


# ----------------------------------------------------------------------------- backend
@pytest.mark.parametrize("num_sms", [None, 132])
def test_backends_match_reference(num_sms: int | None) -> None:
    """Every method of both back-ends against the oracle through the step metadata (tiny
    shapes); ``num_sms=132`` makes the Triton back-end split the cross prefill's keys as on an
    H200."""
    gen, hq, hkv, d, page = _gen(13), 4, 2, 32, 4
    triton_be, torch_be = TritonBackend(SMALL, num_sms=num_sms), TorchBackend()
    lens = [9, 30]
    q, k, v = _packed_qkv(sum(lens), hq, hkv, d, torch.float32, gen)
    ranges = torch.tensor([[0, 0]] * 3 + [[0, 20]] * 36, dtype=torch.int32, device=DEVICE)
    vis_k, vis_v = (_randn(20, hkv, d, gen=gen) for _ in range(2))
    prefill = PrefillMetadata(
        num_tokens=39,
        slot_mapping=torch.full((39,), -1, dtype=torch.int64, device=DEVICE),
        seq_lens=lens,
        max_encoder_seq_len=20,
        cross_kv_ranges=ranges,
        cross_range_runs=[(3, 39, 0, 20)],
    )
    expected = {"prefill_self": ref.varlen_causal_attention(q, k, v, lens, 0.3),
                "prefill_cross": ref.ranged_cross_attention(q, vis_k, vis_v, [(3, 39, 0, 20)],
                                                            0.3)}
    for method, args in (("prefill_self", (q, k, v)), ("prefill_cross", (q, vis_k, vis_v))):
        for be in (triton_be, torch_be):
            got = getattr(be, method)(*args, prefill, 0.3)
            torch.testing.assert_close(got, expected[method], **FP32_TOL)

    dec_lens = [0, 13, 30]
    pool, dq, kc, vc, tables, seq_lens = decode_inputs(
        dec_lens, hq, hkv, d, page, torch.float32, 17
    )
    slots = torch.tensor(
        [-1, int(tables[1, 3]) * page + 0, int(tables[2, 7]) * page + 1],
        dtype=torch.int64,
        device=DEVICE,
    )
    new_k, new_v = (_randn(3, hkv, d, gen=gen) for _ in range(2))
    ref_pool, torch_pool = pool.clone(), pool.clone()
    rkc, rvc = _views_like(ref_pool, kc, vc)
    ref.write_kv_cache(new_k, new_v, rkc, rvc, slots)
    triton_be.write_kv(new_k, new_v, kc, vc, slots)
    assert torch.equal(pool, ref_pool)
    tkc, tvc = _views_like(torch_pool, kc, vc)
    torch_be.write_kv(new_k, new_v, tkc, tvc, slots)
    assert torch.equal(torch_pool[1:], ref_pool[1:])  # the torch write also fills the null page
    decode = DecodeMetadata(
        slot_mapping=slots,
        seq_lens_tensor=seq_lens,
        max_seq_len=10_000,
        block_tables=tables,
        encoder_seq_lens_tensor=seq_lens.flip(0).contiguous(),
        max_encoder_seq_len=30,
        cross_block_tables=tables.flip(0).contiguous(),
        kv_ids=torch.arange(len(dec_lens), dtype=torch.int32, device=DEVICE),
    )
    expected = {
        "decode_self": ref.paged_decode_attention(dq, kc, vc, tables, seq_lens, 0.3),
        "decode_cross": ref.paged_decode_attention(dq, kc, vc, tables.flip(0).contiguous(),
                                                   seq_lens.flip(0).contiguous(), 0.3)}
    for method in ("decode_self", "decode_cross"):
        for be in (triton_be, torch_be):
            got = getattr(be, method)(dq, kc, vc, decode, 0.3)
            torch.testing.assert_close(got, expected[method], **FP32_TOL)


# ----------------------------------------------------------------------------- GPU only
SELF_LENS = [0, 1, 15, 16, 17, 1000, 4097, 10_500, 12_345]
CROSS_LENS = [0, 6404, 1601, 3202, 6404, 1]


@GPU
@pytest.mark.parametrize(("lens", "page_size"), [(SELF_LENS, 16), (CROSS_LENS, 64)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (16, 8, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_large_matches_reference(
    lens: list[int],
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    _, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=21, extra_cols=3
    )
    out = run_decode(q, kc, vc, tables, seq_lens, None)
    expected = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3)
    assert not out.isnan().any()
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@GPU
def test_decode_batch_invariant_large() -> None:
    """A 10,500-token sequence alone vs among 63 others of random lengths (wider table)."""
    gen = _gen(23)
    lens = torch.randint(0, 12_000, (64,), generator=gen).tolist()
    lens[37] = 10_500
    _, q, kc, vc, tables, seq_lens = decode_inputs(
        lens, 32, 8, 128, 16, torch.bfloat16, 29, extra_cols=50
    )
    batch = run_decode(q, kc, vc, tables, seq_lens, None)
    alone = run_decode(q[37:38], kc, vc, tables[37:38, :657], seq_lens[37:38], None)
    assert torch.equal(alone[0], batch[37])


@GPU
def test_cuda_graph_replay_matches_eager() -> None:
    """KV write + self decode + cross decode captured with padding inputs (slot -1, length 0),
    replayed twice with new inputs: bitwise equal to eager on a copy of the pool."""
    gen, bs, hq, hkv, d, page, width = _gen(31), 8, 32, 8, 128, 16, 400
    pool, kc, vc = make_pool(bs * width + 1, hkv, page, d, torch.bfloat16, gen)
    q, new_k, new_v = (_randn(bs, h, d, gen=gen, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    md = DecodeMetadata(
        slot_mapping=torch.full((bs,), -1, dtype=torch.int64, device=DEVICE),
        seq_lens_tensor=torch.zeros(bs, dtype=torch.int32, device=DEVICE),
        max_seq_len=0,
        block_tables=torch.zeros(bs, width, dtype=torch.int32, device=DEVICE),
        encoder_seq_lens_tensor=torch.zeros(bs, dtype=torch.int32, device=DEVICE),
        max_encoder_seq_len=1,
        cross_block_tables=torch.zeros(bs, width // 4, dtype=torch.int32, device=DEVICE),
        kv_ids=torch.arange(bs, dtype=torch.int32, device=DEVICE),
    )
    backend = TritonBackend()

    def step(kc: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backend.write_kv(new_k, new_v, kc, vc, md.slot_mapping)
        return (backend.decode_self(q, kc, vc, md, 0.1), backend.decode_cross(q, kc, vc, md, 0.1))

    before = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(kc, vc)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(kc, vc)
    assert torch.equal(pool, before)  # padding wrote nothing
    for round_ in range(2):
        lens = torch.randint(1, width * page, (bs,), generator=gen)
        lens[3] = 0  # a padding row
        tables = make_tables([width * page] * bs, page, pool.shape[0], gen)
        slots = tables.gather(1, ((lens - 1).clamp(min=0) // page).to(DEVICE)[:, None])[:, 0]
        slots = slots.long() * page + (lens.clamp(min=1) - 1).to(DEVICE) % page
        slots[3] = -1
        updates = {
            "self lengths": (md.seq_lens_tensor, lens),
            "self table": (md.block_tables, tables),
            "cross lengths": (md.encoder_seq_lens_tensor, lens // 4),  # row 3 stays empty
            "cross table": (md.cross_block_tables, tables[:, : width // 4].flip(0)),
            "slots": (md.slot_mapping, slots),
            "query": (q, _randn(bs, hq, d, gen=gen)),
            "new key": (new_k, _randn(bs, hkv, d, gen=gen)),
            "new value": (new_v, _randn(bs, hkv, d, gen=gen)),
        }
        for static, value in updates.values():
            static.copy_(value)
        eager_pool = pool.clone()
        ekc, evc = _views_like(eager_pool, kc, vc)
        graph.replay()
        eager_out = step(ekc, evc)
        torch.cuda.synchronize()
        assert torch.equal(pool, eager_pool), round_
        for g, e in zip(graph_out, eager_out, strict=True):
            assert torch.equal(g, e), round_
            assert torch.equal(g[3], torch.zeros_like(g[3]))


@GPU
def test_prefill_large_matches_reference() -> None:
    lens = [8192, 1000, 3, 4097]
    q, k, v = _packed_qkv(sum(lens), 32, 8, 128, torch.bfloat16, _gen(37))
    out = sdpa.varlen_causal_attention(q, k, v, lens, 0.3)
    expected = ref.varlen_causal_attention(q, k, v, lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **HALF_TOL)
    runs = [(0, 5000, 0, 6404), (5000, 9000, 6404, 8005), (9000, 13292, 6404, 12808)]
    vis_k, vis_v = (_randn(12808, 8, 128, gen=_gen(41), dtype=torch.bfloat16) for _ in "kv")
    ranges = torch.zeros(sum(lens), 2, dtype=torch.int32)
    for q0, q1, kv0, kv1 in runs:
        ranges[q0:q1] = torch.tensor([kv0, kv1], dtype=torch.int32)
    out = ranged_cross_attention(q, vis_k, vis_v, ranges.to(DEVICE), 0.3)
    expected = ref.ranged_cross_attention(q, vis_k, vis_v, runs, 0.3)
    torch.testing.assert_close(out.float(), expected.float(), **HALF_TOL)
