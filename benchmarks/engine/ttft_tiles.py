"""TTFT per image tile count: one image of 1, 2, 3 or 4 tiles + 128 text tokens.

11B Instruct shape with dummy bf16 weights (``dummy_11b``), one request at a time, greedy,
one output token; each point is the median of ``--iters`` prefills after a warm-up one, timed
from ``add_request`` to the finished request as the report times its 4-tile TTFT. The images
are noise canvases of 1x1, 1x2, 1x3 and 2x2 tiles; the tile count the processor chose is
recorded with each point.

    python -m benchmarks.engine ttft-tiles [--iters 5] [--json PATH]
    python -m benchmarks.engine ttft-tiles --smoke      # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import EngineView, dummy_11b, prefill_times_ms, tiny_llm
from vllm import LLM

CANVASES = ((1, 1), (1, 2), (1, 3), (2, 2))  # (rows, columns) of tiles


def tiled_prompt(llm: LLM, rows: int, cols: int, n_tokens: int, seed: int) -> dict:
    """``n_tokens`` prompt token ids after the image token, with one noise image of a
    ``rows`` x ``cols`` tile canvas."""
    spec = EngineView(llm).spec
    bos = llm.get_tokenizer().bos_token_id
    tile = spec.vision.image_size
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (rows * tile, cols * tile, 3), dtype=np.uint8)
    body = [32 + (seed * 7 + i) % 20000 for i in range(n_tokens - 2)]
    return {
        "prompt_token_ids": [bos, spec.image_token_id] + body,
        "multi_modal_data": {"image": Image.fromarray(pixels)},
    }


def ttft_ms(llm: LLM, prompt: dict, iters: int) -> tuple[float, int]:
    """(median TTFT ms over ``iters`` prefills after a warm-up one, tiles of the image)."""
    processed = EngineView(llm).process(prompt)
    times = prefill_times_ms(llm, processed, iters, "tiles")
    return float(np.median(times[1:])), EngineView.image_tiles(processed)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Times every canvas; prints the points (``--json`` also writes them)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, one prefill each")
    args = ap.parse_args(argv)
    if args.smoke:
        llm, iters, text_tokens = tiny_llm(), 1, 24
    else:
        llm, iters, text_tokens = dummy_11b(), args.iters, args.text_tokens
    rows = []
    for r, c in CANVASES:
        ms, tiles = ttft_ms(llm, tiled_prompt(llm, r, c, text_tokens, 7), iters)
        rows.append({"canvas": f"{r}x{c}", "tiles": tiles, "ttft_ms": ms})
        print(f"{r}x{c} canvas, {tiles} tiles: TTFT {ms:.2f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"text_tokens": text_tokens, "iters": iters, "rows": rows}, indent=1)
        )
