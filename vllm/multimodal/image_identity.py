"""What makes two images the same image: a SHA-256 digest of the image and of every option
that shapes its tiles.

Two digests name the same processed inputs exactly when the processor would produce the same
pixel values, aspect-ratio id and tile count for both. So the digest covers:

* the image itself: for an image a client sent (a ``data:`` URL, an http(s) or ``file://``
  URL), its **encoded bytes**, as fetched, before any decoding; for a ``PIL.Image`` handed to
  the offline API (which has no encoded bytes), its mode, size, palette, transparency and raw
  pixel bytes. The two kinds are separate domains: the server decodes bytes itself (a large
  JPEG at a reduced DCT scale, then RGB), which a PIL image never went through, so the same
  picture reaching the engine both ways gets two digests (and is processed once each);
* the **processing options** (:func:`processing_fingerprint`): the checkpoint's image
  processor configuration (tile size, resampling filter, rescale factor, mean and std,
  ``max_image_tiles``, ...), ``--mm-processor-kwargs``, the model's tile count and table of
  aspect ratios (images tiled for fewer tiles are padded and renumbered to it), the pixel
  dtype, and the server's decoding rules.

Digests are ``hashlib.sha256`` (never Python's ``hash``, which is salted per process and 64 bits
wide); every field is length-prefixed, so no two different inputs serialise alike. They are
computed once per image, off the engine loop: in the server's decode threads for fetched
images, in input processing for PIL images.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.multimodal.image_cache import ProcessedImage

DIGEST_SIZE = 32
_ENCODED = b"vllm/mllama/image/encoded/v1"
_PIXELS = b"vllm/mllama/image/pixels/v1"
_OPTIONS = b"vllm/mllama/image/options/v1"
_SALTED = b"vllm/mllama/image/salted/v1"
_DATA_URL = b"vllm/mllama/image/data-url/v1"


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def processing_fingerprint(
    image_processor_config: dict[str, Any],
    processor_kwargs: dict[str, Any],
    model_max_tiles: int,
    supported_aspect_ratios: list[Any],
    pixel_dtype: str,
    decoder: str,
) -> bytes:
    """A digest of every option that changes the processed inputs of an image (the module
    docstring lists them). ``image_processor_config`` is the processor's ``to_dict()``;
    ``decoder`` names the server's decoding rules (they change pixels of encoded images)."""
    options = {
        "image_processor": image_processor_config,
        "processor_kwargs": processor_kwargs,
        "model_max_tiles": model_max_tiles,
        "supported_aspect_ratios": [list(r) for r in supported_aspect_ratios],
        "pixel_dtype": pixel_dtype,
        "decoder": decoder,
    }
    # sort_keys: the digest does not depend on dict order; default=repr covers the enums and
    # tuples some processor configurations hold.
    text = json.dumps(options, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(_field(_OPTIONS) + _field(text.encode())).digest()


def encoded_image_digest(data: bytes, fingerprint: bytes) -> bytes:
    """The identity of an image given as encoded bytes (PNG, JPEG, ...), as fetched."""
    h = hashlib.sha256(_field(_ENCODED) + _field(fingerprint))
    h.update(struct.pack("<Q", len(data)))
    h.update(data)  # hashlib releases the GIL for large buffers: other threads keep running
    return h.digest()


def pil_image_digest(img: Any, fingerprint: bytes) -> bytes:
    """The identity of a ``PIL.Image``: mode, size, palette, transparency and raw pixels."""
    h = hashlib.sha256(_field(_PIXELS) + _field(fingerprint))
    h.update(_field(img.mode.encode()))
    h.update(struct.pack("<QQ", *img.size))
    palette = img.getpalette() if img.mode in ("P", "PA") else None
    h.update(_field(bytes(palette) if palette else b""))
    transparency = img.info.get("transparency")
    h.update(_field(repr(transparency).encode() if transparency is not None else b""))
    h.update(_field(img.tobytes()))
    return h.digest()


def cache_key(digest: bytes, cache_salt: str | None) -> bytes:
    """The processed-image cache's key for an image shown under ``cache_salt``: a hit is
    visible in timing (no decoding, no tiling), so tenants' entries are kept apart like their
    KV. The image's identity (``digest``) itself is the same for every tenant."""
    if cache_salt is None:
        return digest
    return hashlib.sha256(
        _field(_SALTED) + _field(digest) + _field(cache_salt.encode("utf-8"))
    ).digest()


def data_url_key(payload: str, fingerprint: bytes, cache_salt: str | None) -> bytes:
    """The key under which the digest of a ``data:`` URL's decoded bytes is remembered: a
    digest of its base64 text (so a resent URL needs no base64 decoding to be found), salted
    like the cache's keys (a hit shows in timing)."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    h = hashlib.sha256(_field(_DATA_URL) + _field(fingerprint) + _field(salt))
    h.update(_field(payload.encode("ascii")))  # hashlib releases the GIL for large buffers
    return h.digest()


@dataclass(frozen=True)
class HashedImage:
    """An image with its identity, as the server hands it to input processing: the decoded
    image on a cache miss, or the processed inputs found under its digest on a hit (then it
    was neither decoded nor tiled again)."""

    digest: bytes
    image: Any = None  # PIL.Image.Image, when it had to be decoded
    processed: ProcessedImage | None = None

    def __post_init__(self) -> None:
        assert len(self.digest) == DIGEST_SIZE
        assert (self.image is None) != (self.processed is None)


class EncodedImageLookup(Protocol):
    """What the server's image fetching asks before decoding (the engine's input processor)."""

    def lookup_encoded(self, data: bytes) -> tuple[bytes, ProcessedImage | None]:
        """The digest of encoded image bytes, and the processed image cached under it."""
        ...

    def find_data_url(self, payload: str) -> tuple[bytes, tuple[bytes, ProcessedImage] | None]:
        """The key of a ``data:`` URL's base64 text (``data_url_key``), and the digest and
        processed image of its bytes when both were seen before (no decoding needed)."""
        ...

    def remember_data_url(self, key: bytes, digest: bytes) -> None:
        """Notes that the ``data:`` URL under ``key`` decodes to bytes of ``digest``."""
        ...
