"""The serving benchmark's client side: a seeded synthetic dataset and one streamed request.

Requests are OpenAI ``/v1/chat/completions`` (text, plus ``image_url`` parts holding base64
JPEGs of random noise) or ``/v1/completions`` (text only), always streamed (SSE) with
``stream_options.include_usage`` so the output token count is the server's own.
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from vllm.entrypoints.cli.benchmark.serve_metrics import RequestResult, timings_from_chunks

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"

# Plain English words: a Llama 3 tokenizer spends about 1.3 tokens on each, with spaces.
# fmt: off
_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "government",
    "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story",
    "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue",
    "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
    "line", "end", "member", "law", "car", "city", "community", "name", "president", "team",
    "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level",
    "office", "door", "health", "person", "art", "war", "history", "party", "result", "change",
    "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education", "river", "mountain", "picture", "color", "light", "cloud", "window", "garden",
    "bridge", "street", "market",
)
# fmt: on


@dataclass
class SyntheticRequest:
    """One benchmark request: a prompt of ``num_words`` words and its images (data URLs)."""

    prompt: str
    num_words: int
    max_tokens: int
    image_urls: list[str] = field(default_factory=list)


def noise_jpeg_data_url(rng: np.random.Generator, size: int) -> str:
    """A ``data:image/jpeg;base64,...`` URL of a ``size``x``size`` RGB noise image."""
    from PIL import Image

    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def synthetic_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    image_ratio: float,
    num_images: int,
    image_size: int,
    seed: int,
    range_ratio: float = 0.0,
) -> list[SyntheticRequest]:
    """``num_prompts`` requests; ``round(image_ratio * num_prompts)`` of them (a seeded choice)
    carry ``num_images`` distinct noise images. With ``range_ratio`` r > 0 each prompt's length
    in words is drawn uniformly from [input_len * (1 - r), input_len * (1 + r)] (its own seeded
    stream: r = 0 gives the same requests as before). Identical arguments give identical
    requests."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    lengths = [input_len] * num_prompts
    if range_ratio > 0:
        lo = max(1, round(input_len * (1 - range_ratio)))
        hi = max(lo, round(input_len * (1 + range_ratio)))
        lengths = np.random.default_rng([seed, 1]).integers(lo, hi + 1, num_prompts).tolist()
    with_images = round(image_ratio * num_prompts) if num_images else 0
    image_rows = set(rng.permutation(num_prompts)[:with_images].tolist())
    out = []
    for i in range(num_prompts):
        words = rng.choice(_WORDS, size=lengths[i]).tolist()
        # A distinct opening per request, so no two prompts share a long prefix.
        prompt = f"Request {i}: " + " ".join(words)
        urls = (
            [noise_jpeg_data_url(rng, image_size) for _ in range(num_images)]
            if i in image_rows
            else []
        )
        out.append(SyntheticRequest(prompt, lengths[i], output_len, urls))
    return out


def build_payload(
    req: SyntheticRequest, endpoint: str, model: str, ignore_eos: bool
) -> dict[str, Any]:
    """The JSON body for ``endpoint`` (greedy, streamed, with the usage chunk)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if endpoint.endswith("chat/completions"):
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": u}} for u in req.image_urls
        ]
        parts.append({"type": "text", "text": req.prompt})
        body["messages"] = [{"role": "user", "content": parts}]
    else:
        if req.image_urls:
            raise ValueError(
                f"{endpoint} takes text only; use {CHAT_ENDPOINT} for images (or --image-ratio 0)"
            )
        body["prompt"] = req.prompt
    return body


def _chunk_output(data: dict[str, Any]) -> tuple[bool, str]:
    """Whether an SSE chunk carries output (text or a finish), and its text."""
    has_output = False
    text = ""
    for choice in data.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        text += piece
        has_output = has_output or bool(piece) or choice.get("finish_reason") is not None
    return has_output, text


def encode_payload(payload: dict[str, Any]) -> bytes:
    """The request body as bytes, encoded once before the benchmark starts (a 1120-pixel noise
    JPEG is over a megabyte of base64: encoding it while timing would measure the client)."""
    return json.dumps(payload).encode("utf-8")


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    num_images: int = 0,
) -> RequestResult:
    """Streams one request (``body`` from :func:`encode_payload`) and measures it; never
    raises (failures are in the result)."""
    result = RequestResult(num_images=num_images)
    chunk_times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] | None = None
    start = result.send_time = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data_text = line[len("data:") :].strip()
                if data_text == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(data_text)
                if "error" in data:
                    result.error = f"in-band error: {json.dumps(data['error'])[:500]}"
                    return result
                has_output, piece = _chunk_output(data)
                if has_output:
                    chunk_times.append(now)
                    text.append(piece)
                if data.get("usage"):
                    usage = data["usage"]
            end = time.perf_counter()
        result.ttft, result.itl, result.latency = timings_from_chunks(start, chunk_times, end)
    except Exception as e:  # network errors, bad JSON, empty streams: a failed request
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(text)
    result.prompt_len = int((usage or {}).get("prompt_tokens") or 0)
    result.output_tokens = int((usage or {}).get("completion_tokens") or len(chunk_times))
    result.success = True
    return result
