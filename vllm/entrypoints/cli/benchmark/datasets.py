"""The serving benchmark's datasets (``--dataset-name``), read from local files only.

- ``random``: the seeded synthetic prompts of ``serve_client.synthetic_dataset``, text only.
- ``random-mm``: the same prompts with images of random noise (``--num-images`` per request,
  alias ``--random-mm-base-items-per-request``; every request unless ``--image-ratio``).
- ``sharegpt``: a ShareGPT file (``--dataset-path``: a JSON list or JSON lines) of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...],
  "image": optional}``: the first turn is the prompt, the second's length in tokens its
  ``max_tokens`` (or ``--sharegpt-output-len``). As in vLLM, entries are shuffled with the
  seed and taken in that order, leaving out prompts or answers under 4 tokens, prompts over
  1024 and pairs over 2048 (or the server's context length). An ``image`` is a path relative
  to the file (sent as a ``data:`` URL), or an ``http(s)``/``data:`` URL sent as it is.

Without ``--dataset-name`` the benchmark runs the project's default mix: ``random-mm`` with
``--image-ratio 0.5``.
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import random
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from vllm.entrypoints.cli.benchmark.serve_client import SyntheticRequest, synthetic_dataset

DATASET_NAMES = ("random", "random-mm", "sharegpt")
# The default image ratio of each dataset (None: the project's mixed default).
IMAGE_RATIOS: dict[str | None, float] = {None: 0.5, "random": 0.0, "random-mm": 1.0}
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048

Tokenize = Callable[[str], Awaitable[int]]


def local_file(path: str | None) -> Path:
    """``--dataset-path`` as an existing local file (this benchmark downloads nothing)."""
    if not path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a local JSON file)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(
            f"--dataset-path {path}: no such local file (datasets are read from local files "
            "only; download it first)"
        )
    return p


def read_entries(path: Path) -> list[dict[str, Any]]:
    """A JSON list of entries, or one JSON object per line."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    return [e for e in data if isinstance(e, dict)]


def _turns(entry: dict[str, Any]) -> tuple[str, str] | None:
    turns = entry.get("conversations") or entry.get("conversation")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    values = [t.get("value", t.get("content")) if isinstance(t, dict) else None for t in turns]
    if not all(isinstance(v, str) for v in values[:2]):
        return None
    return values[0], values[1]


def image_url(value: Any, folder: Path) -> str | None:
    """An entry's ``image`` as a URL the server takes (a local file becomes a data URL)."""
    if not isinstance(value, str) or not value:
        return None
    if value.startswith(("http://", "https://", "data:")):
        return value
    path = (folder / value).expanduser()
    mime = mimetypes.guess_type(path.name)[0] or "image/jpeg"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"image {value}: {e.strerror}") from None
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


async def sharegpt_requests(
    path: Path,
    num_prompts: int,
    seed: int,
    tokenize: Tokenize,
    fixed_output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[SyntheticRequest]:
    """``num_prompts`` requests from a ShareGPT file, chosen as described above; fewer when
    the file holds fewer usable conversations (a ValueError when it holds none)."""
    entries = read_entries(path)
    random.Random(seed).shuffle(entries)
    max_total = min(MAX_TOTAL_TOKENS, max_model_len or MAX_TOTAL_TOKENS)
    out: list[SyntheticRequest] = []
    for entry in entries:
        if len(out) == num_prompts:
            break
        turns = _turns(entry)
        if turns is None:
            continue
        prompt, answer = turns
        prompt_len = await tokenize(prompt)
        output_len = fixed_output_len or await tokenize(answer)
        if prompt_len < MIN_TOKENS or (fixed_output_len is None and output_len < MIN_TOKENS):
            continue
        if prompt_len > MAX_PROMPT_TOKENS or prompt_len + output_len > max_total:
            continue
        url = image_url(entry.get("image"), path.parent)
        out.append(SyntheticRequest(prompt, len(prompt.split()), output_len, [url] if url else []))
    if not out:
        raise ValueError(f"{path}: no conversation fits the benchmark's length limits")
    return out


async def server_max_model_len(
    client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]
) -> int | None:
    """The served model's context length (``GET /v1/models``), if the server says."""
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
        cards = resp.json()["data"]
        return next(int(c["max_model_len"]) for c in cards if c.get("id") == model)
    except (httpx.HTTPError, KeyError, StopIteration, TypeError, ValueError):
        return None


async def build_requests(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    headers: dict[str, str],
) -> list[SyntheticRequest]:
    """The dataset's requests (a ShareGPT file's prompts are counted by the server's
    ``/tokenize``, so lengths are the model's tokens)."""
    if args.dataset_name != "sharegpt":
        return synthetic_dataset(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.image_ratio,
            args.num_images,
            args.image_size,
            args.seed,
            range_ratio=args.range_ratio,
        )

    async def tokenize(text: str) -> int:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        resp = await client.post(f"{base_url}/tokenize", json=body, headers=headers)
        if resp.status_code == 400:  # longer than the context: never sent
            return sys.maxsize
        resp.raise_for_status()
        return int(resp.json()["count"])

    return await sharegpt_requests(
        local_file(args.dataset_path),
        args.num_prompts,
        args.seed,
        tokenize,
        args.sharegpt_output_len,
        await server_max_model_len(client, base_url, model, headers),
    )
