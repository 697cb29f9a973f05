"""Image URLs: http(s) fetching from a local HTTP server, the private-address rule, redirects,
size and time limits, data URLs and file:// under --allowed-local-media-path."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai_server_utils import MODEL, RunningServer, image_message, png_bytes, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.multimodal.image import ImageMediaConnector, parse_data_url
from vllm.multimodal.image_policy import pinned_request

PNG = png_bytes((20, 20))


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        if self.path == "/img.png":
            self._send(200, PNG, "image/png")
        elif self.path == "/big.png":
            self._send(200, PNG * 50, "image/png")
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("to=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"missing", "text/plain")

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "pic.png").write_bytes(PNG)
    return d


@pytest.fixture(scope="module")
def open_server(engine: AsyncLLMEngine, media_dir: Path) -> Iterator[RunningServer]:
    srv = start_server(
        engine, ["--allowed-image-hosts", "127.0.0.1", "--allowed-local-media-path", str(media_dir)]
    )
    yield srv
    srv.stop()


def _chat(srv: RunningServer, url: str) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/v1/chat/completions",
        timeout=30,
        json={"messages": image_message(url), "max_tokens": 2},
    )


def test_http_image_from_allowed_loopback(open_server: RunningServer, image_host: str) -> None:
    resp = open_server.client().chat.completions.create(
        model=MODEL, messages=image_message(f"{image_host}/img.png"), max_tokens=3
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_loopback_denied_by_default(server: RunningServer, image_host: str) -> None:
    r = _chat(server, f"{image_host}/img.png")
    assert r.status_code == 400
    assert "not allowed" in r.json()["error"]["message"]


def test_http_errors_are_400(open_server: RunningServer, image_host: str) -> None:
    r = _chat(open_server, f"{image_host}/nothing.png")
    assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]


def test_file_urls(open_server: RunningServer, server: RunningServer, media_dir: Path) -> None:
    ok = open_server.client().chat.completions.create(
        model=MODEL, messages=image_message((media_dir / "pic.png").as_uri()), max_tokens=2
    )
    assert ok.usage.completion_tokens >= 1
    outside = _chat(open_server, "file:///etc/hostname")
    assert outside.status_code == 400 and "subpath" in outside.json()["error"]["message"]
    denied = _chat(server, (media_dir / "pic.png").as_uri())
    assert denied.status_code == 400


def test_redirect_hops_are_checked(image_host: str) -> None:
    only_v4 = ImageMediaConnector(allowed_hosts=["127.0.0.1/32"])
    url = f"{image_host}/redirect?to=/img.png"
    assert asyncio.run(only_v4.fetch_image_async(url)).size == (20, 20)
    port = image_host.rsplit(":", 1)[1]
    away = f"{image_host}/redirect?to=http://[::1]:{port}/img.png"
    with pytest.raises(ValueError, match="not allowed"):
        asyncio.run(only_v4.fetch_image_async(away))
    with pytest.raises(ValueError, match="not allowed"):
        only_v4.fetch_image(away)  # the blocking twin (offline LLM.chat)


def test_size_and_time_limits(image_host: str) -> None:
    small = ImageMediaConnector(allowed_hosts=["127.0.0.1"], max_bytes=len(PNG) * 2)
    assert small.fetch_image(f"{image_host}/img.png").size == (20, 20)
    with pytest.raises(ValueError, match="larger than the limit"):
        asyncio.run(small.fetch_bytes_async(f"{image_host}/big.png"))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts connections at the kernel level, never answers
    try:
        quick = ImageMediaConnector(allowed_hosts=["127.0.0.1"], timeout=0.3)
        with pytest.raises(ValueError, match="Timed out"):
            asyncio.run(quick.fetch_bytes_async(f"http://127.0.0.1:{silent.getsockname()[1]}/"))
    finally:
        silent.close()


@pytest.mark.parametrize(
    "addr,public",
    [
        ("8.8.8.8", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("172.16.5.4", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
        ("2606:4700::1111", True),
    ],
)
def test_private_addresses_denied(addr: str, public: bool) -> None:
    ip = ipaddress.ip_address(addr)
    assert ImageMediaConnector().policy.allows("example.test", ip, 80) is public
    assert ImageMediaConnector(allowed_hosts=["*"]).policy.allows("h", ip, 80)
    assert ImageMediaConnector(allowed_hosts=["internal.test"]).policy.allows(
        "internal.test", ip, 8080
    )


def test_data_url_parsing() -> None:
    assert parse_data_url("data:image/png;base64,aGk=") == b"hi"
    for bad, match in [
        ("data:image/png,aGk=", "base64"),
        ("data:text/plain;base64,aGk=", "media type"),
        ("data:image/png;base64,a$b", "Invalid base64"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_data_url(bad)
    with pytest.raises(ValueError, match="larger than the limit"):
        parse_data_url("data:image/png;base64," + "A" * 400, max_bytes=100)


def test_unsupported_part_type(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="unsupported content part type"):
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        )


def test_requests_are_pinned_to_the_checked_address() -> None:
    pin = pinned_request
    url, headers, ext = pin(httpx.URL("https://images.example/a.png?x=1"), "93.184.216.34")
    assert str(url) == "https://93.184.216.34/a.png?x=1"
    assert headers["Host"] == "images.example" and ext == {"sni_hostname": "images.example"}
    url, headers, ext = pin(httpx.URL("http://[2001:db8::1]:8080/a"), "2001:db8::1")
    assert str(url) == "http://[2001:db8::1]:8080/a"
    assert headers["Host"] == "[2001:db8::1]:8080" and ext == {}
