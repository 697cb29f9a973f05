"""Decode-only CUDA graphs for every batch: a text family and a cross family per bucket.

Buckets are 1, 2, 4, then multiples of 8 up to ``max_num_seqs`` (or ``cuda_graph_sizes``),
captured largest first into one shared memory pool after warm-up runs. A graph's only
per-step input is the list of decode rows (padding rows point at the null row, which writes
nowhere and reads a zero-length KV); everything else is read from the persistent row buffers
inside the graph. The page tables are captured at their static widths: the cross table covers
the largest vision group the configuration admits, so no batch ever falls back to eager.

Family **text** (no sequence in the batch has an image) captures the forward with
``max_encoder_seq_len = 0``: the cross layers are not in the graph at all. Family **cross**
captures them for every row; rows without an image are zeroed on the device.

On the CPU there is nothing to capture: the same forward runs on the same padded buffers with
the same capture-time scalars (emulation), so tests exercise the graph path's data flow.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.sampling_utils import row_argmax

if TYPE_CHECKING:
    from vllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)
TEXT, CROSS = "text", "cross"


class DecodeGraphRunner:
    """Captures and replays the decode forward per (family, bucket)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        cfg = runner.config
        max_num_seqs = cfg.scheduler_config.max_num_seqs
        sizes = sorted(set(cfg.compilation_config.cuda_graph_sizes))
        if not sizes or sizes[-1] < max_num_seqs:
            logger.info("Adding decode graph size %d to cover max_num_seqs", max_num_seqs)
            sizes.append(max_num_seqs)
        self.sizes = sizes
        assert runner.rows is not None
        self.null_row = runner.rows.null_row
        self.device = runner.device
        self._uploaded_rows: list[int] | None = None  # what static_rows holds, if known
        self.static_rows = torch.full((sizes[-1],), self.null_row, dtype=torch.int64,
                                      device=self.device)
        self.width = runner.max_pages_per_seq
        self.cross_width = runner.max_cross_pages
        self.max_seq_len = cfg.model_config.max_model_len
        self.max_encoder_seq_len = cfg.model_config.max_encoder_seq_len
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # One logits buffer for every graph (each graph's own output buffer would stay
        # allocated: 38 graphs x [bucket, vocab] fp32 is over 1 GB for the 11B at 128 seqs).
        vocab = cfg.model_config.spec.text.vocab_size
        self.static_logits = torch.empty(sizes[-1], vocab, dtype=torch.float32,
                                         device=self.device)
        # Each row's argmax, computed inside the graph: greedy batches need nothing more.
        self.static_greedy = torch.zeros(sizes[-1], dtype=torch.int64, device=self.device)
        self.capture_time_s = 0.0
        self.graph_memory_bytes = 0
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, bs: int, family: str) -> torch.Tensor:
        """The captured function: decode over ``static_rows[:bs]`` with static scalars,
        logits into the shared static buffer, their row argmax into ``static_greedy``, and
        the rows advanced with it."""
        enc = self.max_encoder_seq_len if family == CROSS else 0
        logits = self.runner.decode_forward(self.static_rows[:bs], self.width, self.cross_width,
                                            self.max_seq_len, enc,
                                            logits_out=self.static_logits[:bs])
        row_argmax(logits, out=self.static_greedy[:bs])
        # Greedy tokens into the rows and positions on: nothing left to launch for a greedy
        # step (the runner rewrites the tokens when it samples others).
        assert self.runner.rows is not None
        self.runner.rows.advance_greedy(self.static_rows[:bs], self.static_greedy[:bs])
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        if self.device.type != "cuda":
            logger.info("Decode graphs emulated on %s (buckets %s)", self.device.type,
                        self.sizes)
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
        logger.info("Captured %d decode graphs (text + cross families, buckets %s) in %.1f s "
                    "using %.2f GiB", len(self.graphs), self.sizes, self.capture_time_s,
                    self.graph_memory_bytes / (1 << 30))

    def _upload_rows(self, rows: list[int]) -> None:
        if self.device.type == "cuda":
            # One host->device copy straight into the static buffer, from a fresh pinned
            # tensor (the caching host allocator keeps it until the copy has run).
            pinned = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
            self.static_rows[:len(rows)].copy_(pinned, non_blocking=True)
        else:
            self.static_rows[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
        self._uploaded_rows = rows

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise RuntimeError(f"decode batch of {n} exceeds the largest graph ({self.sizes[-1]})")
        return self.sizes[i]

    def run(self, row_ids: list[int],
            cross: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pads the rows to their bucket and replays (or emulates) the family's graph.

        Returns the logits [n, V], the device row index [n] and the logits' row argmax [n]
        (views of static buffers, valid until the next run)."""
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
        self.runner.stats.graph_replays[(family, bs)] += 1
        views = self._views.get(n)
        if views is None:  # slicing costs host time every step; the views never change
            views = self._views[n] = (self.static_logits[:n], self.static_rows[:n],
                                      self.static_greedy[:n])
        return views
