"""Image decoding and tiling in worker processes (the server's ``--image-workers``).

In the server the engine loop is a thread of the same process as the HTTP event loop, and
CPython runs one thread's Python at a time. Decoding a 1120x1120 JPEG and tiling it costs tens
of milliseconds of CPU, parts of which hold the GIL for milliseconds at a time (base64 and
JSON are single C calls; the decoder works in chunks), and a decode step that finished on the
GPU waits for the GIL before it can launch the next one. Worker processes take that work out
of the server process: what comes back is the tiled pixel tensor, one copy.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class PreprocessedImage:
    """One image through the checkpoint's image processor (what ``ImageInputs`` stacks)."""

    pixel_values: torch.Tensor  # [max_tiles, C, S, S] in the engine's pixel dtype
    aspect_ratio_id: int
    num_tiles: int


_PROCESSOR: Any = None


def _init_worker(model_path: str) -> None:
    global _PROCESSOR
    from vllm.transformers_utils.tokenizer import get_image_processor

    _PROCESSOR = get_image_processor(model_path)


def _ready() -> bool:
    return _PROCESSOR is not None


def preprocess_image(processor: Any, image: Any, pixel_dtype: torch.dtype) -> PreprocessedImage:
    """One decoded image -> its tiles, as ``MllamaInputProcessor`` would make them."""
    out = processor(images=[[image]], return_tensors="pt")
    return PreprocessedImage(out["pixel_values"][0, 0].to(pixel_dtype),
                             int(out["aspect_ratio_ids"][0, 0]), int(out["num_tiles"][0][0]))


def _work(source: str | bytes, max_bytes: int, max_pixels: int,
          dtype_name: str) -> tuple[np.ndarray, str, int, int]:
    """In a worker: data URL or bytes -> (pixel bits as a numpy array, dtype, ratio, tiles).
    The tensor travels as a plain array (no shared-memory handles to outlive the worker)."""
    from vllm.multimodal.image import decode_image, parse_data_url

    data = parse_data_url(source, max_bytes) if isinstance(source, str) else source
    image = preprocess_image(_PROCESSOR, decode_image(data, max_pixels),
                             getattr(torch, dtype_name))
    pixels = image.pixel_values
    bits = pixels.view(torch.int16) if pixels.element_size() == 2 else pixels
    return bits.numpy(), dtype_name, image.aspect_ratio_id, image.num_tiles


class ImagePreprocessPool:
    """``num_workers`` spawned processes, each holding the checkpoint's image processor.

    A worker that dies (killed for memory by a hostile image, say) fails its request with a
    ValueError and the pool is rebuilt for the next ones."""

    def __init__(self, model_path: str, num_workers: int, pixel_dtype: torch.dtype) -> None:
        if num_workers < 1:
            raise ValueError(f"an image pool needs at least one worker, got {num_workers}")
        self.model_path = str(model_path)
        self.num_workers = num_workers
        self.dtype_name = str(pixel_dtype).removeprefix("torch.")
        self._pool = self._new_pool()
        # Start every worker now (a spawned worker imports torch and loads the processor:
        # seconds), not on the first requests.
        self._warm_up = [self._pool.submit(_ready) for _ in range(num_workers)]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the workers started at construction have loaded the processor."""
        for future in self._warm_up:
            if not future.result(timeout=timeout):
                raise RuntimeError("an image worker process did not load the image processor")

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.num_workers,
                                   mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.model_path,))

    async def preprocess(self, source: str | bytes, max_bytes: int,
                         max_pixels: int) -> PreprocessedImage:
        """A ``data:`` URL (decoded in the worker too) or image bytes -> its tiles; bad input
        raises ValueError as the in-process path does."""
        loop = asyncio.get_running_loop()
        pool = self._pool
        try:
            bits, dtype_name, ratio, tiles = await loop.run_in_executor(
                pool, _work, source, max_bytes, max_pixels, self.dtype_name)
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = self._new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise ValueError("Failed to load the image: the image worker process died.") from None
        pixels = torch.from_numpy(bits)
        dtype = getattr(torch, dtype_name)
        if pixels.dtype != dtype:
            pixels = pixels.view(dtype)
        return PreprocessedImage(pixels, ratio, tiles)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
