"""Multi-turn chats over HTTP: an image resent as a data URL is neither decoded nor tiled
again, and ``cache_salt`` is validated (400 naming it) and reaches the engine's request."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
import pytest
from openai_server_utils import RunningServer, image_message

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.inputs import MAX_CACHE_SALT_CHARS
from vllm.multimodal import image as image_mod


def _noise_data_url(seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (40, 90, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _Spy:
    """Counts images given to the image processor and the prompts' cache salts."""

    def __init__(self, proc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tiled = 0
        self.decoded = 0
        self.salts: list[str | None] = []
        inner_ip, inner_process = proc.image_processor, proc.process
        real_decode = image_mod.decode_image

        class Counting:
            def __call__(_, images: Any, **kw: Any) -> Any:
                self.tiled += sum(len(g) for g in images)
                return inner_ip(images=images, **kw)

        def process(prompt: Any) -> Any:
            out = inner_process(prompt)
            self.salts.append(out.cache_salt)
            return out

        def decode(data: bytes, max_pixels: int | None = None) -> Any:
            self.decoded += 1
            return real_decode(data, max_pixels)

        monkeypatch.setattr(proc, "image_processor", Counting())
        monkeypatch.setattr(proc, "process", process)
        monkeypatch.setattr(image_mod, "decode_image", decode)


def _post(srv: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def test_second_turn_does_not_decode_or_tile_the_image(
    server: RunningServer, engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(engine.engine.input_processor, monkeypatch)
    url = _noise_data_url(seed=1234)
    turn1 = image_message(url)
    r = _post(server, "/v1/chat/completions", {"messages": turn1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert (spy.decoded, spy.tiled) == (1, 1)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what colour is it?"},
    ]
    r = _post(server, "/v1/chat/completions", {"messages": turn2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert (spy.decoded, spy.tiled) == (1, 1)
    # Another image is decoded and tiled.
    r = _post(server, "/v1/chat/completions",
              {"messages": image_message(_noise_data_url(seed=99)), "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200 and (spy.decoded, spy.tiled) == (2, 2)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_cache_salt_is_validated_and_carried(
    server: RunningServer,
    engine: AsyncLLMEngine,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    spy = _Spy(engine.engine.input_processor, monkeypatch)
    if path == "/v1/chat/completions":
        base: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    else:
        base = {"prompt": "hi"}
    base["max_tokens"] = 1
    for bad in ("", 7, "s" * (MAX_CACHE_SALT_CHARS + 1), ["a"]):
        r = _post(server, path, {**base, "cache_salt": bad})
        assert r.status_code == 400, (bad, r.text)
        assert "cache_salt" in r.text
    assert spy.salts == []  # refused before input processing
    r = _post(server, path, {**base, "cache_salt": "tenant-7"})
    assert r.status_code == 200, r.text
    r = _post(server, path, base)
    assert r.status_code == 200, r.text
    assert spy.salts == ["tenant-7", None]
