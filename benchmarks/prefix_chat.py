"""Multi-turn image chats against a running server: the prefix-caching workloads of issue #30.

Each conversation shows one noise image (a different one per conversation, 1120 pixels: 4
tiles), opens with ``--history-words`` words, and goes on for ``--turns`` turns of
``--new-words`` new words and ``--output-tokens`` generated tokens; every turn resends the
whole conversation, image included, as a data URL (what chat clients do). Conversations run
``--concurrency`` at a time; within one, turns are sequential. Reports TTFT per turn (p50 /
p99, the turns after the first being where caching shows) and the output throughput.

Run it twice against the same server build, with ``--enable-prefix-caching`` (the default)
and with ``--no-enable-prefix-caching``:

    vllm serve MODEL --enable-prefix-caching &   # then with --no-enable-prefix-caching
    # second turn of one chat, 1,000 tokens of history (~770 words), 50 new tokens:
    python -m benchmarks.prefix_chat --model MODEL --conversations 1 --concurrency 1 \\
        --turns 2 --history-words 770 --new-words 38 --output-tokens 64 --repeat 10
    # 32 conversations at concurrency 32, 4 turns each:
    python -m benchmarks.prefix_chat --model MODEL --conversations 32 --concurrency 32 \\
        --turns 4 --history-words 40 --new-words 38 --output-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np

from vllm.entrypoints.cli.benchmark.common import percentiles
from vllm.entrypoints.cli.benchmark.serve_client import (
    _WORDS,
    encode_payload,
    noise_jpeg_data_url,
    send_request,
)


def read_reports(path: str | Path) -> list[dict]:
    """The reports a run wrote (one JSON document per ``--repeat``, back to back)."""
    text, dec, docs, i = Path(path).read_text(), json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)
    return docs


async def _conversation(client, url, args, index: int, rng, sem, results) -> None:
    image = noise_jpeg_data_url(rng, args.image_size)
    words = rng.choice(_WORDS, size=args.history_words).tolist()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": f"Chat {index}: " + " ".join(words)},
            ],
        }
    ]
    async with sem:
        for turn in range(args.turns):
            body = {
                "model": args.model,
                "messages": messages,
                "max_tokens": args.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await send_request(client, url, encode_payload(body), num_images=1)
            if not r.success:
                raise RuntimeError(f"chat {index} turn {turn}: {r.error}")
            results.append((turn, r))
            messages.append({"role": "assistant", "content": r.generated_text})
            new = rng.choice(_WORDS, size=args.new_words).tolist()
            messages.append({"role": "user", "content": " ".join(new)})


async def _run(args) -> dict:
    url = f"http://{args.host}:{args.port}/v1/chat/completions"
    sem = asyncio.Semaphore(args.concurrency)
    results: list = []
    rng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _conversation(client, url, args, i, rng, sem, results)
                for i in range(args.conversations)
            )
        )
        elapsed = time.perf_counter() - start
    report: dict = {
        "duration_s": elapsed,
        "output_throughput_tok_s": sum(r.output_tokens for _, r in results) / elapsed,
    }
    for turn in range(args.turns):
        ttft = [r.ttft * 1e3 for t, r in results if t == turn]
        report[f"turn{turn + 1}_ttft_ms"] = percentiles(ttft, [50, 99])
    later = [r.ttft * 1e3 for t, r in results if t > 0]
    report["later_turns_ttft_ms"] = percentiles(later, [50, 99])
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", required=True)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-words", type=int, default=40)
    p.add_argument("--new-words", type=int, default=38)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--image-size", type=int, default=1120)
    p.add_argument("--repeat", type=int, default=1, help="runs (fresh images each)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for i in range(args.repeat):
        args.seed += i
        print(json.dumps(asyncio.run(_run(args)), indent=1))


if __name__ == "__main__":
    main()
