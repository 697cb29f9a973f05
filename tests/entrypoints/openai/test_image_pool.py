"""The server's image worker processes (``--image-workers``) against the in-process path:
the same tiles bit for bit, the same errors, and a server answering with them the same way."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai_server_utils import image_message, start_server
from PIL import Image

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.multimodal.image import ImageMediaConnector, decode_image
from vllm.multimodal.image_pool import ImagePreprocessPool, PreprocessedImage
from vllm.transformers_utils.demo_checkpoints import resolve_model


def _jpeg_url(size: tuple[int, int], seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def pool(engine: AsyncLLMEngine) -> Iterator[ImagePreprocessPool]:
    p = ImagePreprocessPool(str(resolve_model("demo/mllama-tiny")), 1, torch.bfloat16)
    yield p
    p.shutdown()


def test_pool_tiles_equal_the_in_process_ones(engine: AsyncLLMEngine,
                                              pool: ImagePreprocessPool) -> None:
    """Two images of different aspect ratios through the pool, then through the engine's
    input processor as PIL images: identical ImageInputs (pixels in bf16, bit for bit)."""
    urls = [_jpeg_url((90, 40), 1), _jpeg_url((33, 70), 2)]
    connector = ImageMediaConnector(pool=pool)

    async def fetch() -> list[PreprocessedImage]:
        return list(await asyncio.gather(*(connector.fetch_image_async(u) for u in urls)))

    pre = asyncio.run(fetch())
    assert all(isinstance(p, PreprocessedImage) for p in pre)
    proc = engine.engine.input_processor
    old_dtype = proc.pixel_dtype
    proc.pixel_dtype = torch.bfloat16
    try:
        pil = [decode_image(base64.b64decode(u.split(",", 1)[1])) for u in urls]
        want = proc.process_images(pil)
        got = proc.process_images(pre)
    finally:
        proc.pixel_dtype = old_dtype
    assert got.num_tiles == want.num_tiles
    assert len(set(want.aspect_ratio_ids.tolist())) == 2  # two different canvases
    assert torch.equal(got.aspect_ratio_ids, want.aspect_ratio_ids)
    assert got.pixel_values.dtype == torch.bfloat16
    assert torch.equal(got.pixel_values.view(torch.int16), want.pixel_values.view(torch.int16))


def test_pool_errors_match_the_in_process_ones(pool: ImagePreprocessPool) -> None:
    tiny = ImageMediaConnector(max_pixels=100)
    cases = ["data:image/png;base64,!!!", "data:image/png;base64," + base64.b64encode(
        b"not an image").decode(), _jpeg_url((20, 20), 3)]
    for url in cases:
        with pytest.raises(ValueError) as in_process:
            decode_image(tiny.fetch_bytes(url), tiny.max_pixels)
        with pytest.raises(ValueError) as pooled:
            asyncio.run(pool.preprocess(url, tiny.max_bytes, tiny.max_pixels))
        assert str(pooled.value) == str(in_process.value)


def test_server_with_image_workers(engine: AsyncLLMEngine) -> None:
    """A server with one image worker answers an image chat as the thread path does
    (greedy, same tokens), and a broken image is still a 400 with the reason."""
    url = _jpeg_url((64, 48), 4)
    texts = []
    for workers in ("1", "0"):
        srv = start_server(engine, ["--image-workers", workers])
        try:
            assert (srv.app.state.ctx.media.pool is not None) == (workers == "1")
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
                "messages": image_message(url), "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
            bad = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
                "messages": image_message("data:image/png;base64,AAAA"), "max_tokens": 2})
            assert bad.status_code == 400 and "image" in bad.json()["error"]["message"]
        finally:
            if srv.app.state.ctx.media.pool is not None:
                srv.app.state.ctx.media.pool.shutdown()
            srv.stop()
    assert texts[0] == texts[1]
