"""Loading images named in requests: ``data:`` URLs, http(s) URLs and (opt-in) local files.

Security rules for URLs a client names (the server fetches them on the client's behalf):

* http(s) hosts are resolved first and every address must be public: loopback, private,
  link-local, shared, reserved, multicast and unspecified addresses are refused unless the host
  (name, address or CIDR) is on the allow-list (``--allowed-image-hosts`` or the comma-separated
  env ``VLLM_ALLOWED_IMAGE_HOSTS``; ``*`` allows every host). The connection then goes to the
  address that was checked (TLS still verifies the name), so a second DNS answer cannot swap in
  a private address; redirects are followed by hand and each hop is checked the same way.
* Fetches have a timeout (env ``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s) and a size cap (env
  ``VLLM_IMAGE_FETCH_MAX_BYTES``, 20 MiB), which also caps ``data:`` URLs.
* Decoding reads the width and height from the image header first and refuses images over a
  pixel limit (env ``VLLM_IMAGE_MAX_PIXELS``, 64 Mpx) before any pixel data is decoded.
* ``file://`` URLs work only below ``--allowed-local-media-path``.

Every failure is a ``ValueError`` whose message can be shown to the client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx

from vllm import envs

DEFAULT_MAX_IMAGE_BYTES: int = envs.VARIABLES["VLLM_IMAGE_FETCH_MAX_BYTES"].default
MAX_REDIRECTS = 3

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def max_image_pixels() -> int:
    """The pixel limit per image: env ``VLLM_IMAGE_MAX_PIXELS`` (default 64 Mpx)."""
    return envs.VLLM_IMAGE_MAX_PIXELS


def _too_many_pixels(width: int, height: int, limit: int) -> ValueError:
    return ValueError(
        f"The image is too large: {width}x{height} = {width * height} pixels, more than the "
        f"limit of {limit} pixels per image."
    )


def decode_image(data: bytes, max_pixels: int | None = None) -> Any:
    """Decodes image bytes into an RGB ``PIL.Image`` (CPU work: call it off the event loop).

    ``Image.open`` is lazy: it parses only the header, so the size check below runs before any
    pixel data is decompressed (a 20k x 20k PNG of a few KiB is refused without allocating).
    """
    from PIL import Image

    limit = max_image_pixels() if max_pixels is None else max_pixels
    if not data:
        raise ValueError("Failed to load the image: the image data is empty.")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # Pillow's own header check, above ours
        raise ValueError(
            f"The image is too large: {e} (this server's limit is {limit} pixels per image)."
        ) from None
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ...)
        raise ValueError(f"Failed to load the image: {_pil_message(e)}") from None
    with img:
        width, height = img.size
        if width * height > limit:
            raise _too_many_pixels(width, height, limit)
        try:
            img.load()
            return img.convert("RGB")
        except Exception as e:
            raise ValueError(f"Failed to load the image: {_pil_message(e)}") from None


def _pil_message(e: Exception) -> str:
    """Pillow's message without the repr of our in-memory buffer."""
    text = str(e)
    cut = text.find(" <_io.BytesIO")
    return text[:cut] if cut >= 0 else text


def parse_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ValueError("Invalid data URL: expected 'data:image/<format>;base64,<data>'.")
    media_type, *params = header[5:].split(";")
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"Unsupported media type {media_type!r} in data URL; expected image/*.")
    if "base64" not in params:
        raise ValueError("Only base64-encoded data URLs are supported for images.")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ValueError(f"The image is larger than the limit of {max_bytes} bytes.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("Invalid base64 image data in data URL.") from None


def _parse_allow_entry(entry: str) -> str | IPNetwork:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return entry.lower()


def _is_public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class ImageMediaConnector:
    """Fetches and decodes the images of chat requests under the rules in the module docstring.

    ``fetch_image_async`` never blocks the event loop (httpx.AsyncClient, and decoding in a
    worker thread); ``fetch_image`` is the blocking twin for offline ``LLM.chat``.
    """

    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_hosts: Iterable[str] | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        self.local_root = (
            Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        )
        if self.local_root is not None and not self.local_root.is_dir():
            raise ValueError(
                f"--allowed-local-media-path {allowed_local_media_path!r} is not a directory"
            )
        env_hosts = envs.VLLM_ALLOWED_IMAGE_HOSTS
        entries = [e.strip() for e in [*(allowed_hosts or ()), *env_hosts] if e.strip()]
        self.allow_all = "*" in entries
        self.allowed = [_parse_allow_entry(e) for e in entries if e != "*"]
        self.timeout = timeout if timeout is not None else envs.VLLM_IMAGE_FETCH_TIMEOUT
        self.max_bytes = max_bytes if max_bytes is not None else envs.VLLM_IMAGE_FETCH_MAX_BYTES
        self.max_pixels = max_pixels if max_pixels is not None else max_image_pixels()

    # ------------------------------------------------------------------ policy
    def _host_allowed(self, host: str, ip: IPAddress) -> bool:
        if self.allow_all or _is_public(ip):
            return True
        for entry in self.allowed:
            if isinstance(entry, str):
                if entry == host.lower():
                    return True
            elif ip.version == entry.version and ip in entry:
                return True
        return False

    def _pick_address(self, host: str, infos: list[tuple[Any, ...]]) -> str:
        """The first resolved address, after checking that every one is allowed."""
        addrs = [str(info[4][0]).split("%")[0] for info in infos]
        if not addrs:
            raise ValueError(f"Cannot resolve image host {host!r}.")
        for addr in addrs:
            if not self._host_allowed(host, ipaddress.ip_address(addr)):
                raise ValueError(
                    f"Fetching images from {host!r} is not allowed: it resolves "
                    "to a private, loopback or otherwise non-public address."
                )
        return addrs[0]

    @staticmethod
    def _check_http_url(url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError):
            raise ValueError(f"Invalid image URL: {url!r}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"Invalid image URL: {url!r}")
        return parsed

    @staticmethod
    def _pinned(url: httpx.URL, addr: str) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
        """The request aimed at the checked address, keeping Host and the TLS server name."""
        host = f"[{url.host}]" if ":" in url.host else url.host
        host_header = host if url.port is None else f"{host}:{url.port}"
        headers = {"Host": host_header, "Accept": "image/*"}
        extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
        return url.copy_with(host=addr), headers, extensions

    def _local_path(self, url: str) -> Path:
        if self.local_root is None:
            raise ValueError("Cannot load local files without `--allowed-local-media-path`.")
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(self.local_root):
            raise ValueError(
                f"The file path {path} must be a subpath of "
                f"`--allowed-local-media-path` {self.local_root}."
            )
        if not path.is_file():
            raise ValueError(f"Image file not found: {path}")
        if path.stat().st_size > self.max_bytes:
            raise ValueError(f"The image is larger than the limit of {self.max_bytes} bytes.")
        return path

    def _next_url(self, url: httpx.URL, response: httpx.Response) -> httpx.URL | None:
        if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
            return url.join(response.headers["location"])
        if response.status_code != 200:
            raise ValueError(f"Failed to fetch image from {url}: HTTP {response.status_code}.")
        return None

    def _too_big(self) -> ValueError:
        return ValueError(f"The image is larger than the limit of {self.max_bytes} bytes.")

    # ------------------------------------------------------------------ async
    async def fetch_bytes_async(self, url: str) -> bytes:
        """The raw bytes behind an image URL (data, http(s) or file)."""
        if url.startswith("data:"):
            return parse_data_url(url, self.max_bytes)
        if url.startswith("file:"):
            return await asyncio.to_thread(lambda: self._local_path(url).read_bytes())
        target = self._check_http_url(url)
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(
            timeout=self.timeout, follow_redirects=False, trust_env=False
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                try:
                    infos = await loop.getaddrinfo(
                        target.host, target.port or 0, type=socket.SOCK_STREAM
                    )
                except OSError:
                    raise ValueError(f"Cannot resolve image host {target.host!r}.") from None
                addr = self._pick_address(target.host, infos)
                pinned, headers, ext = self._pinned(target, addr)
                try:
                    async with client.stream(
                        "GET", pinned, headers=headers, extensions=ext
                    ) as resp:
                        nxt = self._next_url(target, resp)
                        if nxt is None:
                            return await self._read_limited_async(resp)
                except httpx.TimeoutException:
                    raise ValueError(
                        f"Timed out fetching image from {url} after {self.timeout:g} s."
                    ) from None
                except httpx.HTTPError as e:
                    raise ValueError(f"Failed to fetch image from {url}: {e}") from None
                target = self._check_http_url(str(nxt))
        raise ValueError(f"Too many redirects fetching image from {url}.")

    async def _read_limited_async(self, resp: httpx.Response) -> bytes:
        chunks, total = [], 0
        async for chunk in resp.aiter_bytes():
            total += len(chunk)
            if total > self.max_bytes:
                raise self._too_big()
            chunks.append(chunk)
        return b"".join(chunks)

    async def fetch_image_async(self, url: str) -> Any:
        """Fetches and decodes one image; decoding runs in a worker thread."""
        data = await self.fetch_bytes_async(url)
        return await asyncio.to_thread(decode_image, data, self.max_pixels)

    # ------------------------------------------------------------------ blocking
    def fetch_bytes(self, url: str) -> bytes:
        """Blocking :meth:`fetch_bytes_async` (offline use)."""
        if url.startswith("data:"):
            return parse_data_url(url, self.max_bytes)
        if url.startswith("file:"):
            return self._local_path(url).read_bytes()
        target = self._check_http_url(url)
        with httpx.Client(timeout=self.timeout, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                try:
                    infos = socket.getaddrinfo(
                        target.host, target.port or 0, type=socket.SOCK_STREAM
                    )
                except OSError:
                    raise ValueError(f"Cannot resolve image host {target.host!r}.") from None
                pinned, headers, ext = self._pinned(target, self._pick_address(target.host, infos))
                try:
                    with client.stream("GET", pinned, headers=headers, extensions=ext) as resp:
                        nxt = self._next_url(target, resp)
                        if nxt is None:
                            chunks, total = [], 0
                            for chunk in resp.iter_bytes():
                                total += len(chunk)
                                if total > self.max_bytes:
                                    raise self._too_big()
                                chunks.append(chunk)
                            return b"".join(chunks)
                except httpx.TimeoutException:
                    raise ValueError(
                        f"Timed out fetching image from {url} after {self.timeout:g} s."
                    ) from None
                except httpx.HTTPError as e:
                    raise ValueError(f"Failed to fetch image from {url}: {e}") from None
                target = self._check_http_url(str(nxt))
        raise ValueError(f"Too many redirects fetching image from {url}.")

    def fetch_image(self, url: str) -> Any:
        return decode_image(self.fetch_bytes(url), self.max_pixels)
