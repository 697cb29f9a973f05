"""Loading images named in requests: ``data:`` URLs, http(s) URLs and (opt-in) local files.

Security rules for URLs a client names (the server fetches them on the client's behalf):

* http(s) hosts are resolved first and every address must be public: loopback, private,
  link-local, shared, reserved, multicast and unspecified addresses are refused, and so are
  IPv6 forms that embed such an IPv4 address (mapped, translated, compatible, NAT64, 6to4,
  Teredo), unless the host is on the allow-list (``--allowed-image-hosts`` or the
  comma-separated env ``VLLM_ALLOWED_IMAGE_HOSTS``: names, addresses or CIDRs, each
  optionally ``:port`` to allow that port only; ``*`` allows every host). The connection then
  goes to the address that was checked (TLS still verifies the name), so a second DNS answer
  cannot swap in a private address; redirects are followed by hand and each hop, port
  included, is checked the same way.
* A fetch has a total deadline (``--image-fetch-timeout``, env ``VLLM_IMAGE_FETCH_TIMEOUT``,
  5 s: DNS, every redirect and the whole body), all images of one request another
  (``--image-fetch-request-timeout``), and a size cap (env ``VLLM_IMAGE_FETCH_MAX_BYTES``,
  20 MiB) that also caps ``data:`` URLs.
* Decoding reads the width and height from the image header first; a JPEG larger than the
  model can use is decoded at a reduced scale straight from its DCT (``draft``); an image whose
  decoded size is over ``--max-image-pixels`` is refused before any pixel data is decoded; at
  most ``--image-decode-concurrency`` images are decoded at once.
* ``file://`` URLs work only below ``--allowed-local-media-path``; messages never show the
  resolved path (which would reveal symlink targets, the process id or the working folder).

Given a request's ``lookup`` (``MllamaInputProcessor.image_lookup``), fetching hashes the bytes
it fetched and asks the processed-image cache first (``image_identity.py``, ``image_cache.py``):
an image the cache holds is not decoded at all, and every image leaves here as a
``HashedImage`` carrying its digest. A ``data:`` URL seen before is found from a digest of its
base64 text (``image_identity.data_url_key``, salted like the cache), so a resent one is not
even base64-decoded: chat clients resend the same URL on every turn.

Every failure is a ``ValueError`` whose message can be shown to the client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import math
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import httpx

from vllm import envs
from vllm.multimodal.image_identity import EncodedImageLookup, HashedImage
from vllm.multimodal.image_policy import HostPolicy

if TYPE_CHECKING:
    from vllm.multimodal.image_cache import ProcessedImage

DEFAULT_MAX_IMAGE_BYTES: int = envs.VARIABLES["VLLM_IMAGE_FETCH_MAX_BYTES"].default
# The server's default pixel cap: 16 Mpx (4096 x 4096) is 13x what the model sees (at most 4
# tiles of 560 x 560) and keeps one PNG's decode near a second of CPU.
DEFAULT_MAX_IMAGE_PIXELS = 16 << 20
DEFAULT_DECODE_CONCURRENCY = 2
DEFAULT_REQUEST_FETCH_TIMEOUT = 10.0
# The longest side the model uses: 4 tiles of 560 px in a row. JPEGs at least twice this size
# decode at 1/2, 1/4 or 1/8 scale, never below it.
MODEL_MAX_SIDE = 2240
MAX_REDIRECTS = 3
# What decoding does to the pixels of encoded bytes (part of every encoded image's identity:
# changing these rules changes the pixels, so it must change the digests too).
DECODER_RULES = f"PIL open, JPEG draft when >= 2x {MODEL_MAX_SIDE} px, load, convert RGB"


def max_image_pixels() -> int:
    """The pixel limit per image: env ``VLLM_IMAGE_MAX_PIXELS`` (default 64 Mpx)."""
    return envs.VLLM_IMAGE_MAX_PIXELS


def _too_many_pixels(width: int, height: int, limit: int) -> ValueError:
    return ValueError(
        f"The image is too large: {width}x{height} = {width * height} pixels, more than the "
        f"limit of {limit} pixels per image (--max-image-pixels)."
    )


def check_image(img: Any, where: str = "image") -> Any:
    """An offline image: a ``PIL.Image`` with at least one pixel (raises ValueError)."""
    from PIL import Image

    if not isinstance(img, Image.Image):
        raise ValueError(f"{where} must be a PIL.Image.Image, got {type(img).__name__}.")
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ValueError(f"{where} has no pixels ({width}x{height}).")
    return img


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
        if width <= 0 or height <= 0:
            raise ValueError(f"Failed to load the image: it has no pixels ({width}x{height}).")
        _draft(img, width, height)
        if img.size[0] * img.size[1] > limit:
            raise _too_many_pixels(width, height, limit)
        try:
            img.load()
            return img.convert("RGB")
        except Exception as e:
            raise ValueError(f"Failed to load the image: {_pil_message(e)}") from None


def _draft(img: Any, width: int, height: int) -> None:
    """Asks a JPEG decoder for a reduced scale when the image is at least twice the size the
    model uses (other formats ignore it; the result is never smaller than that size)."""
    scale = MODEL_MAX_SIDE / max(width, height)
    if scale <= 0.5:
        # A decoder that cannot draft decodes at full size, under the same pixel cap.
        with contextlib.suppress(OSError, ValueError):
            img.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))


def _pil_message(e: Exception) -> str:
    """Pillow's message without the repr of our in-memory buffer."""
    text = str(e)
    cut = text.find(" <_io.BytesIO")
    return text[:cut] if cut >= 0 else text


def split_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> str:
    """The base64 text of a ``data:image/...;base64,...`` URL, its header and size checked."""
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
    return payload


def decode_base64(payload: str) -> bytes:
    """A data URL's bytes from its (strictly validated) base64 text."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("Invalid base64 image data in data URL.") from None


def parse_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL."""
    return decode_base64(split_data_url(url, max_bytes))


class ImageMediaConnector:
    """Fetches and decodes the images of chat requests under the rules in the module docstring.

    ``fetch_images_async`` never blocks the event loop (httpx.AsyncClient, and decoding in a
    worker thread); ``fetch_image`` is the blocking twin for offline ``LLM.chat``.
    """

    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_hosts: Iterable[str] | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
        max_pixels: int | None = None,
        request_timeout: float = DEFAULT_REQUEST_FETCH_TIMEOUT,
        decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY,
    ) -> None:
        self.local_root = (
            Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        )
        if self.local_root is not None and not self.local_root.is_dir():
            raise ValueError(
                f"--allowed-local-media-path {allowed_local_media_path!r} is not a directory"
            )
        self.policy = HostPolicy([*(allowed_hosts or ()), *envs.VLLM_ALLOWED_IMAGE_HOSTS])
        self.timeout = timeout if timeout is not None else envs.VLLM_IMAGE_FETCH_TIMEOUT
        self.max_bytes = max_bytes if max_bytes is not None else envs.VLLM_IMAGE_FETCH_MAX_BYTES
        self.max_pixels = max_pixels if max_pixels is not None else max_image_pixels()
        for name, value in (
            ("fetch timeout", self.timeout),
            ("fetch byte limit", self.max_bytes),
            ("pixel limit", self.max_pixels),
            ("request fetch timeout", request_timeout),
        ):
            if not value > 0:
                raise ValueError(f"The image {name} must be positive, got {value}.")
        if decode_concurrency < 1:
            raise ValueError(f"--image-decode-concurrency must be >= 1, got {decode_concurrency}")
        self.request_timeout = request_timeout
        self.decode_concurrency = decode_concurrency
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    # ------------------------------------------------------------------ local files
    def _local_path(self, url: str) -> Path:
        if self.local_root is None:
            raise ValueError("Cannot load local files without `--allowed-local-media-path`.")
        path = Path(unquote(urlparse(url).path)).resolve()
        # The messages name neither the resolved path nor the root: a symlink's target, a
        # /proc/self link's process id or the working folder are not the client's business.
        if not path.is_relative_to(self.local_root):
            raise ValueError("The file path must be a subpath of `--allowed-local-media-path`.")
        if not path.is_file():
            raise ValueError("Image file not found below `--allowed-local-media-path`.")
        if path.stat().st_size > self.max_bytes:
            raise self._too_big()
        return path

    def _too_big(self) -> ValueError:
        return ValueError(f"The image is larger than the limit of {self.max_bytes} bytes.")

    def _timed_out(self, url: str) -> ValueError:
        return ValueError(
            f"Timed out fetching image from {url} after {self.timeout:g} s "
            "(--image-fetch-timeout, for the whole fetch)."
        )

    # ------------------------------------------------------------------ async
    async def fetch_bytes_async(self, url: str) -> bytes:
        """The raw bytes behind an image URL (data, http(s) or file)."""
        if url.startswith("data:"):
            return parse_data_url(url, self.max_bytes)
        if url.startswith("file:"):
            return await asyncio.to_thread(lambda: self._local_path(url).read_bytes())
        try:
            async with asyncio.timeout(self.timeout):  # DNS, redirects and body together
                return await self._fetch_http_async(url)
        except TimeoutError:
            raise self._timed_out(url) from None

    async def _fetch_http_async(self, url: str) -> bytes:
        target = self.policy.check_url(url)
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
                pinned, headers, ext = self.policy.pin(target, infos)
                try:
                    async with client.stream(
                        "GET", pinned, headers=headers, extensions=ext
                    ) as resp:
                        nxt = self.policy.next_url(target, resp)
                        if nxt is None:
                            return await self._read_limited_async(resp)
                except httpx.TimeoutException:
                    raise self._timed_out(url) from None
                except httpx.HTTPError as e:
                    raise ValueError(f"Failed to fetch image from {url}: {e}") from None
                except httpx.InvalidURL:  # httpx parses a redirect's Location itself
                    raise ValueError(f"Invalid redirect fetching image from {url}.") from None
                target = nxt
        raise ValueError(f"Too many redirects fetching image from {url}.")

    async def _read_limited_async(self, resp: httpx.Response) -> bytes:
        chunks, total = [], 0
        async for chunk in resp.aiter_bytes():
            total += len(chunk)
            if total > self.max_bytes:
                raise self._too_big()
            chunks.append(chunk)
        return b"".join(chunks)

    def _decode_gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            self._gates = {lp: g for lp, g in self._gates.items() if not lp.is_closed()}
            gate = self._gates[loop] = asyncio.Semaphore(self.decode_concurrency)
        return gate

    async def fetch_image_async(self, url: str, lookup: EncodedImageLookup | None = None) -> Any:
        """Fetches and decodes one image; decoding runs in a worker thread, a few at a time
        (each holds a full-size bitmap while it runs). With ``lookup``, the bytes are hashed
        first (in a worker thread, outside the decode gate) and an image found in the cache
        is returned undecoded, as a ``HashedImage``; a resent ``data:`` URL is found from its
        base64 text, without decoding the base64 either."""
        key = None
        if lookup is not None and url.startswith("data:"):
            key, found, data = await asyncio.to_thread(self._data_url, url, lookup)
            if found is not None:
                return self._cached(*found)
        else:
            data = await self.fetch_bytes_async(url)
        digest = None
        if lookup is not None:
            digest, hit = await asyncio.to_thread(lookup.lookup_encoded, data)
            if key is not None:
                lookup.remember_data_url(key, digest)
            if hit is not None:
                return self._cached(digest, hit)
        async with self._decode_gate():
            img = await asyncio.to_thread(decode_image, data, self.max_pixels)
        return img if digest is None else HashedImage(digest, image=img)

    def _data_url(
        self, url: str, lookup: EncodedImageLookup
    ) -> tuple[bytes, tuple[bytes, ProcessedImage] | None, bytes]:
        """A ``data:`` URL's text key, its cached (digest, processed image) when the URL was
        seen before, else its bytes (``b""`` with a hit: nothing is decoded)."""
        payload = split_data_url(url, self.max_bytes)
        key, found = lookup.find_data_url(payload)
        return key, found, b"" if found is not None else decode_base64(payload)

    def _cached(self, digest: bytes, hit: ProcessedImage) -> HashedImage:
        """A cache hit, held to this connector's pixel limit as a decode would be."""
        width, height = hit.source_size
        if width * height > self.max_pixels:
            raise _too_many_pixels(width, height, self.max_pixels)
        return HashedImage(digest, processed=hit)

    async def fetch_images_async(
        self, urls: list[str], lookup: EncodedImageLookup | None = None
    ) -> list[Any]:
        """All images of one request, concurrently, within ``request_timeout`` in all; the
        first failure cancels the rest."""
        if not urls:
            return []
        try:
            async with asyncio.timeout(self.request_timeout), asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.fetch_image_async(u, lookup)) for u in urls]
        except TimeoutError:
            raise ValueError(
                f"Timed out fetching the request's images after {self.request_timeout:g} s "
                "(--image-fetch-request-timeout)."
            ) from None
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    # ------------------------------------------------------------------ blocking
    def fetch_bytes(self, url: str) -> bytes:
        """Blocking :meth:`fetch_bytes_async` (offline use), under the same total deadline."""
        if url.startswith("data:"):
            return parse_data_url(url, self.max_bytes)
        if url.startswith("file:"):
            return self._local_path(url).read_bytes()
        deadline = time.monotonic() + self.timeout
        target = self.policy.check_url(url)
        with httpx.Client(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                try:
                    infos = socket.getaddrinfo(
                        target.host, target.port or 0, type=socket.SOCK_STREAM
                    )
                except OSError:
                    raise ValueError(f"Cannot resolve image host {target.host!r}.") from None
                pinned, headers, ext = self.policy.pin(target, infos)
                try:
                    nxt, data = self._get_blocking(client, pinned, headers, ext, target, deadline)
                except httpx.TimeoutException:
                    raise self._timed_out(url) from None
                except httpx.HTTPError as e:
                    raise ValueError(f"Failed to fetch image from {url}: {e}") from None
                except httpx.InvalidURL:  # httpx parses a redirect's Location itself
                    raise ValueError(f"Invalid redirect fetching image from {url}.") from None
                if nxt is None:
                    return data
                target = nxt
        raise ValueError(f"Too many redirects fetching image from {url}.")

    def _get_blocking(
        self,
        client: httpx.Client,
        pinned: httpx.URL,
        headers: dict[str, str],
        ext: dict[str, Any],
        target: httpx.URL,
        deadline: float,
    ) -> tuple[httpx.URL | None, bytes]:
        """One hop: every wait is bounded by what is left of the deadline."""

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpx.ReadTimeout("deadline")
            return left

        with client.stream(
            "GET", pinned, headers=headers, extensions=ext, timeout=remaining()
        ) as resp:
            nxt = self.policy.next_url(target, resp)
            if nxt is not None:
                return nxt, b""
            chunks, total = [], 0
            for chunk in resp.iter_bytes():
                remaining()
                total += len(chunk)
                if total > self.max_bytes:
                    raise self._too_big()
                chunks.append(chunk)
            return None, b"".join(chunks)

    def fetch_image(self, url: str, lookup: EncodedImageLookup | None = None) -> Any:
        """Blocking :meth:`fetch_image_async`."""
        key = None
        if lookup is not None and url.startswith("data:"):
            key, found, data = self._data_url(url, lookup)
            if found is not None:
                return self._cached(*found)
        else:
            data = self.fetch_bytes(url)
        if lookup is None:
            return decode_image(data, self.max_pixels)
        digest, hit = lookup.lookup_encoded(data)
        if key is not None:
            lookup.remember_data_url(key, digest)
        if hit is not None:
            return self._cached(digest, hit)
        return HashedImage(digest, image=decode_image(data, self.max_pixels))
