"""Step inputs: prefill metadata for mixed batches and the persistent decode rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ImageInputs, ProcessedInputs
from vllm.worker.decode_state import DecodeRows
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch, step_images

IMG, P = 99, 5  # image token id, vision tokens per tile


def _inputs(ids: list[int], tiles: list[int]) -> ProcessedInputs:
    images = None
    if tiles:
        images = ImageInputs(torch.randn(len(tiles), 4, 3, 2, 2),
                             torch.arange(1, len(tiles) + 1), tiles)
    return ProcessedInputs(ids, images, image_runs(ids, IMG), last_group(ids, IMG),
                           tokens_per_tile=P)


def test_prefill_metadata_for_a_mixed_batch() -> None:
    text = _inputs([1, 2, 3], [])
    one = _inputs([IMG, 1, 2, 3], [2])  # 10 vision tokens, all cached
    inter = _inputs([1, IMG, 2, IMG, IMG, 3], [1, 3, 2])  # 5 + 15 + 10; last group = imgs 1,2
    items = [PrefillItem([1, 2, 3], text, "t", block_table=[7]),
             PrefillItem([IMG, 1, 2, 3, 4, 5], one, "o", block_table=[3, 6],
                         cross_block_table=[9, 10], write_cross=True),  # recompute: 2 extra
             PrefillItem([1, IMG, 2, IMG, IMG, 3], inter, "i", block_table=[4, 5],
                         cross_block_table=[11, 12, 13, 14], write_cross=True)]
    b = build_prefill_batch(items, block_size=4, cross_block_size=8, device=torch.device("cpu"))
    md = b.metadata
    assert md.is_prefill and md.num_seqs == 3 and md.num_tokens == 15
    assert md.seq_lens == [3, 6, 6]
    assert b.logits_indices.tolist() == [2, 8, 14]
    assert b.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert md.slot_mapping.tolist()[:9] == [28, 29, 30, 12, 13, 14, 15, 24, 25]
    assert md.slot_mapping.tolist()[9:] == [16, 17, 18, 19, 20, 21]
    # Vision tokens: request "o" at 0..10, request "i" at 10..40.
    images = step_images(items, torch.device("cpu"))
    assert images is not None and images.num_tiles == [2, 1, 3, 2]
    assert torch.equal(images.pixel_values, torch.cat([one.images.pixel_values,
                                                       inter.images.pixel_values]))
    assert images.aspect_ratio_ids.tolist() == [1, 1, 2, 3]
    r = md.cross_kv_ranges.tolist()
    assert r[:3] == [[0, 0]] * 3  # text-only
    assert r[3:9] == [[0, 10]] * 6  # including the recomputed generated tokens
    assert r[9:] == [[0, 0], [10, 15], [10, 15], [15, 30], [15, 40], [15, 40]]
    # Attention calls: adjacent runs with the same vision range are merged.
    assert md.cross_range_runs == [(3, 9, 0, 10), (10, 12, 10, 15), (12, 13, 15, 30),
                                   (13, 15, 15, 40)]
    assert md.max_encoder_seq_len == 25
    # Only the last image group of each request is cached, in its cross pages.
    assert md.cross_cache_src.tolist() == list(range(0, 10)) + list(range(15, 40))
    cross = md.cross_slot_mapping.tolist()
    assert cross[:10] == [72 + i for i in range(8)] + [80, 81]
    assert cross[10:] == [88 + i for i in range(8)] + [96 + i for i in range(8)] + [
        104 + i for i in range(8)] + [112]
    mask = md.cross_row_mask().squeeze(-1).tolist()
    assert mask == [False] * 3 + [True] * 6 + [False] + [True] * 5


def test_decode_rows_gather_and_advance() -> None:
    rows = DecodeRows(max_rows=4, max_pages=3, max_cross_pages=2, block_size=4,
                      device=torch.device("cpu"))
    a, b = rows.acquire(), rows.acquire()
    rows.load(a, [5, 6], [], 0, position=6)  # next token at position 6: page 6, offset 2
    rows.load(b, [9], [3, 4], 12, position=3)
    rows.set_tokens(torch.tensor([a, b]), torch.tensor([42, 43]))
    idx = torch.tensor([a, b, rows.null_row])
    x = rows.gather(idx, width=3, cross_width=2)
    assert x.input_ids.tolist() == [42, 43, 0]
    assert x.positions.tolist() == [6, 3, -1] and x.seq_lens.tolist() == [7, 4, 0]
    assert x.slot_mapping.tolist() == [26, 39, -1]
    assert x.encoder_seq_lens.tolist() == [0, 12, 0]
    assert x.cross_block_tables.tolist() == [[0, 0], [3, 4], [0, 0]]
    rows.advance(torch.tensor([a, b]), torch.tensor([7, 8]))
    rows.set_pages([(b, 1, 11)])
    x = rows.gather(idx, width=3, cross_width=2)
    assert x.input_ids.tolist()[:2] == [7, 8] and x.positions.tolist()[:2] == [7, 4]
    assert x.slot_mapping.tolist()[:2] == [27, 44]
    rows.set_pages([(a, 2, 13), (b, 2, 14), (a, 0, 15)])  # several rows and pages at once
    assert rows.block_tables[[a, b]].tolist() == [[15, 6, 13], [9, 11, 14]]
    rows.release(a)
    assert rows.gather(torch.tensor([a]), 3, 2).seq_lens.tolist() == [0]


@pytest.mark.parametrize("widths", [(300, 5), (7, 1), (1, 300)])
def test_gather_kernel_equals_torch_gather(widths: tuple[int, int]) -> None:
    """The one-kernel gather the decode graphs run on CUDA (here in Triton's interpreter on
    CPU) returns exactly the torch gather's tensors: padding and repeated null rows, positions
    on page boundaries, tables cut to widths below and above one kernel block (256)."""
    from vllm.worker.row_advance import gather_rows

    width, cross_width = widths
    g = torch.Generator().manual_seed(0)
    rows = DecodeRows(max_rows=6, max_pages=300, max_cross_pages=300, block_size=16,
                      device=torch.device("cpu"), run_rows=4)
    for position in (0, 15, 16 % (16 * width), 16 * width - 1):  # all within the width
        r = rows.acquire()
        pages = torch.randint(1, 10_000, (position // 16 + 1,), generator=g).tolist()
        num_cross = int(torch.randint(0, 300, (1,), generator=g))
        cross = torch.randint(1, 10_000, (num_cross,), generator=g).tolist()
        rows.load(r, pages, cross, 17 * r, position=position)
    run = rows.run_start + 1  # a row chunk of three tokens: its rows share their first's id
    rows.load_run(run, [7], [9], 5, [11, 12, 13], position=0)
    rows.tokens.copy_(torch.randint(0, 50_000, rows.tokens.shape, generator=g))
    idx = torch.tensor([3, rows.null_row, 0, run, run + 1, run + 2, 2, rows.null_row, 1])
    want = rows.gather(idx, width, cross_width)  # the torch code (CPU tensors)
    assert want.kv_ids.tolist() == [3, rows.null_row, 0, run, run, run, 2, rows.null_row, 1]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = gather_rows(idx.to(dev), rows.tokens.to(dev), rows.positions.to(dev),
                      rows.block_tables.to(dev), rows.encoder_lens.to(dev),
                      rows.cross_tables.to(dev), rows.kv_ids.to(dev), rows.block_size, width,
                      cross_width)
    for f, o in zip(dataclasses.fields(want), got, strict=True):
        w = getattr(want, f.name)
        assert o.dtype == w.dtype and torch.equal(o.cpu(), w), f.name


@pytest.mark.parametrize("kernel", [False, True])
def test_greedy_advance_skips_padding_rows(kernel: bool) -> None:
    """What a decode graph does after its argmax: real rows get their token and move on; the
    null row (padding, possibly repeated) stays at position -1. ``kernel``: the Triton
    kernel the graphs use on CUDA (here in Triton's interpreter)."""
    dev = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    rows = DecodeRows(max_rows=4, max_pages=3, max_cross_pages=2, block_size=4, device=dev)
    a, b = rows.acquire(), rows.acquire()
    rows.load(a, [5, 6], [], 0, position=6)
    rows.load(b, [9], [3, 4], 12, position=3)
    idx = torch.tensor([b, rows.null_row, a, rows.null_row], device=dev)
    ids = torch.tensor([11, 12, 13, 14], device=dev)
    if kernel:
        from vllm.worker.row_advance import advance_rows

        advance_rows(idx, ids, rows.tokens, rows.positions, rows.null_row)
    else:
        rows.advance_greedy(idx, ids)
    assert rows.tokens[[a, b]].tolist() == [13, 11]
    assert rows.positions[[a, b, rows.null_row]].tolist() == [7, 4, -1]
    assert rows.positions[2:4].tolist() == [-1, -1]  # free rows untouched


def test_step_images_skip_siblings_and_images_encoded_ahead() -> None:
    a = _inputs([IMG, 1, 2], [2])
    b = _inputs([IMG, 3], [3])
    c = _inputs([IMG, IMG, 4], [1, 2])
    ahead = torch.randn(15, 8)  # b's 3 tiles x 5 tokens, already encoded
    items = [PrefillItem([IMG, 1, 2], a, "a"), PrefillItem([IMG, 1, 2], a, "a"),  # siblings
             PrefillItem([IMG, 3], b, "b", encoded=ahead), PrefillItem([IMG, IMG, 4], c, "c"),
             PrefillItem([5, 6], _inputs([5, 6], []), "t")]
    images = step_images(items, torch.device("cpu"))
    assert images is not None and images.num_tiles == [2, 1, 2]
    assert torch.equal(images.pixel_values,
                       torch.cat([a.images.pixel_values, c.images.pixel_values]))
    # The batch places b's ahead-encoded tokens between the fresh encodings of a and c.
    batch = build_prefill_batch(items, block_size=4, cross_block_size=8,
                                device=torch.device("cpu"))
    fresh = torch.arange(25 * 8, dtype=torch.float32).view(25, 8)  # a: 10 rows, c: 15 rows
    vision = batch.assemble_vision(fresh)
    assert torch.equal(vision, torch.cat([fresh[:10], ahead, fresh[10:]]))
    assert step_images(items[2:3] + items[4:], torch.device("cpu")) is None
    host = step_images(items, torch.device("cpu"), upload=False)  # for the vision graphs
    assert host is not None and host.pixel_values is None and host.aspect_ratio_ids is None
    assert host.host_pixels[0] is a.images.pixel_values
    assert host.host_pixels[1] is c.images.pixel_values and len(host.host_pixels) == 2
    assert host.host_aspect_ratio_ids == images.aspect_ratio_ids.tolist()
    assert host.num_tiles == images.num_tiles


def test_prefill_rows_are_few_and_tight() -> None:
    from vllm.worker.prefill_inputs import prefill_row_buckets, prefill_rows

    buckets = prefill_row_buckets(8192)
    assert buckets[0] == 16 and buckets[-1] == 8192 and buckets == sorted(set(buckets))
    assert len(buckets) == 16 + (8192 - 256) // 64
    for n in range(1, 8193):
        r = prefill_rows(n)
        assert r >= n and r in buckets and r % 16 == 0
        assert r - n < (16 if n <= 256 else 64)
        assert prefill_rows(r) == r  # a bucket maps to itself
    assert prefill_row_buckets(300)[-1] == 320
    with pytest.raises(ValueError):
        prefill_rows(0)


def test_padded_prefill_batch_keeps_the_real_rows() -> None:
    text = _inputs([1, 2, 3], [])
    one = _inputs([IMG, 1, 2, 3], [2])
    items = [PrefillItem([1, 2, 3], text, "t", block_table=[7]),
             PrefillItem([IMG, 1, 2, 3], one, "o", block_table=[3],
                         cross_block_table=[9, 10], write_cross=True)]
    cpu = torch.device("cpu")
    exact = build_prefill_batch(items, block_size=4, cross_block_size=8, device=cpu)
    padded = build_prefill_batch(items, block_size=4, cross_block_size=8, device=cpu,
                                 pad_rows=True)
    a, b = exact.metadata, padded.metadata
    assert a.num_tokens == 7 and b.num_tokens == 16 and padded.input_ids.shape == (16,)
    assert padded.input_ids.tolist() == exact.input_ids.tolist() + [0] * 9
    assert padded.positions.tolist() == exact.positions.tolist() + [0] * 9
    assert b.slot_mapping.tolist() == a.slot_mapping.tolist() + [-1] * 9
    assert b.cross_kv_ranges.tolist() == a.cross_kv_ranges.tolist() + [[0, 0]] * 9
    assert torch.equal(padded.logits_indices, exact.logits_indices)
    for name in ("seq_lens", "max_encoder_seq_len", "cross_range_runs"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("cross_cache_src", "cross_slot_mapping"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_chunks_with_context_read_their_pages_in_bounded_groups() -> None:
    """Chunks after a cached prefix are grouped in step order while their pages fit the
    bound (a chunk alone may fill a group); each chunk's keys start on a page boundary of
    its group's gather, and its query at position p sees the group's keys from its first to
    p. A whole prompt between them is in no group."""
    cpu = torch.device("cpu")
    items = [PrefillItem(list(range(1, 11)), _inputs(list(range(1, 11)), []), "a",
                         block_table=[3, 4, 5], start=6),  # 6 cached + 4 new, 3 pages
             PrefillItem([1, 2, 3], _inputs([1, 2, 3], []), "w", block_table=[7]),
             PrefillItem(list(range(1, 6)), _inputs(list(range(1, 6)), []), "b",
                         block_table=[8, 9], start=3),  # 3 + 2, 2 pages
             PrefillItem(list(range(1, 17)), _inputs(list(range(1, 17)), []), "c",
                         block_table=[10, 11, 12, 13], start=15)]  # 15 + 1, 4 pages
    md = build_prefill_batch(items, block_size=4, cross_block_size=8, device=cpu,
                             max_context_tokens=20).metadata  # at most 5 pages a group
    assert md.context_lens == [6, 0, 3, 15]
    g1, g2 = md.context_groups
    # Rows: a 0..4, w 4..7, b 7..9, c 9..10.
    assert g1.pages.tolist() == [3, 4, 5, 8, 9]
    assert g1.runs == [(0, 4, 0, 10), (7, 9, 12, 17)]
    assert g1.rows.tolist() == [0, 1, 2, 3, 7, 8]
    assert g1.ranges.dtype == torch.int32
    assert g1.ranges.tolist() == [[0, 7], [0, 8], [0, 9], [0, 10], [12, 16], [12, 17]]
    assert g2.pages.tolist() == [10, 11, 12, 13] and g2.runs == [(9, 10, 0, 16)]
    assert g2.rows is None and g2.ranges.tolist() == [[0, 16]]
    one = build_prefill_batch(items, block_size=4, cross_block_size=8, device=cpu).metadata
    (g,) = one.context_groups  # unbounded: one group, one gather
    assert g.pages.tolist() == [3, 4, 5, 8, 9, 10, 11, 12, 13]
    assert g.runs[2] == (9, 10, 20, 36) and g.ranges.tolist()[-1] == [20, 36]
    whole = build_prefill_batch(items[1:2], block_size=4, cross_block_size=8, device=cpu)
    assert whole.metadata.context_lens is None and whole.metadata.context_groups is None
