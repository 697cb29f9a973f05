"""Stopping the engine from two threads at once (the server's drain timer and its exit path
both stop it): the stop runs once, and every caller returns only after it is done, so the
process never exits, or sends the ranks a second stop, while the first is still running."""

from __future__ import annotations

import threading
import time

import pytest

import vllm.distributed.tp_engine as tp_engine
from vllm.engine.async_llm_engine import AsyncLLMEngine


class _SlowStop:
    """A stop that takes a while: how many ran, and when the last one finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.done_at = 0.0

    def __call__(self, *args, **kwargs) -> None:
        with self.lock:
            self.calls += 1
        time.sleep(0.3)
        with self.lock:
            self.done_at = time.monotonic()


def _from_two_threads(fn) -> list[float]:
    """Calls ``fn`` from two threads started together; the time each call returned."""
    returned: list[float] = []
    start = threading.Barrier(2)

    def call() -> None:
        start.wait()
        fn()
        returned.append(time.monotonic())

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(returned) == 2
    return returned


class _IdleEngine:
    def __init__(self) -> None:
        self.shutdown = _SlowStop()

    def has_unfinished_requests(self) -> bool:
        return False


def test_async_engine_stops_once_for_two_callers() -> None:
    inner = _IdleEngine()
    engine = AsyncLLMEngine(inner)  # type: ignore[arg-type]
    returned = _from_two_threads(engine.shutdown)
    stop = inner.shutdown
    assert stop.calls == 1
    assert min(returned) >= stop.done_at  # neither caller returned before a stop finished


class _Alive:
    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


def test_ranks_are_sent_one_stop_for_two_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    broadcast = _SlowStop()
    monkeypatch.setattr(tp_engine.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(tp_engine, "destroy_tensor_parallel", lambda: None)
    ranks = tp_engine.Ranks([_Alive()])
    returned = _from_two_threads(ranks.shutdown)
    assert broadcast.calls == 1 and ranks.closed
    assert min(returned) >= broadcast.done_at
