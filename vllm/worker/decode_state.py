"""Persistent per-sequence decode state on the device.

Each running sequence owns a row. The row holds its next input token, the position of that
token, its page table, its cross page table and its cached vision length. A decode step only
uploads the list of rows (and page appends); the sampled tokens are written into the rows on
the device and positions advance there, so no step waits on the host for its inputs.
Row ``null_row`` is padding: position -1 (length 0, slot -1), null pages, no vision tokens.
Rows past it are run rows (``load_run``): a short prefill chunk's tokens, one per row, replayed
in the decode graph with the running sequences (see ``ModelRunner._row_chunks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.utils import to_device


@dataclass
class DecodeInputs:
    """Gathered inputs of one decode step (B rows, padding included)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64 (-1 for padding)
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int32
    encoder_seq_lens: torch.Tensor  # [B] int32
    cross_block_tables: torch.Tensor  # [B, Wc] int32
    kv_ids: torch.Tensor  # [B] int32: equal for the rows of one row chunk (same pages)


class DecodeRows:
    """Device buffers indexed by row; ``max_rows`` real rows plus the null row."""

    def __init__(self, max_rows: int, max_pages: int, max_cross_pages: int, block_size: int,
                 device: torch.device, fused: bool = False, run_rows: int = 0) -> None:
        self.max_rows = max_rows
        self.null_row = max_rows
        self.run_start = max_rows + 1  # first of ``run_rows`` rows for ``load_run``
        self.run_rows = run_rows
        self.block_size = block_size
        self.device = device
        n = max_rows + 1 + run_rows
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max(max_pages, 1), dtype=torch.int32, device=device)
        self.cross_tables = torch.zeros(n, max(max_cross_pages, 1), dtype=torch.int32,
                                        device=device)
        self.encoder_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # Each row its own id, but the rows of one run, which take their first row's
        # (``load_run``): the decode kernel serves them from one read of their pages.
        self.kv_ids = torch.arange(n, dtype=torch.int32, device=device)
        self._ones = torch.ones(n, dtype=torch.int64, device=device)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # With fused kernels, ``gather`` and ``advance_greedy`` are one Triton launch each
        # (``row_advance.py``; imported only then: CPU installs have no Triton).
        self._gather_rows = self._advance_rows = None
        if fused:
            from vllm.worker import row_advance

            self._gather_rows = row_advance.gather_rows
            self._advance_rows = row_advance.advance_rows

    def acquire(self) -> int:
        if not self.free_rows:
            raise RuntimeError("no free decode row (more running sequences than max_num_seqs)")
        return self.free_rows.pop()

    def release(self, row: int) -> None:
        assert 0 <= row < self.max_rows and row not in self.free_rows
        # fill_ with a Python number launches a kernel; item assignment (t[row] = v) would copy
        # a host scalar from pageable memory, which synchronises the stream.
        self.positions[row:row + 1].fill_(-1)
        self.encoder_lens[row:row + 1].fill_(0)
        self.free_rows.append(row)

    def load(self, row: int, block_table: list[int], cross_table: list[int],
             encoder_len: int, position: int) -> None:
        """Initialises a row after its prefill (the token is written by the sampler)."""
        bt, ct = self._tables(block_table, cross_table)
        self.block_tables[row].copy_(bt)
        self.cross_tables[row].copy_(ct)
        self.encoder_lens[row:row + 1].fill_(encoder_len)
        self.positions[row:row + 1].fill_(position)

    def _tables(self, block_table: list[int],
                cross_table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's page tables at the rows' widths, zero-padded, on the device (one
        upload)."""
        width = self.block_tables.shape[1]
        host = torch.zeros(width + self.cross_tables.shape[1], dtype=torch.int32)
        host[:len(block_table)] = torch.tensor(block_table, dtype=torch.int32)
        if cross_table:
            host[width:width + len(cross_table)] = torch.tensor(cross_table, dtype=torch.int32)
        tables = to_device(host, torch.int32, self.device)
        return tables[:width], tables[width:]

    def load_run(self, first: int, block_table: list[int], cross_table: list[int],
                 encoder_len: int, tokens: list[int], position: int) -> None:
        """Loads run rows ``first ..`` with the consecutive tokens of one sequence from
        ``position`` on, all with its page tables: as decode rows they write their K/V at
        their positions and attend to everything before (causal), as its prefill would."""
        n = len(tokens)
        assert self.run_start <= first and first + n <= self.run_start + self.run_rows
        bt, ct = self._tables(block_table, cross_table)
        rows = slice(first, first + n)
        self.block_tables[rows].copy_(bt.expand(n, -1))
        self.cross_tables[rows].copy_(ct.expand(n, -1))
        self.encoder_lens[rows].fill_(encoder_len)
        self.kv_ids[rows].fill_(first)
        toks = to_device(tokens, torch.int64, self.device)
        self.tokens[rows].copy_(toks)
        torch.arange(position, position + n, out=self.positions[rows])

    def set_pages(self, updates: list[tuple[int, int, int]]) -> None:
        """(row, page index, page) writes for pages appended this step."""
        if not updates:
            return
        # One upload (flat table indices, then pages) and one index_copy_.
        width = self.block_tables.stride(0)
        k = len(updates)
        u = to_device([r * width + i for r, i, _ in updates] + [p for _, _, p in updates],
                      torch.int64, self.device)
        self.block_tables.view(-1).index_copy_(0, u[:k], u[k:].to(torch.int32))

    def gather(self, rows: torch.Tensor, width: int, cross_width: int) -> DecodeInputs:
        """Inputs of the rows (device index tensor), with page tables cut to the widths.
        The fused kernel (``row_advance.gather_rows``) does what the torch code below does."""
        if self._gather_rows is not None:
            return DecodeInputs(*self._gather_rows(rows, self.tokens, self.positions,
                                                   self.block_tables, self.encoder_lens,
                                                   self.cross_tables, self.kv_ids,
                                                   self.block_size, width, cross_width))
        positions = self.positions[rows]
        tables = self.block_tables[rows, :width]
        valid = positions >= 0
        pos0 = torch.clamp(positions, min=0)
        page_idx = torch.div(pos0, self.block_size, rounding_mode="floor")
        pages = torch.gather(tables, 1, page_idx.unsqueeze(1)).squeeze(1).to(torch.int64)
        slots = pages * self.block_size + (pos0 - page_idx * self.block_size)
        return DecodeInputs(
            input_ids=self.tokens[rows],
            positions=positions,
            seq_lens=(positions + 1).to(torch.int32),
            slot_mapping=torch.where(valid, slots, torch.full_like(slots, -1)),
            block_tables=tables,
            encoder_seq_lens=self.encoder_lens[rows],
            cross_block_tables=self.cross_tables[rows, :cross_width],
            kv_ids=self.kv_ids[rows],
        )

    def advance(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        """Writes the sampled tokens into their rows and moves positions one step on."""
        self.tokens.index_copy_(0, rows, sampled)
        self.positions.index_add_(0, rows, self._ones[:rows.shape[0]])

    def advance_greedy(self, rows: torch.Tensor, greedy: torch.Tensor) -> None:
        """``advance`` with each row's greedy token, skipping padding (null) rows: what a
        decode graph does after its argmax, so a greedy step launches nothing more. A step
        that samples other tokens then rewrites them with ``set_tokens``."""
        if self._advance_rows is not None:
            self._advance_rows(rows, greedy, self.tokens, self.positions, self.null_row)
            return
        # The same without a data-dependent index (nothing here may read tensor data on the
        # host): padding rows rewrite the null row's own token and add 0 to its position.
        live = rows != self.null_row
        self.tokens.index_copy_(0, rows, torch.where(live, greedy, self.tokens[rows]))
        self.positions.index_add_(0, rows, live.to(self.positions.dtype))

    def set_tokens(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows, sampled)
