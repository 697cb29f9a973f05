"""Image decoding and fetching: JPEGs far larger than the model uses decoded at a reduced
scale, a few decodes at a time, a total deadline per fetch (a host trickling bytes cannot hold
it), IPv6 spellings of private IPv4 addresses refused, and allow-list ports checked on every
redirect hop. The slow and redirecting hosts are local servers; deadlines are injected tiny."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.image_hosts import PNG, image_hosts

from vllm.multimodal import image as image_mod
from vllm.multimodal.image import ImageMediaConnector, decode_image


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


GENEROUS = 5.0  # seconds: far above the injected deadlines


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[int, ...]]:
    """Two image hosts on loopback: their ports."""
    with image_hosts(2) as ports:
        yield ports


def test_large_jpegs_decode_at_a_reduced_scale() -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8192, 6144), (10, 200, 30)).save(buf, format="JPEG")
    img = decode_image(buf.getvalue(), max_pixels=64 << 20)
    assert img.size == (4096, 3072)  # 1/2 scale: still above the 2240 px the model uses
    small = io.BytesIO()
    Image.new("RGB", (3000, 2000)).save(small, format="JPEG")
    assert decode_image(small.getvalue()).size == (3000, 2000)  # untouched


def test_decodes_run_a_few_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    active, peak, lock, release = [0], [0], threading.Lock(), threading.Event()

    def decode(data: bytes, max_pixels: int | None = None) -> Any:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        release.wait(GENEROUS)
        with lock:
            active[0] -= 1
        return "decoded"

    monkeypatch.setattr(image_mod, "decode_image", decode)
    connector = ImageMediaConnector(decode_concurrency=1)

    async def run() -> list[Any]:
        tasks = [asyncio.ensure_future(connector.fetch_image_async(data_url(PNG)))
                 for _ in range(3)]
        for _ in range(1000):  # bounded: until one decode runs and two wait, or three run
            gate = connector._gates.get(asyncio.get_running_loop())
            waiting = len(getattr(gate, "_waiters", None) or ())
            if active[0] == 3 or (active[0] == 1 and waiting == 2):
                break
            await asyncio.sleep(0.005)
        release.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == ["decoded"] * 3
    assert peak[0] == 1


def test_fetch_deadline_is_total(hosts: tuple[int, int]) -> None:
    """A host sending a byte every 20 ms never trips a per-read timeout of 0.3 s."""
    url = f"http://127.0.0.1:{hosts[0]}/slow"
    connector = ImageMediaConnector(allowed_hosts=["127.0.0.1"], timeout=0.3)
    for fetch in (lambda: asyncio.run(connector.fetch_bytes_async(url)),
                  lambda: connector.fetch_bytes(url)):
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"Timed out fetching image .* after 0.3 s"):
            fetch()
        assert time.monotonic() - start < GENEROUS


@pytest.mark.parametrize(
    "host",
    ["[64:ff9b::7f00:1]", "[64:ff9b::a00:1]", "[2002:7f00:1::]", "[::127.0.0.1]",
     "[::ffff:0:127.0.0.1]", "[64:ff9b:1::1]", "[2001:0:4136:e378:8000:63bf:80ff:fffe]"],
    ids=["NAT64 loopback", "NAT64 private", "6to4", "IPv4-compatible", "IPv4-translated",
         "local NAT64", "Teredo"],
)
def test_ipv6_forms_of_private_ipv4_are_refused(host: str) -> None:
    with pytest.raises(ValueError, match="is not allowed"):
        asyncio.run(ImageMediaConnector().fetch_bytes_async(f"http://{host}:9/a.png"))


def test_public_ipv4_behind_nat64_stays_allowed() -> None:
    policy = ImageMediaConnector().policy
    assert policy.allows("h", ipaddress.ip_address("64:ff9b::808:808"), 80)
    assert not policy.allows("h", ipaddress.ip_address("64:ff9b::c0a8:1"), 80)


def test_allow_list_ports_are_checked_on_every_hop(hosts: tuple[int, int]) -> None:
    a, b = hosts
    connector = ImageMediaConnector(allowed_hosts=[f"127.0.0.1:{a}"])
    assert asyncio.run(connector.fetch_bytes_async(f"http://127.0.0.1:{a}/img.png")) == PNG
    assert connector.fetch_bytes(f"http://127.0.0.1:{a}/img.png") == PNG
    for url in (f"http://127.0.0.1:{b}/img.png",
                f"http://127.0.0.1:{a}/to?u=http://127.0.0.1:{b}/img.png"):
        with pytest.raises(ValueError, match=r"\(port \d+\) is not allowed"):
            asyncio.run(connector.fetch_bytes_async(url))
        with pytest.raises(ValueError, match="is not allowed"):
            connector.fetch_bytes(url)
    anywhere = ImageMediaConnector(allowed_hosts=["127.0.0.1"])  # no port: any port
    assert asyncio.run(anywhere.fetch_bytes_async(f"http://127.0.0.1:{b}/img.png")) == PNG
