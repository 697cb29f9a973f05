"""Security checks: the API key on every ``/v1`` route (compared in constant time), open
health and metrics; image URLs that must not reach local files or private addresses unless
allowed (address spellings, redirects, symlinks); limits on image bytes and pixels, checked
before any pixel is decoded."""

from __future__ import annotations

import asyncio
import hmac
import http.server
import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_server_utils import (
    MODEL,
    RunningServer,
    image_message,
    is_unauthorized,
    png_data_url,
    start_server,
)
from test_bad_input_catalogue import png_header

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.api_server import APIKeyMiddleware
from vllm.multimodal.image import ImageMediaConnector, decode_image

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--api-key", KEY])
    yield srv
    srv.stop()


def v1_routes(srv: RunningServer) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves under /v1 (and SageMaker's
    /invocations), the model's name in a path parameter."""
    out = []
    for route in srv.app.routes:
        path = getattr(route, "path", "").replace("{model:path}", MODEL)
        for method in sorted(getattr(route, "methods", None) or ()):
            if path.startswith(("/v1", "/invocations")) and method != "HEAD":
                out.append((method, path))
    return out


def test_api_key_is_required_on_every_v1_route(keyed: RunningServer) -> None:
    routes = v1_routes(keyed)
    assert {p for _, p in routes} >= {
        "/v1/models",
        f"/v1/models/{MODEL}",
        "/v1/chat/completions",
        "/v1/completions",
        "/invocations",
    }
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for method, path in [*routes, ("GET", "/v1/no-such-route")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = c.request(method, path, json=body, headers=headers)
                assert is_unauthorized(r), (path, r)
        for method, path in routes:
            r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (path, r.text)
        for path in ("/health", "/ping", "/metrics", "/version"):  # probes and scrapers need no key
            assert c.get(path).status_code == 200


def test_api_key_compare_is_constant_time(
    keyed: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = inspect.getsource(APIKeyMiddleware)
    assert "compare_digest(" in source and "== self.expected" not in source
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and calls == [(f"Bearer {KEY}".encode(),) * 2]


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:9/a.png",  # a name that resolves to loopback
        "http://2130706433/a.png",  # 127.0.0.1 as one decimal number
        "http://0x7f.1/a.png",  # and in hex shorthand
        "http://0.0.0.0:9/a.png",
        "http://[::1]:9/a.png",
        "http://[::ffff:127.0.0.1]:9/a.png",
        "http://[fd00::1]/a.png",
        "http://192.168.1.1/a.png",
        "http://169.254.169.254/latest/meta-data/",
    ],
)
def test_private_address_spellings_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not allowed|Cannot resolve"):
        asyncio.run(ImageMediaConnector().fetch_bytes_async(url))


class _Redirects(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        self.send_response(302)
        self.send_header("Location", self.path.split("to=", 1)[1])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def redirector() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirects)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    "target,match",
    [
        ("file:///etc/passwd", "Invalid image URL"),
        ("http://169.254.169.254/latest/meta-data/", "not allowed"),
        ("http://10.0.0.1/a.png", "not allowed"),
    ],
)
def test_redirects_cannot_reach_files_or_private_hosts(
    redirector: str, target: str, match: str
) -> None:
    connector = ImageMediaConnector(allowed_hosts=["127.0.0.1"])  # only the redirector itself
    with pytest.raises(ValueError, match=match):
        asyncio.run(connector.fetch_bytes_async(f"{redirector}/r?to={target}"))


def test_file_urls_stay_inside_the_allowed_folder(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not for clients")
    (media / "link.png").symlink_to(secret)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        ImageMediaConnector().fetch_bytes(secret.as_uri())  # off unless a folder is allowed
    connector = ImageMediaConnector(allowed_local_media_path=str(media))
    for url in (
        secret.as_uri(),
        f"file://{media}/../secret.png",  # traversal
        (media / "link.png").as_uri(),  # a symlink that leads out
        f"file://{media}/%2e%2e/secret.png",  # percent-encoded traversal
    ):
        with pytest.raises(ValueError, match="must be a subpath"):
            connector.fetch_bytes(url)


def test_image_byte_and_pixel_limits_on_the_server(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_IMAGE_FETCH_MAX_BYTES", "2000")
    monkeypatch.setenv("VLLM_IMAGE_MAX_PIXELS", "1000")
    srv = start_server(engine)
    try:

        def post(url: str) -> httpx.Response:
            body = {"messages": image_message(url), "max_tokens": 2}
            return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)

        assert post(png_data_url((20, 20))).status_code == 200  # 400 px, < 2000 bytes
        r = post(png_data_url((40, 40)))
        assert r.status_code == 400
        assert "40x40 = 1600 pixels, more than the limit of 1000" in r.json()["error"]["message"]
        noisy = "data:image/png;base64," + "A" * 4000  # decodes to 3000 bytes
        r = post(noisy)
        assert r.status_code == 400 and "larger than the limit of 2000 bytes" in r.text
    finally:
        srv.stop()


def test_pixel_limit_is_checked_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import PngImagePlugin

    def no_load(self: Any) -> None:
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", no_load)
    start = time.monotonic()
    for w, h in ((9_000, 9_000), (20_000, 20_000), (1, 80_000_000)):
        with pytest.raises(ValueError, match="The image is too large"):
            decode_image(png_header(w, h))
    assert time.monotonic() - start < 1.0
