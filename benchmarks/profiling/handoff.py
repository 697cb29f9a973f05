"""The engine thread's cost of handing outputs to the event loop, per step.

    python -m benchmarks.profiling handoff [--streams 64] [--rounds 4] [--model demo/mllama-tiny]

``--streams`` concurrent greedy requests (48 tokens each) through ``AsyncLLMEngine``, whose
consumers serialise each output as a server would. Rounds alternate two hand-offs: ``per
item`` (each output its own ``call_soon_threadsafe``, as before 2026-12-06) and ``outbox``
(the engine's ``_Outbox``: one loop wake-up for all the outputs posted while a delivery is
pending). Reported per hand-off: the engine thread's total and p99 time in ``_Stream.put``
and the wall time of each round. On CPU it runs the tiny demo checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

import vllm.engine.async_llm_engine as ae
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs


def _per_item(self: ae._Stream, item: object) -> None:
    self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--model", default="demo/mllama-tiny")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.model == "demo/mllama-tiny"
    extra = {} if tiny else {"load_format": "dummy", "dtype": "bfloat16"}
    engine = ae.AsyncLLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=512, max_num_seqs=args.streams,
        disable_log_stats=True, device=device, **extra))  # fmt: skip
    outbox = ae._Stream.put
    spent: list[float] = []

    def timed(put):
        def run(self, item):
            t0 = time.perf_counter()
            put(self, item)
            spent.append(time.perf_counter() - t0)

        return run

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    async def round_(tag: str) -> float:
        async def one(i: int) -> None:
            prompt = {"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(20)]}
            n = 0
            async for out in engine.generate(prompt, params, f"{tag}-{i}"):
                json.dumps({"id": out.request_id, "text": out.outputs[0].text, "n": n})
                n += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.streams)))
        return time.perf_counter() - t0

    rows: dict[str, list[tuple[float, float, float]]] = {"per item": [], "outbox": []}
    try:
        asyncio.run(round_("warm-up"))
        for r in range(args.rounds):
            for tag, put in (("per item", _per_item), ("outbox", outbox)):
                ae._Stream.put = timed(put)
                spent.clear()
                wall = asyncio.run(round_(f"{tag}{r}"))
                p99 = sorted(spent)[int(0.99 * len(spent))]
                rows[tag].append((wall, sum(spent), p99))
    finally:
        ae._Stream.put = outbox
        engine.shutdown()
    tokens = params.max_tokens  # the engine runs at least this many steps a round
    for tag, got in rows.items():
        total = statistics.median(s for _, s, _ in got)
        p99 = statistics.median(p for *_, p in got)
        print(f"{tag:8s}: put {1e3 * total:7.1f} ms a round ({1e3 * total / tokens:.3f} ms a "
              f"token position), p99 put {1e3 * p99:.3f} ms, wall "
              + " ".join(f"{w:.3f}" for w, _, _ in got) + " s")


if __name__ == "__main__":
    main()
