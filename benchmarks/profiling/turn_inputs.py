"""The host work of a chat turn's inputs, piece by piece, in one process (CPU or GPU host).

    python -m benchmarks.profiling inputs [--model demo/mllama-11b] [--history-words 770]

A second chat turn as ``benchmarks.prefix_chat`` sends it (a 1,120-pixel noise JPEG resent as
a data URL, ``--history-words`` words of history, a short reply and a new question) goes
through the server's input steps, each timed alone (median of ``--repeat``): the body's JSON
parse (``json.loads`` and the server's ``parse_json_body``) and validation, the chat
template, tokenization (whole, and piece by piece with the history's ids cached:
``segment_tokenizer``), the data URL's key, and input processing on a
processed-image cache hit (the pixels as the cache entry itself, and stacked into a fresh
tensor as before; pinned where CUDA is available). Prints one line per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm.entrypoints.chat_utils import parse_conversation, render_chat_prompt
from vllm.entrypoints.cli.benchmark.serve_client import _WORDS, noise_jpeg_data_url
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.routes import parse_json_body
from vllm.multimodal.image import decode_image, parse_data_url
from vllm.multimodal.image_identity import HashedImage, data_url_key
from vllm.multimodal.processing import MllamaInputProcessor
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint
from vllm.transformers_utils.segment_tokenizer import SegmentTokenizer
from vllm.transformers_utils.tokenizer import get_image_processor, get_tokenizer


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    xs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        xs.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(xs)


def _body(rng: np.random.Generator, history_words: int) -> tuple[bytes, str]:
    url = noise_jpeg_data_url(rng, 1120)
    words = " ".join(rng.choice(_WORDS, size=history_words).tolist())
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Chat 0: " + words},
            ],
        },
        {"role": "assistant", "content": " ".join(rng.choice(_WORDS, size=50).tolist())},
        {"role": "user", "content": " ".join(rng.choice(_WORDS, size=38).tolist())},
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 64, "stream": True}
    return json.dumps(body).encode(), url


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo/mllama-11b")
    p.add_argument("--history-words", type=int, default=770)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args(argv)
    path = get_demo_checkpoint(args.model)
    tok, ip = get_tokenizer(path), get_image_processor(path)
    pin = torch.cuda.is_available()
    proc = MllamaInputProcessor(load_mllama_config(path), tok, ip, 1, 131072,
                                pixel_dtype=torch.bfloat16, pin_memory=pin,
                                image_cache_bytes=1 << 30)  # fmt: skip
    body, url = _body(np.random.default_rng(0), args.history_words)
    n = args.repeat
    rows: list[tuple[str, float]] = []
    obj = json.loads(body)
    rows.append(("body: json.loads", _median_ms(lambda: json.loads(body), n)))
    rows.append(("body: parse_json_body (the server's)",
                 _median_ms(lambda: parse_json_body(body), n)))  # fmt: skip
    req = ChatCompletionRequest.model_validate(obj)
    rows.append(
        ("body: validation", _median_ms(lambda: ChatCompletionRequest.model_validate(obj), n))
    )
    parsed = parse_conversation(req.messages)
    text = render_chat_prompt(tok, parsed.messages)
    rows.append(("chat template", _median_ms(lambda: render_chat_prompt(tok, parsed.messages), n)))
    whole = list(tok(text, add_special_tokens=False)["input_ids"])
    rows.append((f"tokenize whole ({len(whole)} tokens)",
                 _median_ms(lambda: tok(text, add_special_tokens=False), n)))  # fmt: skip
    seg = SegmentTokenizer(tok)
    assert seg.encode(text) == whole  # the history is now cached
    rows.append(("tokenize, history cached", _median_ms(lambda: seg.encode(text), n)))
    payload = url.split(",", 1)[1]
    rows.append(("data URL key (SHA-256 of the base64)",
                 _median_ms(lambda: data_url_key(payload, proc.fingerprint, None), n)))  # fmt: skip
    data = parse_data_url(url)
    digest, _ = proc.image_lookup(None).lookup_encoded(data)
    miss = {"prompt_token_ids": whole, "multi_modal_data": {
        "image": [HashedImage(digest, image=decode_image(data))]}}  # fmt: skip
    proc.process(miss)
    hit_image = HashedImage(digest, processed=proc.cached_image(digest, None))
    hit = {"prompt_token_ids": whole, "multi_modal_data": {"image": [hit_image]}}
    rows.append(("process, image cache hit", _median_ms(lambda: proc.process(hit), n)))
    tiles = hit_image.processed.pixel_values

    def stacked() -> None:  # what a hit paid before its pixels were the entry itself
        out = torch.empty((1, *tiles.shape), dtype=tiles.dtype, pin_memory=pin)
        torch.stack([tiles], out=out)

    rows.append((f"  before: {'pinned ' if pin else ''}stack of the tiles", _median_ms(stacked, n)))
    for name, ms in rows:
        print(f"{name:44s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
