"""The engine thread's outputs reach their asyncio queues through one ``_Outbox`` per loop:
every item, in order per queue, with one loop wake-up for all the items posted while a
delivery is pending, from several threads and for several loops."""

from __future__ import annotations

import asyncio
import threading

from vllm.engine import async_llm_engine as ae


def test_items_arrive_in_order_with_few_wakeups() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        streams = [ae._Stream(loop) for _ in range(8)]
        assert len({id(s._outbox) for s in streams}) == 1  # one outbox per loop
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def engine(first: int) -> None:  # two "engine" threads, disjoint streams
            for step in range(200):
                for s in streams[first::2]:
                    s.put(step)

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        got: list[list[int]] = [[] for _ in streams]
        for i, s in enumerate(streams):
            while len(got[i]) < 200:
                got[i].append(await s.queue.get())
        for t in threads:
            t.join()
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert all(g == list(range(200)) for g in got)
    assert 1 <= wakeups < 8 * 200 / 2  # batched: one wake-up an item would be 1,600


def test_each_loop_has_its_own_outbox() -> None:
    seen = []

    def run() -> None:
        async def main() -> None:
            s = ae._Stream(asyncio.get_running_loop())
            threading.Thread(target=s.put, args=("x",)).start()
            seen.append((await s.queue.get(), s._outbox))

        asyncio.run(main())

    run()
    run()
    assert [x for x, _ in seen] == ["x", "x"] and seen[0][1] is not seen[1][1]


def test_a_closed_loop_fails_every_put() -> None:
    """As with a direct ``call_soon_threadsafe``: the engine sees the error, every time (a
    failed wake-up leaves no delivery marked pending)."""
    loop = asyncio.new_event_loop()
    stream = ae._Stream(loop)
    loop.close()
    for _ in range(2):
        try:
            stream.put("x")
        except RuntimeError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("put on a closed loop did not fail")
