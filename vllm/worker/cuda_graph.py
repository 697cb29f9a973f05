"""Decode-only CUDA graphs for every batch: a text family and a cross family per bucket.

Buckets are the configuration's ``cuda_graph_sizes`` (1, 2, 4, then multiples of 8 up to
``max_num_seqs`` by default), captured largest first into one shared memory pool after warm-up
runs. A graph's only per-step input is the list of decode rows (padding rows point at the null
row, which writes nowhere and reads a zero-length KV); everything else is read from the
persistent row buffers inside the graph. The page tables are captured at their static widths:
the cross table covers the largest vision group the configuration admits, so no batch ever
falls back to eager.

Family **text** (no sequence in the batch has an image) captures the forward with
``max_encoder_seq_len = 0``: the cross layers are not in the graph at all. Family **cross**
captures them for every row; rows without an image are zeroed on the device.

On the CPU there is nothing to capture: the same forward runs on the same padded buffers with
the same capture-time scalars (emulation), so tests exercise the graph path's data flow.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.logger import init_logger
from vllm.worker.decode_state import DecodeRows

logger = init_logger(__name__)
TEXT, CROSS = "text", "cross"


@dataclass(frozen=True)
class DecodeShape:
    """The host integers a decode forward runs (and is captured) with."""

    bucket: int  # index into the linear layers' kernel tables (forward_context.row_bucket)
    width: int  # page-table columns gathered per row
    cross_width: int
    max_seq_len: int
    max_encoder_seq_len: int  # 0: the text family (no cross layers)


# forward(rows [B] int64 device, shape, logits_out [B, V] float32 or None) -> logits [B, V]
DecodeForward = Callable[[torch.Tensor, DecodeShape, "torch.Tensor | None"], torch.Tensor]


class Replay(NamedTuple):
    """One replayed (or emulated) decode step: views of static buffers, valid until the next
    run."""

    logits: torch.Tensor  # [n, V] float32
    rows: torch.Tensor  # [n] the device row index
    greedy: torch.Tensor  # [n] the logits' row argmax
    key: tuple[str, int]  # (family, bucket size)


class DecodeGraphRunner:
    """Captures and replays the decode forward per (family, bucket)."""

    def __init__(
        self,
        forward: DecodeForward,
        rows: DecodeRows,
        sizes: Sequence[int],
        width: int,
        cross_width: int,
        max_seq_len: int,
        max_encoder_seq_len: int,
        vocab_size: int,
        argmax: Callable[..., torch.Tensor],
    ) -> None:
        self._forward = forward
        self.decode_rows = rows
        self.sizes = sorted(sizes)
        self.null_row = rows.null_row
        self.device = rows.device
        self._argmax = argmax
        self._uploaded_rows: list[int] | None = None  # what static_rows holds, if known
        self.static_rows = torch.full(
            (self.sizes[-1],), self.null_row, dtype=torch.int64, device=self.device
        )
        self.width, self.cross_width = width, cross_width
        self.max_seq_len = max_seq_len
        self.max_encoder_seq_len = max_encoder_seq_len
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # One logits buffer for every graph (each graph's own output buffer would stay
        # allocated: 38 graphs x [bucket, vocab] fp32 is over 1 GB for the 11B at 128 seqs).
        self.static_logits = torch.empty(
            self.sizes[-1], vocab_size, dtype=torch.float32, device=self.device
        )
        # Each row's argmax, computed inside the graph: greedy batches need nothing more.
        self.static_greedy = torch.zeros(self.sizes[-1], dtype=torch.int64, device=self.device)
        self.capture_time_s = 0.0
        self.graph_memory_bytes = 0
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def shape(self, bs: int, family: str) -> DecodeShape:
        """The static shape the (family, ``bs``) graph is captured with."""
        return DecodeShape(
            self.sizes.index(bs),
            self.width,
            self.cross_width,
            self.max_seq_len,
            self.max_encoder_seq_len if family == CROSS else 0,
        )

    def forward(self, bs: int, family: str) -> torch.Tensor:
        """The captured function: decode over ``static_rows[:bs]`` with static scalars,
        logits into the shared static buffer, their row argmax into ``static_greedy``, and
        the rows advanced with it."""
        logits = self._forward(
            self.static_rows[:bs], self.shape(bs, family), self.static_logits[:bs]
        )
        self._argmax(logits, out=self.static_greedy[:bs])
        # Greedy tokens into the rows and positions on: nothing left to launch for a greedy
        # step (the runner rewrites the tokens when it samples others).
        self.decode_rows.advance_greedy(self.static_rows[:bs], self.static_greedy[:bs])
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        if self.device.type != "cuda":
            logger.info("Decode graphs emulated on %s (buckets %s)", self.device.type, self.sizes)
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        # Reserved, not allocated: what a graph frees at the end of its capture stays
        # reserved in its private pool. The shared logits buffer is counted separately.
        mem0 = torch.cuda.memory_reserved() - self.static_logits.numel() * 4
        pool = torch.cuda.graph_pool_handle()
        self.static_rows.fill_(self.null_row)
        self._uploaded_rows = None
        for bs in reversed(self.sizes):
            for family in (CROSS, TEXT):
                for _ in range(2):  # warm-up: kernel compilation and caches outside capture
                    self.forward(bs, family)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(bs, family)
                self.graphs[(family, bs)] = graph
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0
        self.graph_memory_bytes = torch.cuda.memory_reserved() - mem0
        logger.info(
            "Captured %d decode graphs (text + cross families, buckets %s) in %.1f s "
            "using %.2f GiB",
            len(self.graphs),
            self.sizes,
            self.capture_time_s,
            self.graph_memory_bytes / (1 << 30),
        )

    def _upload_rows(self, rows: list[int]) -> None:
        if self.device.type == "cuda":
            # One host->device copy straight into the static buffer, from a fresh pinned
            # tensor (the caching host allocator keeps it until the copy has run).
            pinned = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
            self.static_rows[: len(rows)].copy_(pinned, non_blocking=True)
        else:
            self.static_rows[: len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
        self._uploaded_rows = rows

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise RuntimeError(f"decode batch of {n} exceeds the largest graph ({self.sizes[-1]})")
        return self.sizes[i]

    def run(self, row_ids: list[int], cross: bool) -> Replay:
        """Pads the rows to their bucket and replays (or emulates) the family's graph."""
        n = len(row_ids)
        bs = self.bucket_for(n)
        family = CROSS if cross else TEXT
        rows = row_ids + [self.null_row] * (bs - n)
        if rows != self._uploaded_rows:  # steady decode keeps its rows: nothing to copy
            self._upload_rows(rows)
        if self.device.type != "cuda":
            self.forward(bs, family)
        else:
            self.graphs[(family, bs)].replay()
        views = self._views.get(n)
        if views is None:  # slicing costs host time every step; the views never change
            views = self._views[n] = (
                self.static_logits[:n],
                self.static_rows[:n],
                self.static_greedy[:n],
            )
        return Replay(*views, (family, bs))
