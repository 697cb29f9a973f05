"""Builds the packed inputs and attention metadata of a prefill step.

Several prompts or chunks of prompts with different image and tile counts become one flat
batch: token ids and positions back to back, the images of the step's chunks that see any in
one vision batch, and for every token a ``[start, end)`` range over the step's packed vision
tokens. Sequences of one request (n > 1 siblings recomputed after preemption) share one
encoding of its images. A chunk that continues a sequence (``PrefillItem.start`` > 0) attends
to its earlier tokens through the pages; the step's chunks read them in groups
(``PrefillMetadata.context_groups``).

The runner pads a step's rows up to ``prefill_rows(T)`` (padding rows: token 0 at position 0,
no cache slot, no vision range, outside every sequence): the text model's GEMMs then see a
small fixed set of row counts, which the start-up warm-up runs once each. cuBLAS spends 1-5 ms
of host time on the first GEMM of each new row count (measured on the H200, see the 2026-12-01
entry of benchmarks/RESULTS.md; CUDA's module loading does not change it), and in a
server that host time stalls every running stream. Every operation of the text model is
row-wise except attention, which reads the sequences' rows only (and zeroes the padding rows'
output, see ``Attention.forward``), so padding changes no real row's result beyond the GEMMs'
own choice of kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.attention.metadata import ContextGroup, PrefillMetadata
from vllm.multimodal.cross_attention import ImageRun
from vllm.multimodal.processing import ProcessedInputs
from vllm.utils import to_device

_FINE_ROWS, _FINE_STEP, _COARSE_STEP = 256, 16, 64


def prefill_rows(n: int) -> int:
    """The rows a prefill step of ``n`` >= 1 tokens runs: ``n`` rounded up to a multiple of 16
    up to 256 (where the GEMMs are bound by the weights' bytes, so padding is nearly free),
    then to a multiple of 64 (under 25% more rows, under 7% from 1,024)."""
    if n < 1:
        raise ValueError(f"prefill_rows needs n >= 1, got {n}")
    step = _FINE_STEP if n <= _FINE_ROWS else _COARSE_STEP
    return -(-n // step) * step


def prefill_row_buckets(max_tokens: int) -> list[int]:
    """Every row count ``prefill_rows`` gives for 1..``max_tokens`` tokens, ascending."""
    out = [prefill_rows(1)]
    while out[-1] < max_tokens:
        out.append(prefill_rows(out[-1] + 1))
    return out


@dataclass
class PrefillItem:
    """Tokens ``token_ids[start:]`` of one sequence to prefill (the first ``start`` are in its
    pages). ``token_ids`` may extend the prompt (recompute after preemption): tokens past the
    prompt see the last image group, like generated tokens."""

    token_ids: list[int]
    inputs: ProcessedInputs
    vision_key: object  # items with the same key share one encoding of the images
    block_table: list[int] = field(default_factory=list)  # empty: do not write K/V
    cross_block_table: list[int] = field(default_factory=list)
    write_cross: bool = False  # this item writes the request's cross K/V pages
    encoded: torch.Tensor | None = None  # its images' vision tokens, encoded before this step
    start: int = 0
    sees_images: bool | None = None  # None: whether any of its tokens sees an image
    samples: bool = True  # its last token's logits are sampled
    # Its cross pages hold its last group's K/V already (a cached cross group): its tokens
    # see only that group, read from the pages; its images are not encoded.
    cross_cached: bool = False

    def __post_init__(self) -> None:
        if self.sees_images is None:
            self.sees_images = self.inputs.images is not None and self.inputs.sees_images(
                self.start, len(self.token_ids))


@dataclass
class PrefillBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: PrefillMetadata
    logits_indices: torch.Tensor  # [num_seqs] int64: each sequence's last token
    # When some images were encoded ahead: per image group in vision order, its encoded tokens
    # or None (take the next rows of this step's fresh encoding), with its token count.
    vision_parts: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)
    # vision_key -> [start, end) of its vision tokens in the step's packed vision tokens.
    vision_rows: dict[object, tuple[int, int]] = field(default_factory=dict)
    # Rows of the step's packed vision tokens (fresh and encoded ahead; cached rows follow).
    num_vision_tokens: int = 0

    def assemble_vision(self, fresh: torch.Tensor | None) -> torch.Tensor:
        """The step's packed vision tokens from ahead-encoded parts and ``fresh`` ones."""
        parts, row = [], 0
        for encoded, n in self.vision_parts:
            if encoded is None:
                assert fresh is not None
                encoded, row = fresh[row:row + n], row + n
            parts.append(encoded)
        return torch.cat(parts) if len(parts) > 1 else parts[0]


@dataclass
class StepImages:
    """The images a prefill step encodes, in the step's vision order: on the host (the
    owners' own tensors, pinned on CUDA by the input processor) and, when uploaded, on the
    device."""

    pixel_values: torch.Tensor | None  # [N, max_tiles, C, S, S] on the device, if uploaded
    aspect_ratio_ids: torch.Tensor | None  # [N] on the device, if uploaded
    num_tiles: list[int]
    host_pixels: list[torch.Tensor]  # per owner [n_i, max_tiles, C, S, S], sum(n_i) = N
    host_aspect_ratio_ids: list[int]


def _image_owners(items: list[PrefillItem]) -> list[PrefillItem]:
    """The items whose images the step's vision tokens hold, in vision order: the first item
    with images of each ``vision_key`` (siblings share one encoding)."""
    owners: dict[object, PrefillItem] = {}
    for item in items:
        if item.inputs.images is not None and item.sees_images and not item.cross_cached:
            owners.setdefault(item.vision_key, item)
    # A sibling's chunk may hold the request's encoding when the owner's does not.
    for item in items:
        owner = owners.get(item.vision_key)
        if owner is not None and owner.encoded is None and item.encoded is not None:
            owner.encoded = item.encoded
    return list(owners.values())


def step_images(items: list[PrefillItem], device: torch.device,
                upload: bool = True) -> StepImages | None:
    """The images to encode in this step: each request's once (``_image_owners``), none that
    was encoded ahead. The runner calls it before ``build_prefill_batch`` so the encoder
    starts while the host builds the text inputs; the order is the one
    ``build_prefill_batch`` gives the vision tokens. ``upload=False`` leaves them on the host
    (the vision graphs copy each image straight into their input buffer)."""
    pixels, ar_ids, num_tiles = [], [], []
    for item in _image_owners(items):
        images = item.inputs.images
        if item.encoded is None:
            pixels.append(images.pixel_values)
            ar_ids.append(images.aspect_ratio_ids)
            num_tiles += images.num_tiles
    if not pixels:
        return None
    ar_cpu = torch.cat(ar_ids)
    images = StepImages(None, None, num_tiles, pixels, [int(a) for a in ar_cpu.tolist()])
    if upload:
        cpu = pixels[0] if len(pixels) == 1 else torch.cat(pixels)
        # One image (pinned by the input processor) goes straight across.
        images.pixel_values = to_device(cpu, cpu.dtype, device)
        images.aspect_ratio_ids = to_device(ar_cpu, torch.int64, device)
    return images


def _slots(table: list[int], count: int, page: int) -> torch.Tensor:
    """Slots of positions 0..count-1 through a page table (vectorised: vision groups are
    thousands of tokens)."""
    pages = torch.tensor(table[:-(-count // page)], dtype=torch.int64)
    return (pages[:, None] * page + torch.arange(page)).flatten()[:count]


class _Upload:
    """Integer host arrays sent to the device in one copy (one pinned buffer), then split and
    cast there: a prefill step has a dozen small inputs, and each separate upload costs host
    time in the eager step."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.dtype, torch.Size]] = []

    def add(self, values, dtype: torch.dtype = torch.int64) -> int:
        t = torch.as_tensor(values, dtype=torch.int64)
        self._parts.append((t.reshape(-1), dtype, t.shape))
        return len(self._parts) - 1

    def to(self, device: torch.device) -> list[torch.Tensor]:
        flat = torch.cat([p for p, _, _ in self._parts])
        pieces = to_device(flat, torch.int64, device).split([p.numel() for p, _, _ in self._parts])
        return [x.view(shape) if dtype == torch.int64 else x.to(dtype).view(shape)
                for x, (_, dtype, shape) in zip(pieces, self._parts, strict=True)]


@dataclass(frozen=True)
class _Chunk:
    """A chunk with context, as the step packs it: its first row, its new tokens, the
    tokens before them, its pages."""

    row: int
    new: int
    context: int
    pages: list[int]


# A context group before its upload: (runs, then the upload handles of its pages, its
# ranges and its rows, None for a group of one chunk).
_PendingGroup = tuple[list[tuple[int, int, int, int]], int, int, int | None]


def _context_groups(chunks: list[_Chunk], block_size: int, max_pages: int | None,
                    up: _Upload) -> list[_PendingGroup]:
    """Chunks with context, in step order, grouped so that no group's pages pass
    ``max_pages`` (a chunk alone may fill one; None: no bound); each group's pages, ranges
    and rows go into ``up`` (``ContextGroup`` says what they are)."""
    groups: list[list[_Chunk]] = []
    used = 0
    for c in chunks:
        if not groups or (max_pages is not None and used + len(c.pages) > max_pages):
            groups.append([])
            used = 0
        groups[-1].append(c)
        used += len(c.pages)
    out = []
    for group in groups:
        runs, pages, starts, ends, rows = [], [], [], [], []
        for c in group:
            k0 = len(pages) * block_size
            pages += c.pages
            runs.append((c.row, c.row + c.new, k0, k0 + c.context + c.new))
            # Query i of the chunk (position context + i) sees keys k0 .. k0 + context + i.
            starts.append(torch.full((c.new,), k0, dtype=torch.int64))
            ends.append(torch.arange(k0 + c.context + 1, k0 + c.context + c.new + 1))
            rows.append(torch.arange(c.row, c.row + c.new))
        h_ranges = up.add(torch.stack([torch.cat(starts), torch.cat(ends)], dim=1), torch.int32)
        h_rows = up.add(torch.cat(rows)) if len(group) > 1 else None
        out.append((runs, up.add(pages), h_ranges, h_rows))
    return out


def build_prefill_batch(items: list[PrefillItem], block_size: int, cross_block_size: int,
                        device: torch.device, pad_rows: bool = False,
                        max_context_tokens: int | None = None) -> PrefillBatch:
    """The step's device inputs; ``pad_rows`` appends padding rows up to ``prefill_rows``
    (``metadata.num_tokens`` and ``num_padding`` count them; ``seq_lens`` does not). Chunks
    with context read their pages in groups of at most ``max_context_tokens`` tokens of
    pages (a chunk alone may fill one; the memory reserve, ``memory.context_gather_bytes``,
    holds one group's gather at ``max_model_len``)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []
    runs: list[tuple[int, int, int, int]] = []
    cross_src: list[torch.Tensor] = []
    cross_slots: list[torch.Tensor] = []
    vision_base: dict[object, int] = {}
    n_vision = 0
    parts: list[tuple[torch.Tensor | None, int]] = []
    for owner in _image_owners(items):
        vision_base[owner.vision_key] = n_vision
        n_vision += owner.inputs.num_vision_tokens
        parts.append((owner.encoded, owner.inputs.num_vision_tokens))
    # Cached cross groups: their K/V rows follow the step's fresh vision tokens; a reader's
    # base puts its last group's first row there.
    cache_read: list[torch.Tensor] = []
    n_cached = 0
    for item in items:
        if item.cross_cached and item.sees_images and item.vision_key not in vision_base:
            c0, c1 = item.inputs.cached_vision_range
            vision_base[item.vision_key] = n_vision + n_cached - c0
            cache_read.append(_slots(item.cross_block_table, c1 - c0, cross_block_size))
            n_cached += c1 - c0
    seq_lens, enc_lens, context_lens, last_rows = [], [], [], []
    chunks: list[_Chunk] = []
    for item in items:
        inp, n, s0 = item.inputs, len(item.token_ids), item.start
        t0 = len(ids)
        ids += item.token_ids[s0:]
        positions += range(s0, n)
        slots.append(_slots(item.block_table, n, block_size)[s0:] if item.block_table
                     else torch.full((n - s0,), -1, dtype=torch.int64))
        seq_lens.append(n - s0)
        context_lens.append(s0)
        if s0:
            chunks.append(_Chunk(t0, n - s0, s0, item.block_table[:-(-n // block_size)]))
        if item.samples:
            last_rows.append(t0 + n - s0 - 1)
        item_ranges = [(0, 0)] * (n - s0)
        base = vision_base.get(item.vision_key) if item.sees_images else None
        if base is not None:
            _item_ranges(item, base, t0, item_ranges, runs)
        ranges += item_ranges
        enc_len = inp.encoder_seq_len if base is not None else 0
        enc_lens.append(enc_len)
        if item.write_cross and enc_len > 0 and not item.cross_cached:
            assert base is not None
            c0, c1 = inp.cached_vision_range
            cross_src.append(torch.arange(base + c0, base + c1))
            cross_slots.append(_slots(item.cross_block_table, enc_len, cross_block_size))
    # The attention kernels index the packed vision K/V by these ranges without bounds
    # checks: a range past its rows would read out of bounds on the device.
    ends = max((r[3] for r in runs), default=0)
    if ends > n_vision + n_cached:
        raise RuntimeError(
            f"prefill batch: a vision range ends at row {ends}, past the step's "
            f"{n_vision} encoded and {n_cached} cached vision rows "
            f"(chunks: {[(i.start, len(i.token_ids), i.inputs.num_vision_tokens) for i in items]})")
    pad = prefill_rows(len(ids)) - len(ids) if pad_rows and ids else 0
    if pad:
        ids += [0] * pad
        positions += [0] * pad
        slots.append(torch.full((pad,), -1, dtype=torch.int64))
        ranges += [(0, 0)] * pad

    up = _Upload()
    h_ids, h_pos, h_slots = up.add(ids), up.add(positions), up.add(torch.cat(slots))
    h_ranges = up.add(torch.tensor(ranges, dtype=torch.int64).view(-1, 2), torch.int32)
    h_src = up.add(torch.cat(cross_src)) if cross_src else None
    h_cslots = up.add(torch.cat(cross_slots)) if cross_slots else None
    h_read = up.add(torch.cat(cache_read)) if cache_read else None
    h_last = up.add(last_rows)
    max_pages = None if max_context_tokens is None else -(-max_context_tokens // block_size)
    h_groups = _context_groups(chunks, block_size, max_pages, up)
    dev = up.to(device)

    md = PrefillMetadata(
        num_tokens=len(ids),
        slot_mapping=dev[h_slots],
        seq_lens=seq_lens,
        num_padding=pad,
        max_encoder_seq_len=max(enc_lens),
        cross_kv_ranges=dev[h_ranges],
        cross_range_runs=runs,
        cross_cache_src=dev[h_src] if h_src is not None else None,
        cross_slot_mapping=dev[h_cslots] if h_cslots is not None else None,
        cross_cache_read=dev[h_read] if h_read is not None else None,
        context_lens=context_lens if any(context_lens) else None,
        context_groups=[
            ContextGroup(dev[pages], runs, dev[h_ranges], None if h_rows is None else dev[h_rows])
            for runs, pages, h_ranges, h_rows in h_groups
        ] if h_groups else None,
    )
    return PrefillBatch(
        input_ids=dev[h_ids],
        positions=dev[h_pos],
        metadata=md,
        logits_indices=dev[h_last],
        vision_parts=parts if any(e is not None for e, _ in parts) else [],
        vision_rows={
            key: (b, b + _owner_tokens(items, key))
            for key, b in vision_base.items()
            if not any(i.cross_cached for i in items if i.vision_key == key)
        },
        num_vision_tokens=n_vision,
    )


def _owner_tokens(items: list[PrefillItem], key: object) -> int:
    return next(i.inputs.num_vision_tokens for i in items if i.vision_key == key)


def _item_ranges(item: PrefillItem, base: int, t0: int, item_ranges: list[tuple[int, int]],
                 runs: list[tuple[int, int, int, int]]) -> None:
    """Fills the vision range of each of the item's tokens (``item_ranges``, from its
    ``start``) and appends the step's runs of queries that share one (``runs``)."""
    inp, n, s0 = item.inputs, len(item.token_ids), item.start
    offsets = inp.image_token_offsets()
    item_runs = list(inp.runs)
    prompt_len = len(inp.prompt_token_ids)
    if inp.last_group is not None and n > prompt_len:
        lg0, lg1 = inp.last_group
        item_runs.append(ImageRun(prompt_len, n, lg0, lg1))
    for run in item_runs:
        kv0, kv1 = base + offsets[run.img_start], base + offsets[run.img_end]
        q0, q1 = max(run.tok_start, s0) - s0, min(run.tok_end, n) - s0
        if q1 <= q0:
            continue
        item_ranges[q0:q1] = [(kv0, kv1)] * (q1 - q0)
        if runs and runs[-1][1:] == (t0 + q0, kv0, kv1):
            # Adjacent with the same vision range (an image token and the text after it):
            # one attention call instead of two.
            runs[-1] = (runs[-1][0], t0 + q1, kv0, kv1)
        else:
            runs.append((t0 + q0, t0 + q1, kv0, kv1))
