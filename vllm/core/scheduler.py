"""Continuous batching: which sequences run in the next step.

A step is either a prefill of whole prompts (new requests, or preempted ones recomputed) or a
decode of every running sequence. Waiting requests are admitted first-come-first-served under
``max_num_seqs``, ``max_num_batched_tokens``, the per-step vision budget and free pages. When a
decode step lacks pages, the youngest running request is preempted: its pages are freed, it
keeps its tokens and images, and it is recomputed later. Nothing is lost.

While sequences are decoding, prefill is interleaved (``decode_interleave_tokens``): a prefill
step carries a bounded number of prompt tokens and the next step is a decode, so a running
sequence waits for at most one bounded prefill between two tokens. An image request is then
admitted only once its images were encoded ahead of time (the engine spreads that over decode
steps, ``encoder_layers_per_step``); requests behind it may go first meanwhile.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.sequence import Request, Sequence, SequenceStatus
from vllm.logger import init_logger

logger = init_logger(__name__)


class RequestTooLarge(ValueError):
    """The request can never be scheduled with this configuration."""


@dataclass
class SchedulerOutput:
    """What the runner executes in one step."""

    is_prefill: bool
    prefill_seqs: list[Sequence] = field(default_factory=list)  # sequences whose tokens are fed
    samplers: list[list[Sequence]] = field(default_factory=list)  # per prefill seq: who samples
    decode_seqs: list[Sequence] = field(default_factory=list)
    new_pages: list[tuple[Sequence, int]] = field(default_factory=list)  # decode appends
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # after the forward
    preempted: list[Request] = field(default_factory=list)
    sliced: bool = False  # a prefill spread over the decode steps that follow its admission

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_seqs) if self.is_prefill else len(self.decode_seqs)


class Scheduler:
    """Owns the waiting and running queues and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 tiles_per_image: int) -> None:
        self.config = config
        self.bm = block_manager
        self.tiles_per_image = tiles_per_image
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_preemptions = 0
        self._last_was_prefill = False
        # A prefill admitted but spread over decode steps (``prefill_layers_per_step``); it is
        # handed out again as a step once ``sliced_ready`` is set or nothing else can decode.
        self.sliced_prefill: SchedulerOutput | None = None
        self.sliced_ready = False

    # ----------------------------------------------------------------- admission
    def check_fits(self, request: Request) -> None:
        """Raises :class:`RequestTooLarge` if no state of the engine could ever run it."""
        c, n = self.config, request.params.n
        prompt = len(request.inputs.prompt_token_ids)
        if prompt > c.max_num_batched_tokens:
            raise RequestTooLarge(f"The prompt has {prompt} tokens, more than "
                                  f"max_num_batched_tokens ({c.max_num_batched_tokens}).")
        if n > c.max_num_seqs:
            raise RequestTooLarge(f"n={n} exceeds max_num_seqs ({c.max_num_seqs}).")
        tiles = request.inputs.num_images * self.tiles_per_image
        if tiles > c.max_num_encoder_tiles:
            raise RequestTooLarge(f"The request's {request.inputs.num_images} image(s) need "
                                  f"{tiles} encoder tiles per step, more than "
                                  f"max_num_encoder_tiles ({c.max_num_encoder_tiles}).")
        max_tokens = request.params.max_tokens
        max_len = min(c.max_model_len,
                      prompt + (c.max_model_len if max_tokens is None else max_tokens))
        need = n * self.bm.pages_for_tokens(max_len) + self.bm.cross_pages_for(request)
        if need > self.bm.pool.num_allocatable:
            raise RequestTooLarge(
                f"The request needs {need} KV pages at its longest, but the cache has only "
                f"{self.bm.pool.num_allocatable}; lower max_tokens or n, or give the cache more "
                "memory (--gpu-memory-utilization).")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(next(self._seq_ids), request, 0, list(request.inputs.prompt_token_ids))
        request.seqs = [seq]
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(len(r.unfinished_seqs()) for r in self.running)

    # ----------------------------------------------------------------- scheduling
    def schedule(self, lookahead: bool = False) -> SchedulerOutput | None:
        """The next step. With ``lookahead`` (a step is still in flight, its results unread)
        only a decode step that needs no admission decision and no preemption is scheduled;
        None tells the caller to collect the in-flight step first."""
        if self.sliced_prefill is not None and (self.sliced_ready
                                                or not self._decode_candidates()):
            out = self._emit_sliced()
        elif lookahead:
            out = self._schedule_lookahead()
        elif self._decode_turn():
            out = self._schedule_decode()
        else:
            out = self._schedule_prefill()
            if out is None and self.running:
                out = self._schedule_decode()
        if out is not None:
            self._last_was_prefill = out.is_prefill
        return out

    @property
    def interleaving(self) -> bool:
        """Sequences are decoding and prefill steps are bounded and alternate with decodes."""
        return self.config.decode_interleave_tokens > 0 and bool(self.running)

    def _emit_sliced(self) -> SchedulerOutput:
        out = self.sliced_prefill
        assert out is not None
        self.clear_sliced()
        return out

    def clear_sliced(self) -> None:
        """Forgets the spread prefill (emitted, failed or cancelled); its sequences decode."""
        if self.sliced_prefill is not None:
            for group in self.sliced_prefill.samplers:
                for s in group:
                    s.prefilling = False
        self.sliced_prefill, self.sliced_ready = None, False

    def _cancel_sliced(self, keep: Request | None) -> None:
        """A request of the spread prefill is preempted or aborted: the others go back to
        the queue too (their prefill never ran to the end)."""
        out = self.sliced_prefill
        assert out is not None
        self.clear_sliced()
        for req in {id(s.request): s.request for s in out.prefill_seqs}.values():
            if req is not keep and req in self.running:
                self._preempt(req)

    def _in_sliced(self, request: Request) -> bool:
        out = self.sliced_prefill
        return out is not None and any(s.request is request for s in out.prefill_seqs)

    def _decode_turn(self) -> bool:
        return self.interleaving and self._last_was_prefill

    def needs_encoding(self, request: Request) -> bool:
        """An image request that may not be admitted before its images are encoded."""
        return (self.interleaving and self.config.encoder_layers_per_step > 0
                and request.has_images and request.encoded_images is None)

    def next_to_encode(self, max_ready: int = 2) -> Request | None:
        """The first waiting request to encode ahead of its prefill (None while ``max_ready``
        encoded requests already wait, which bounds the memory they hold)."""
        ready = sum(1 for r in self.waiting if r.encoded_images is not None)
        if ready >= max_ready:
            return None
        return next((r for r in self.waiting if self.needs_encoding(r)), None)

    def _will_finish_by_length(self, s: Sequence) -> bool:
        """Known on the host: the in-flight token completes the sequence."""
        max_tokens = s.request.params.max_tokens
        return ((max_tokens is not None and s.num_output_tokens + s.inflight >= max_tokens)
                or len(s) + s.inflight >= self.config.max_model_len)

    def _decode_candidates(self) -> list[Sequence]:
        return [s for r in self.running for s in r.unfinished_seqs()
                if not s.prefilling and not self._will_finish_by_length(s)]

    def _schedule_lookahead(self) -> SchedulerOutput | None:
        if (self.waiting and not self._decode_turn() and self.sliced_prefill is None
                and not all(self.needs_encoding(r) for r in self.waiting)):
            # An admission is due. While interleaving it is made without the in-flight results
            # (conservatively: sequences finishing in flight still count), so the host launches
            # the prefill while the GPU still runs the previous step; None if it does not fit.
            return self._schedule_prefill() if self.interleaving else None
        seqs = self._decode_candidates()
        need = sum(1 for s in seqs if self.bm.needs_new_page(s))
        if not seqs or need > self.bm.pool.num_free:
            return None
        out = SchedulerOutput(is_prefill=False, decode_seqs=seqs)
        out.new_pages = [(s, self.bm.append_page(s)) for s in seqs if self.bm.needs_new_page(s)]
        return out

    def _seqs_after_prefill(self, request: Request) -> int:
        return len(request.unfinished_seqs()) + (
            0 if request.forked else request.params.n - 1)

    def _schedule_prefill(self) -> SchedulerOutput | None:
        c = self.config
        if self.sliced_prefill is not None:
            return None  # one spread prefill at a time
        out = SchedulerOutput(is_prefill=True,
                              sliced=self.interleaving and c.prefill_layers_per_step > 0)
        tokens = tiles = pages = 0
        max_tokens = c.max_num_batched_tokens
        if self.interleaving:
            max_tokens = min(max_tokens, c.decode_interleave_tokens)
        num_seqs = self.num_running_seqs()
        admitted = []
        for req in self.waiting:
            if self.needs_encoding(req):
                continue  # its images are being encoded; later requests may go first
            seqs = req.unfinished_seqs()
            n_tok = sum(len(s) for s in seqs)
            n_tiles = req.inputs.num_images * self.tiles_per_image
            n_pages = self.bm.pages_needed_for_prefill(req, seqs)
            if not req.forked:
                n_pages += req.params.n - 1  # each child's copy of a partial last page
            if (num_seqs + self._seqs_after_prefill(req) > c.max_num_seqs
                    or (admitted and tokens + n_tok > max_tokens)
                    or tokens + n_tok > c.max_num_batched_tokens
                    or tiles + n_tiles > c.max_num_encoder_tiles
                    or pages + n_pages > self.bm.pool.num_free):
                break
            admitted.append(req)
            tokens, tiles, pages = tokens + n_tok, tiles + n_tiles, pages + n_pages
            num_seqs += self._seqs_after_prefill(req)
        for req in admitted:
            self.waiting.remove(req)
            self._admit(req, req.unfinished_seqs(), out)
        if not out.prefill_seqs:
            return None
        if out.sliced:
            self.sliced_prefill = out
            for group in out.samplers:
                for s in group:
                    s.prefilling = True
        return out

    def _admit(self, req: Request, seqs: list[Sequence], out: SchedulerOutput) -> None:
        self.bm.allocate_prefill(req, seqs)
        for s in seqs:
            s.status = SequenceStatus.RUNNING
            out.prefill_seqs.append(s)
            out.samplers.append([s])
        if not req.forked and req.params.n > 1:
            parent = seqs[0]
            for i in range(1, req.params.n):
                child = Sequence(next(self._seq_ids), req, i, list(parent.token_ids),
                                 status=SequenceStatus.RUNNING)
                page = self.bm.fork(parent, child)
                if page is not None:
                    out.page_copies.append((parent.block_table[-1], page))
                req.seqs.append(child)
                out.samplers[-1].append(child)
        req.forked = True
        self.running.append(req)

    def _schedule_decode(self) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False)
        while True:
            seqs = self._decode_candidates()
            need = sum(1 for s in seqs if self.bm.needs_new_page(s))
            if need <= self.bm.pool.num_free or len(self.running) <= 1:
                break
            victim = max(self.running, key=lambda r: r.arrival_time)
            self._preempt(victim)
            out.preempted.append(victim)
        if need > self.bm.pool.num_free:
            # Cannot happen for requests that passed check_fits; preempt the last one too.
            victim = self.running[0]
            self._preempt(victim)
            out.preempted.append(victim)
            seqs = []
        for s in seqs:
            if self.bm.needs_new_page(s):
                out.new_pages.append((s, self.bm.append_page(s)))
        out.decode_seqs = seqs
        return out

    def preempt(self, request: Request) -> None:
        """Frees a running request's pages and queues it for recomputation."""
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        if self._in_sliced(request):
            self._cancel_sliced(keep=request)
        self.running.remove(request)
        for s in request.unfinished_seqs():
            self.bm.free_seq(s)
            s.status = SequenceStatus.WAITING
        self.bm.free_cross(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the queue in arrival order, ahead of anything that arrived later.
        index = next((i for i, r in enumerate(self.waiting)
                      if r.arrival_time > request.arrival_time), len(self.waiting))
        self.waiting.insert(index, request)
        logger.debug("Preempted request %s (recompute)", request.request_id)

    # ----------------------------------------------------------------- completion
    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        if seq.block_table:
            self.bm.free_seq(seq)

    def release_finished(self) -> list[Request]:
        """Removes finished requests, freeing their cross pages; returns them."""
        done = [r for r in self.running if r.finished]
        for r in done:
            self.running.remove(r)
            self.bm.free_cross(r)
            del self.requests[r.request_id]
        return done

    def abort(self, request_id: str) -> Request | None:
        """Frees everything the request holds, at any point of its life."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self._in_sliced(req):
            self._cancel_sliced(keep=req)
        for s in req.seqs:
            if s.block_table:
                self.bm.free_seq(s)
            if not s.status.finished:
                s.status = SequenceStatus.FINISHED_ABORTED
        self.bm.free_cross(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        return req

    def check_integrity(self) -> None:
        self.bm.check_integrity(self.requests.values())
