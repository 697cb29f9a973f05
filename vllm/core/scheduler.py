"""Continuous batching under a token budget: what each step carries.

A step carries, in this order of precedence:

1. a **decode** of every running sequence whose prompt is done (always a CUDA-graph replay);
2. **prefill** work within ``max_num_batched_tokens`` (vLLM's meaning: the decode tokens
   count too): first the next chunks of admitted requests still prefilling, then newly
   admitted requests. With ``enable_chunked_prefill`` a prompt is cut to what the budget has
   left and continues in later steps; without it a prompt runs whole (prefill-first);
3. **encoder** work: the images of waiting requests are encoded a few layers per step before
   their prefill (``encoder_layers_per_step`` 0: inside the prefill). A step runs
   ``encoder_layers_per_step`` image-layers, plus as many as the token budget has left after
   decode and prefill at the encoder's cost in tokens (``encoder_layer_tokens``: one layer over
   a 4-tile image costs as many FLOPs as 27 tokens of 11B's prefill, 3 of 90B's). So images are
   encoded fast when no prompt waits for the budget, and still advance when prompts fill it;
   a step's work stays within about the budget plus the encoder's own share.

Order: requests are served by ``(priority, arrival)`` under ``scheduling_policy="priority"``
(lower values first, vLLM's rule) and by arrival under ``"fcfs"``. A waiting request whose
piece does not fit what is left of the step (its whole prompt without chunking, its pages, or
the step's vision budget ``max_num_encoder_tiles``) lets later requests use it, but for at
most ``MAX_SKIPPED_STEPS`` steps. After that nothing behind it is admitted until it is: a
prompt that fits the budget alone gets the next step with no decode in it (so smaller requests
behind it wait at most ``MAX_SKIPPED_STEPS + 1`` steps), and one short of pages waits for
running requests to finish (each does within ``max_model_len`` steps), so no request starves.
Requests whose images are being encoded are not skipped: they progress every step.

Pages are allocated for a whole prompt when it is admitted (decode pages one at a time);
with prefix caching its first pages may be cached ones, and its prefill starts after them
(they are to it what earlier chunks are to a chunked prompt). When
a decode lacks pages the request last in order is preempted: its pages are freed, its prefill
record dropped (``PrefillTracker.reset``), it keeps its tokens and images and is recomputed
later. Nothing is lost at any point of a chunked or batched prefill.
"""

from __future__ import annotations

import bisect
import itertools

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.prefill_tracker import PrefillProgress, PrefillTracker
from vllm.core.scheduler_output import EncoderWork, PrefillChunk, SchedulerOutput
from vllm.core.sequence import Request, Sequence, SequenceStatus
from vllm.logger import init_logger

logger = init_logger(__name__)

# How many steps a waiting request that does not fit lets later ones go first.
MAX_SKIPPED_STEPS = 4
# Waiting requests whose images may be encoded ahead at once (each holds its vision tokens).
MAX_ENCODED_AHEAD = 2
_WAITS_FOR_PARENT = -1  # a sibling forked at admission, sampled by its parent's last chunk


def encoder_layer_tokens(text, vision) -> int:
    """Text tokens whose prefill costs as many FLOPs as one encoder layer over one image of
    ``vision.max_num_tiles`` tiles (linears, and attention over the image's tiles), rounded up."""
    n = vision.max_num_tiles * vision.tokens_per_tile
    h, f = vision.hidden_size, vision.intermediate_size
    layer = n * 2 * (4 * h * h + 2 * h * f) + 4 * n * n * h
    th, tf, kv = text.hidden_size, text.intermediate_size, text.num_key_value_heads * text.head_dim
    token = 2 * text.num_hidden_layers * (2 * th * th + 2 * th * kv + 3 * th * tf)
    return -(-layer // token)


class RequestTooLarge(ValueError):
    """The request can never be scheduled with this configuration."""


class Scheduler:
    """Owns the waiting and running queues, the block manager and the prefill records."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 tiles_per_image: int, encoder_layers_per_image: int,
                 encoder_layer_tokens: int = 0) -> None:
        self.config = config
        self.bm = block_manager
        self.tiles_per_image = tiles_per_image
        # Prefill tokens one image-layer costs as much as (0: the encoder's own budget only).
        self.encoder_layer_tokens = encoder_layer_tokens
        self.tracker = PrefillTracker(encoder_layers_per_image)
        self.waiting: list[Request] = []  # in service order (``_key``)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._skipped: dict[str, int] = {}  # waiting request -> steps it let others go first
        self.num_preemptions = 0

    # ----------------------------------------------------------------- admission
    def check_fits(self, request: Request) -> None:
        """Raises :class:`RequestTooLarge` if no state of the engine could ever run it."""
        c, n = self.config, request.params.n
        prompt = len(request.inputs.prompt_token_ids)
        if not c.enable_chunked_prefill and prompt > c.max_num_batched_tokens:
            raise RequestTooLarge(f"The prompt has {prompt} tokens, more than "
                                  f"max_num_batched_tokens ({c.max_num_batched_tokens}) "
                                  "without chunked prefill.")
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
        request.arrival_index = next(self._arrivals)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _key(self, request: Request) -> tuple:
        order = (request.arrival_time, request.arrival_index)
        if self.config.scheduling_policy == "priority":
            return (request.priority, *order)
        return order

    def _enqueue(self, request: Request) -> None:
        keys = [self._key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._key(request)), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(len(r.unfinished_seqs()) for r in self.running)

    # ----------------------------------------------------------------- scheduling
    def schedule(self, lookahead: bool = False) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to run. With ``lookahead`` (a step is
        still in flight, its results unread) a step that would need a preemption, or a decode
        left out for a request that waited too long, is not scheduled (None): the caller
        collects the in-flight step first and asks again."""
        out = SchedulerOutput()
        seqs = self._decode_candidates()
        if self._decode_yields(seqs):
            if lookahead:
                return None
            seqs = []
        elif not self._fit_decode(seqs, out, lookahead):
            return None
        self._schedule_prefill(out, self.config.max_num_batched_tokens - len(out.decode_seqs))
        self._schedule_encoder(out)
        assert out.num_tokens <= self.config.max_num_batched_tokens
        return None if out.is_empty and not out.preempted else out

    def _will_finish_by_length(self, s: Sequence) -> bool:
        """Known on the host: the in-flight token completes the sequence."""
        max_tokens = s.request.params.max_tokens
        return ((max_tokens is not None and s.num_output_tokens + s.inflight >= max_tokens)
                or len(s) + s.inflight >= self.config.max_model_len)

    def _decode_candidates(self) -> list[Sequence]:
        return [s for r in self.running for s in r.unfinished_seqs()
                if not self.tracker.is_prefilling(s) and not self._will_finish_by_length(s)]

    def _fit_decode(self, seqs: list[Sequence], out: SchedulerOutput, lookahead: bool) -> bool:
        """Allocates the decode's new pages, preempting the requests last in order while
        they lack (not with ``lookahead``: False then)."""
        while sum(1 for s in seqs if self.bm.needs_new_page(s)) > self.bm.pool.num_free:
            if lookahead:
                return False
            victim = max(self.running, key=self._key)
            self._preempt(victim)
            out.preempted.append(victim)
            seqs = self._decode_candidates()
        for s in seqs:
            if self.bm.needs_new_page(s):
                out.new_pages.append((s, self.bm.append_page(s)))
        out.decode_seqs = seqs
        return True

    def _decode_yields(self, decode: list[Sequence]) -> bool:
        """A waiting request was passed over ``MAX_SKIPPED_STEPS`` times and its whole prompt
        fits the budget only without the decode: this step runs no decode."""
        c = self.config
        if c.enable_chunked_prefill or not decode:
            return False
        head = next((r for r in self.waiting
                     if self._skipped.get(r.request_id, 0) >= MAX_SKIPPED_STEPS), None)
        if head is None:
            return False
        tokens = len(head.unfinished_seqs()[0])
        budget = c.max_num_batched_tokens
        return (budget - len(decode) < tokens <= budget
                and self._admission_pages(head) <= self.bm.pool.num_free)

    def _admission_pages(self, req: Request) -> int:
        pages = self.bm.pages_needed_for_prefill(req, req.unfinished_seqs())
        return pages + (0 if req.forked else req.params.n - 1)  # children's last-page copies

    def _seqs_after_prefill(self, request: Request) -> int:
        return len(request.unfinished_seqs()) + (0 if request.forked else request.params.n - 1)

    def _schedule_prefill(self, out: SchedulerOutput, budget: int) -> None:
        c = self.config
        tiles = c.max_num_encoder_tiles
        carried: set[str] = set()  # requests whose vision tokens this step carries
        for req in sorted((r for r in self.running if self._prefilling(r)), key=self._key):
            budget, tiles = self._chunks(req, out, budget, tiles, carried)
        num_seqs = self.num_running_seqs()
        passed: list[Request] = []
        overtaken: set[str] = set()
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req in out.preempted:
                continue  # preempted for this step's decode: not re-admitted in it
            if self._needs_encoding(req):
                continue  # its images are being encoded; it is not passed over
            if num_seqs + self._seqs_after_prefill(req) > c.max_num_seqs:
                break
            if not self._fits(req, budget, tiles, carried):
                if self._skipped.get(req.request_id, 0) >= MAX_SKIPPED_STEPS:
                    break  # it waited long enough: nothing behind it goes first
                passed.append(req)
                continue
            self._admit(req)
            num_seqs += self._seqs_after_prefill(req)
            budget, tiles = self._chunks(req, out, budget, tiles, carried)
            overtaken.update(r.request_id for r in passed)
        for rid in overtaken:  # later requests went ahead of them in this step
            self._skipped[rid] = self._skipped.get(rid, 0) + 1

    def _prefilling(self, req: Request) -> bool:
        return any(self.tracker.is_prefilling(s) for s in req.unfinished_seqs())

    def _needs_encoding(self, req: Request) -> bool:
        if not req.has_images or self.config.encoder_layers_per_step == 0:
            return False
        p = self.tracker.get(req)
        if p is None:  # a cached cross group may make its vision unnecessary
            return not self.bm.skips_vision(req, req.unfinished_seqs())
        return not p.encoded

    def _chunk_tiles(self, req: Request, start: int, end: int, carried: set[str]) -> int:
        """Vision tiles a chunk adds to the step (its request's images, once per step; none
        when its prefill reads a cached cross group instead)."""
        if req.request_id in carried or not req.inputs.sees_images(start, end):
            return 0
        if req.cross_cached:
            return 0
        return req.inputs.num_images * self.tiles_per_image

    def _fits(self, req: Request, budget: int, tiles: int, carried: set[str]) -> bool:
        """Whether the request's first piece fits what is left of the step: its first
        sequence whole without chunking (a recomputed request's siblings may follow in later
        steps), any part of it with."""
        seq = req.unfinished_seqs()[0]
        if self._admission_pages(req) > self.bm.pool.num_free:
            return False
        start = self.bm.cached_tokens(seq)
        if not self.config.enable_chunked_prefill and len(seq) - start > budget:
            return False
        if req.has_images and self.bm.skips_vision(req, req.unfinished_seqs()):
            return True
        return self._chunk_tiles(req, start, min(len(seq), start + budget), carried) <= tiles

    def _chunks(self, req: Request, out: SchedulerOutput, budget: int, tiles: int,
                carried: set[str]) -> tuple[int, int]:
        """Schedules the request's next chunks within ``budget`` tokens and ``tiles``."""
        p = self.tracker.get(req)
        assert p is not None
        for s in req.unfinished_seqs():
            start = p.computed.get(s.seq_id)
            if start is None or start == _WAITS_FOR_PARENT:
                continue
            if budget <= 0:
                break
            end = min(len(s), start + budget)
            if end < len(s) and not self.config.enable_chunked_prefill:
                break  # whole sequences only: this one goes in a later step
            need = self._chunk_tiles(req, start, end, carried)
            if need > tiles:
                break  # its vision does not fit this step: the next one (it goes first)
            if need:
                carried.add(req.request_id)
                tiles -= need
            progress, start, last = self.tracker.chunk(s, end)
            chunk = PrefillChunk(s, start, end, progress)
            if last:
                chunk.samplers = [s] + self._release_children(progress, s, out)
            out.chunks.append(chunk)
            budget -= end - start
        self.tracker.finish_if_done(req)
        return budget, tiles

    def _admit(self, req: Request) -> None:
        self.waiting.remove(req)
        self._skipped.pop(req.request_id, None)
        seqs = req.unfinished_seqs()
        starts = self.bm.allocate_prefill(req, seqs)
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        progress = self.tracker.admit(req, seqs, starts)
        if not req.forked and req.params.n > 1:
            parent = seqs[0]
            children = []
            for i in range(1, req.params.n):
                child = Sequence(next(self._seq_ids), req, i, list(parent.token_ids),
                                 status=SequenceStatus.RUNNING)
                page = self.bm.fork(parent, child)
                if page is not None:
                    progress.page_copies.append((parent.block_table[-1], page))
                req.seqs.append(child)
                progress.computed[child.seq_id] = _WAITS_FOR_PARENT
                children.append(child)
            progress.children[parent.seq_id] = children
        req.forked = True
        self.running.append(req)

    @staticmethod
    def _release_children(progress: PrefillProgress, parent: Sequence,
                          out: SchedulerOutput) -> list[Sequence]:
        """The siblings forked from ``parent`` sample from its last chunk and decode after."""
        children = progress.children.pop(parent.seq_id, [])
        for child in children:
            progress.computed.pop(child.seq_id, None)
        if children:
            out.page_copies += progress.page_copies
            progress.page_copies = []
        return children

    def _schedule_encoder(self, out: SchedulerOutput) -> None:
        budget = self.config.encoder_layers_per_step
        if budget == 0:
            return
        if self.encoder_layer_tokens:  # what the token budget left, at the encoder's cost
            budget += ((self.config.max_num_batched_tokens - out.num_tokens)
                       // self.encoder_layer_tokens)
        ahead = self.tracker.num_encoding_ahead(self.waiting)
        for req in self.waiting:
            if budget <= 0:
                break
            if not req.has_images:
                continue
            p = self.tracker.get(req)
            if p is not None and p.encoded:
                continue
            if p is None:
                if self.bm.skips_vision(req, req.unfinished_seqs()):
                    continue  # its prefill reads a cached cross group
                if ahead >= MAX_ENCODED_AHEAD:
                    continue  # those already under way go on (a later one may be first now)
                ahead += 1
                left = req.inputs.num_images * self.tracker.encoder_layers_per_image
            else:
                left = p.encoder_layers_left
            layers = min(budget, max(left, 1))
            out.encoder_work.append(EncoderWork(self.tracker.grant_encoder(req, layers), layers))
            budget -= layers

    # ----------------------------------------------------------------- preemption
    def preempt(self, request: Request) -> None:
        """Frees a running request's pages and queues it for recomputation."""
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.tracker.reset(request)
        seqs = request.unfinished_seqs()
        self.bm.free_request(request, seqs)  # its cached pages are found again on resume
        for s in seqs:
            s.status = SequenceStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
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
            self.tracker.reset(r)
            self.bm.free_cross(r)
            del self.requests[r.request_id]
        return done

    def abort(self, request_id: str) -> Request | None:
        """Frees everything the request holds, at any point of its life."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.tracker.reset(req)
        self._skipped.pop(request_id, None)
        self.bm.free_request(req, req.seqs)
        for s in req.seqs:
            if not s.status.finished:
                s.status = SequenceStatus.FINISHED_ABORTED
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        return req

    def cache_written(self, written: list[tuple[Sequence, int]],
                      cross: list[tuple[Request, list[int]]] = ()) -> None:
        """A step's results were collected: each (sequence, tokens with K/V written) may
        complete pages for the prefix cache, and each (request, cross table) wrote its
        cross group."""
        for seq, n in written:
            self.bm.cache_written(seq, n)
        for req, pages in cross:
            self.bm.cache_cross(req, pages)

    def check_integrity(self) -> None:
        self.bm.check_integrity(self.requests.values())
