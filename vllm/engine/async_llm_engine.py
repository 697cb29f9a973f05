"""``AsyncLLMEngine``: the engine loop on its own thread, driven from asyncio.

The event loop never runs model steps or image processing: input processing (tokenising,
image decoding and tiling) runs in a thread pool, and the engine thread owns the
``LLMEngine``. Commands (add, abort) reach the engine thread through a queue; outputs come back
to per-request asyncio queues, a step's outputs with one ``call_soon_threadsafe``. If the
engine loop itself fails, every pending request gets :class:`EngineDeadError` and health
checks fail; one bad request only fails itself.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests (or images) are waiting for the engine: retry later (a 503)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTicket:
    """One admitted request's place in the waiting queue: it counts (with its images) until
    the request produces its first output or ends; ``close`` is idempotent, and a ticket that
    is dropped unclosed frees its place when it is collected."""

    def __init__(self, owner: _QueueCounter, images: int) -> None:
        self._owner: _QueueCounter | None = owner
        self.images = images

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release(self.images)

    def __del__(self) -> None:
        self.close()


class _QueueCounter:
    """Requests admitted but not yet started, and the images they hold (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.images = 0

    def reserve(self, images: int, max_requests: int | None, max_images: int | None) -> QueueTicket:
        with self._lock:
            if max_requests is not None and self.requests + 1 > max_requests:
                raise QueueFullError(
                    f"The server is busy: {self.requests} requests are already waiting "
                    f"(--max-queued-requests {max_requests}). Retry later."
                )
            if max_images is not None and images and self.images + images > max_images:
                raise QueueFullError(
                    f"The server is busy: waiting requests already hold {self.images} images "
                    f"(--max-queued-images {max_images}). Retry later."
                )
            self.requests += 1
            self.images += images
        return QueueTicket(self, images)

    def release(self, images: int) -> None:
        with self._lock:
            self.requests -= 1
            self.images -= images


@dataclass
class _Add:
    request_id: str
    processed: Any
    params: SamplingParams
    stream: _Stream
    priority: int = 0
    grammar: Any = None  # the compiled constraint (``LLMEngine.compile_grammar``), if any


@dataclass
class _Abort:
    request_id: str


class _Outbox:
    """Outputs bound for one event loop's queues, handed over in batches: the engine thread
    appends, and wakes the loop only when no delivery is pending already, so a step's
    outputs for N streams cost one wake-up of the loop instead of N. (Each wake-up writes to
    the loop's self-pipe; the write releases the GIL, and the engine thread then waits to
    get it back from the woken loop.) Per queue, items arrive in the order put."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._pending = False

    def put(self, queue_: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue_, item))
            if self._pending:
                return
            self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except BaseException:
            with self._lock:
                self._pending = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._pending = self._items, [], False
        for queue_, item in items:
            queue_.put_nowait(item)


_OUTBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = (
    weakref.WeakKeyDictionary())
_OUTBOXES_LOCK = threading.Lock()


class _Stream:
    """A request's output queue on the event loop (fed through the loop's ``_Outbox``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with _OUTBOXES_LOCK:
            outbox = _OUTBOXES.get(loop)
            if outbox is None:
                outbox = _OUTBOXES[loop] = _Outbox(loop)
        self._outbox = outbox

    def put(self, item: RequestOutput | BaseException) -> None:
        self._outbox.put(self.queue, item)


class AsyncLLMEngine:
    """Async facade over :class:`LLMEngine` running on a background thread."""

    def __init__(self, engine: LLMEngine, input_workers: int = 4) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pool = ThreadPoolExecutor(max_workers=input_workers,
                                        thread_name_prefix="vllm-input")
        self.dead_error: BaseException | None = None
        # Called (from the engine thread) once the loop has died: the server stops on it.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._queue = _QueueCounter()
        self._stopping = False
        # Held by the call that stops the engine: a second caller (the server's drain timer
        # and its exit path both stop it) waits until the first is done instead of running
        # the stop beside it, or leaving the process while it runs.
        self._shutdown_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args))

    # ------------------------------------------------------------------ public API
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self.errored

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self.dead_error!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def vllm_config(self) -> Any:
        return self.engine.config

    @property
    def model_config(self) -> Any:
        return self.engine.config.model_config

    async def get_model_config(self) -> Any:
        """Upstream's coroutine for ``model_config`` (what OpenAI front-ends await)."""
        return self.engine.config.model_config

    async def get_vllm_config(self) -> Any:
        return self.engine.config

    def reserve(self, images: int = 0, max_requests: int | None = None,
                max_images: int | None = None) -> QueueTicket:
        """A place in the waiting queue for one request holding ``images`` images, or
        :class:`QueueFullError` when ``max_requests`` requests (or ``max_images`` images)
        already wait; pass the ticket to :meth:`generate`, which closes it when the request
        starts producing output or ends."""
        return self._queue.reserve(images, max_requests, max_images)

    @property
    def num_queued(self) -> tuple[int, int]:
        """(requests, images) admitted with a ticket and not started yet."""
        return self._queue.requests, self._queue.images

    async def process_inputs(self, prompt: Any) -> Any:
        """Tokenises and processes images off the event loop (raises ValueError on bad input)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.engine.process_inputs, prompt)

    async def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled constraint, compiled off the event loop and the engine
        loop (bounded in time; raises ``GuidedDecodingError``, a ValueError)."""
        return await asyncio.to_thread(self.engine.compile_grammar, params)

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       processed: Any = None, ticket: QueueTicket | None = None,
                       priority: int = 0, grammar: Any = None) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; aborts it if the consumer goes away. ``ticket`` (from
        :meth:`reserve`) is closed at the first output, or when the stream ends. A
        constrained request's ``grammar`` comes from :meth:`compile_grammar` (compiled here
        when not given: never on the engine loop)."""
        try:
            await self.check_health()
            if processed is None:
                processed = await self.process_inputs(prompt)
            if sampling_params.guided_decoding is not None and grammar is None:
                grammar = await self.compile_grammar(sampling_params)  # not on the loop
            stream = _Stream(asyncio.get_running_loop())
            if request_id in self._streams:
                raise ValueError("the request id is already in use")
            self._streams[request_id] = stream
            self._commands.put(_Add(request_id, processed, sampling_params, stream, priority,
                                    grammar))
        except BaseException:
            if ticket is not None:
                ticket.close()
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if ticket is not None:
                    ticket.close()  # it left the waiting queue (or failed)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if ticket is not None:
                ticket.close()
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; pending requests get EngineDeadError. Safe to call from several
        threads: each returns once the engine is stopped."""
        with self._shutdown_lock:
            self._stopping = True
            self._commands.put(None)
            self._thread.join(timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)
            if not self._thread.is_alive() and not self._stopped:  # the loop is done
                self.engine.shutdown()
                self._stopped = True

    def stats(self) -> dict[str, Any]:
        """A snapshot for /metrics (read without locking: small races are harmless)."""
        sched = self.engine.scheduler
        runner = self.engine.runner
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_cache_usage": self.engine.kv_cache_usage(),
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_queries": self.engine.block_manager.pool.prefix_cache_queries,
            "prefix_cache_hits": self.engine.block_manager.pool.prefix_cache_hits,
            "cross_cache_queries": self.engine.block_manager.pool.cross_cache_queries,
            "cross_cache_hits": self.engine.block_manager.pool.cross_cache_hits,
            "graph_replays": dict(runner.stats.graph_replays),
            "eager_decode_steps": runner.stats.eager_decode_steps,
            "images_encoded_ahead": runner.stats.images_encoded_ahead,
            "encoder_steps": runner.stats.encoder_steps,
            "prefill_chunks": runner.stats.prefill_chunks,
            "row_chunks": runner.stats.row_chunks,
            "requests": self.engine.stats.snapshot(),
            "cache_config": self.cache_config_info(),
        }

    def cache_config_info(self) -> dict[str, Any]:
        """``vllm:cache_config_info``'s labels: the KV cache as configured and as sized."""
        cc = self.engine.config.cache_config
        pool = self.engine.block_manager.pool
        return {
            "block_size": cc.block_size,
            "cache_dtype": cc.kv_cache_dtype,
            "enable_prefix_caching": self.engine.config.scheduler_config.enable_prefix_caching,
            "gpu_memory_utilization": cc.gpu_memory_utilization,
            "num_gpu_blocks": pool.num_allocatable,
            "num_gpu_blocks_override": cc.num_gpu_blocks_override,
            "num_cpu_blocks": 0,
            "swap_space_bytes": 0,
        }

    # ------------------------------------------------------------------ engine thread
    def _handle(self, cmd: _Add | _Abort) -> None:
        engine = self.engine
        if isinstance(cmd, _Abort):
            engine.abort_request(cmd.request_id)
            return
        try:
            engine.add_request(cmd.request_id, None, cmd.params, processed=cmd.processed,
                               priority=cmd.priority, grammar=cmd.grammar)
        except Exception as e:  # bad request: fail it alone
            cmd.stream.put(e)

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; returns False when asked to stop."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain(block=not engine.has_unfinished_requests()):
                    break
                if not engine.has_unfinished_requests():
                    continue
                for out in engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        # A request that failed inside the engine fails alone.
                        stream.put(out.error if out.error is not None else out)
        except BaseException as e:  # the loop itself failed: fail everyone, stay dead
            self.dead_error = e
            logger.debug("Engine loop failed:\n%s", traceback.format_exc())
            logger.error("Engine failed, no request can be served%s: %s: %s",
                         "; the server exits with status 1" if self.on_dead else "",
                         type(e).__name__, e)
            if self.on_dead is not None:
                self.on_dead(e)
        err = self.dead_error or EngineDeadError("engine shut down")
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(f"engine loop stopped: {err!r}"))
