"""Image identity and the processed-image cache: a resent image is neither decoded nor tiled
again (spies on the decoder and the image processor), and the same image under other
processing options, or another image, never shares an entry."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch

from vllm.inputs import MAX_CACHE_SALT_CHARS
from vllm.multimodal import image as image_mod
from vllm.multimodal.image import ImageMediaConnector
from vllm.multimodal.image_cache import (
    ENTRY_OVERHEAD_BYTES,
    DigestMemo,
    ProcessedImage,
    ProcessedImageCache,
)
from vllm.multimodal.image_identity import (
    HashedImage,
    encoded_image_digest,
    pil_image_digest,
)
from vllm.multimodal.processing import MllamaInputProcessor
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint
from vllm.transformers_utils.tokenizer import get_image_processor, get_tokenizer

GiB = 1 << 30


class CountingProcessor:
    """The checkpoint's image processor, counting the images it is given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.images = 0

    def __call__(self, images: Any, **kw: Any) -> Any:
        self.images += sum(len(group) for group in images)
        return self.inner(images=images, **kw)

    def to_dict(self) -> dict[str, Any]:
        return self.inner.to_dict()


@pytest.fixture(scope="module")
def parts() -> tuple[Any, Any, Any]:
    path = get_demo_checkpoint("demo/mllama-tiny")
    return load_mllama_config(path), get_tokenizer(path), get_image_processor(path)


def make(parts: tuple[Any, Any, Any], cache_bytes: int = GiB, **kw: Any) -> MllamaInputProcessor:
    spec, tok, ip = parts
    return MllamaInputProcessor(spec, tok, CountingProcessor(ip), 2, 512,
                                image_cache_bytes=cache_bytes, **kw)  # fmt: skip


def pil(w: int, h: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def prompt(proc: MllamaInputProcessor, images: list[Any], **extra: Any) -> dict[str, Any]:
    ids = [proc.spec.image_token_id] * len(images) + [5, 6, 7]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}, **extra}


def same_inputs(a: Any, b: Any) -> bool:
    """Equal processed images (of ProcessedInputs or ImageInputs), bit for bit."""
    a, b = getattr(a, "images", a), getattr(b, "images", b)
    return (
        a.pixel_values.equal(b.pixel_values)
        and a.aspect_ratio_ids.equal(b.aspect_ratio_ids)
        and a.num_tiles == b.num_tiles
        and a.digests == b.digests
    )


def test_resent_image_is_neither_decoded_nor_tiled(parts, monkeypatch) -> None:
    """The server's path: fetched bytes are hashed before decoding; the second request with
    the same image calls neither the decoder nor the image processor, and gets the same
    pixels, aspect-ratio id, tile count and digest as the first."""
    proc = make(parts)
    decodes = []
    real_decode = image_mod.decode_image

    def counting_decode(data: bytes, max_pixels: int | None = None) -> Any:
        decodes.append(len(data))
        return real_decode(data, max_pixels)

    monkeypatch.setattr(image_mod, "decode_image", counting_decode)
    media = ImageMediaConnector()
    data = png(pil(90, 40, seed=1))

    def turn() -> Any:
        images = asyncio.run(media.fetch_images_async([data_url(data)], proc.image_lookup()))
        assert all(isinstance(i, HashedImage) for i in images)
        return proc.process(prompt(proc, images))

    first = turn()
    assert (len(decodes), proc.image_processor.images) == (1, 1)
    second = turn()
    assert (len(decodes), proc.image_processor.images) == (1, 1)  # no decode, no tiling
    assert same_inputs(first, second)
    assert first.images.digests == [encoded_image_digest(data, proc.fingerprint)]
    # The blocking twin (offline LLM.chat) finds it too.
    hit = media.fetch_image(data_url(data), proc.image_lookup())
    assert hit.processed is not None and len(decodes) == 1
    # Without the cache, every request decodes and tiles again.
    off = make(parts, cache_bytes=0)
    for n in (1, 2):
        images = asyncio.run(media.fetch_images_async([data_url(data)], off.image_lookup()))
        assert same_inputs(off.process(prompt(off, images)), first)
        assert off.image_processor.images == n
    assert len(decodes) == 3


def test_resent_data_url_is_not_base64_decoded(parts, monkeypatch) -> None:
    """A resent data: URL is found from its base64 text: no base64 decoding, no image
    decoding, the same digest and pixels; another salt, a changed URL or the cache off
    decode again; the memo of URLs keeps at most its number of entries."""
    proc = make(parts)
    decoded = []
    real = image_mod.decode_base64

    def counting(payload: str) -> bytes:
        decoded.append(len(payload))
        return real(payload)

    monkeypatch.setattr(image_mod, "decode_base64", counting)
    media = ImageMediaConnector()
    url = data_url(png(pil(60, 30, seed=11)))

    def turn(u: str, salt: str | None = None, p: MllamaInputProcessor = proc) -> Any:
        images = asyncio.run(media.fetch_images_async([u], p.image_lookup(salt)))
        return p.process(prompt(p, images, **({"cache_salt": salt} if salt else {})))

    first = turn(url)
    assert len(decoded) == 1 and len(proc.data_urls) == 1
    assert same_inputs(turn(url), first) and len(decoded) == 1  # found by its text
    hit = media.fetch_image(url, proc.image_lookup())  # the blocking twin too
    assert hit.processed is not None and len(decoded) == 1
    turn(url, salt="tenant")  # its own entries: decoded (and tiled) once for that salt
    assert len(decoded) == 2 and proc.image_processor.images == 2
    turn(url, salt="tenant")
    assert len(decoded) == 2
    other = data_url(png(pil(60, 30, seed=12)))
    turn(other)
    assert len(decoded) == 3
    off = make(parts, cache_bytes=0)
    for n in (1, 2):
        assert same_inputs(turn(url, p=off), first)
        assert len(decoded) == 3 + n and len(off.data_urls) == 0
    # A URL whose text differs from a remembered one in one base64 character is not found
    # (whether its bytes still decode to an image or not).
    bad = url[:-8] + ("A" if url[-8] != "A" else "B") + url[-7:]
    with contextlib.suppress(ValueError):
        asyncio.run(media.fetch_images_async([bad], proc.image_lookup()))
    assert len(decoded) == 6
    memo = DigestMemo(2)
    for i in range(3):
        memo.put(bytes([i]) * 32, bytes([i]) * 32)
    assert len(memo) == 2 and memo.get(bytes(32)) is None and memo.get(b"\x02" * 32)


def test_a_hit_meets_the_pixel_limit_a_decode_would(parts) -> None:
    """Whether a request passes the pixel limit does not depend on the cache."""
    proc = make(parts)
    url = data_url(png(pil(40, 40, seed=7)))
    images = asyncio.run(ImageMediaConnector().fetch_images_async([url], proc.image_lookup()))
    proc.process(prompt(proc, images))  # now cached
    strict = ImageMediaConnector(max_pixels=1000)
    for fetch in (
        lambda: asyncio.run(strict.fetch_images_async([url], proc.image_lookup())),
        lambda: strict.fetch_image(url, proc.image_lookup()),
    ):
        with pytest.raises(ValueError, match="1600 pixels, more than the limit of 1000"):
            fetch()
    assert proc.image_processor.images == 1


def test_pil_images_hash_their_pixels(parts) -> None:
    """Offline PIL images: an equal copy is a hit; one changed pixel, another mode or size
    is another image; a palette image's digest covers its palette."""
    from PIL import Image

    proc = make(parts)
    img = pil(60, 60, seed=2)
    first = proc.process(prompt(proc, [img]))
    again = proc.process(prompt(proc, [img.copy()]))
    assert proc.image_processor.images == 1 and same_inputs(first, again)

    changed = img.copy()
    changed.putpixel((3, 4), (0, 0, 0) if img.getpixel((3, 4)) != (0, 0, 0) else (1, 1, 1))
    other = proc.process(prompt(proc, [changed]))
    assert proc.image_processor.images == 2
    assert other.images.digests != first.images.digests

    fp = proc.fingerprint
    digests = {
        pil_image_digest(img, fp),
        pil_image_digest(img.convert("RGBA"), fp),
        pil_image_digest(img.crop((0, 0, 60, 59)), fp),
    }
    assert len(digests) == 3
    p1 = Image.new("P", (4, 4), 0)
    p1.putpalette([255, 0, 0] * 256)
    p2 = p1.copy()
    p2.putpalette([0, 0, 255] * 256)
    assert p1.tobytes() == p2.tobytes()
    assert pil_image_digest(p1, fp) != pil_image_digest(p2, fp)


def test_other_options_and_other_images_never_share_an_entry(parts) -> None:
    """Two processors that differ in one option get other digests for the same image; even
    sharing one cache object, each tiles the image itself and keeps its own result."""
    base = make(parts)
    two_tiles = make(parts, processor_kwargs={"max_image_tiles": 2})
    two_tiles.image_cache = base.image_cache
    data = png(pil(200, 50, seed=3))  # 4 tiles wide at the model's 4, 2 when capped at 2
    for other in (
        two_tiles,
        make(parts, processor_kwargs={"resample": 0}),
        make(parts, processor_kwargs={"image_mean": [0.5, 0.5, 0.5]}),
        make(parts, pixel_dtype=torch.bfloat16),
    ):
        assert (
            other.image_lookup().lookup_encoded(data)[0]
            != base.image_lookup().lookup_encoded(data)[0]
        )
        assert other.fingerprint != base.fingerprint

    img = pil(200, 50, seed=3)
    a = base.process(prompt(base, [img]))
    b = two_tiles.process(prompt(two_tiles, [img]))
    assert base.image_processor.images == two_tiles.image_processor.images == 1
    assert a.images.num_tiles == [4] and b.images.num_tiles == [2]
    assert len(base.image_cache) == 2
    # Processed again, each finds its own entry.
    assert same_inputs(base.process(prompt(base, [img])), a)
    assert same_inputs(two_tiles.process(prompt(two_tiles, [img])), b)
    assert base.image_processor.images == two_tiles.image_processor.images == 1

    # Two different images of one request: two entries, two digests, and each image's
    # pixels are its own (the same as when processed alone, in either order).
    c, d = pil(70, 70, seed=4), pil(70, 70, seed=5)
    fresh = make(parts)
    both = fresh.process(prompt(fresh, [c, d]))
    assert fresh.image_processor.images == 2 and both.images.digests[0] != both.images.digests[1]
    alone = make(parts, cache_bytes=0)
    for i, img_i in enumerate((c, d)):
        single = alone.process(prompt(alone, [img_i])).images
        assert single.pixel_values[0].equal(both.images.pixel_values[i])
    swapped = fresh.process(prompt(fresh, [d, c]))
    assert fresh.image_processor.images == 2
    assert swapped.images.pixel_values[0].equal(both.images.pixel_values[1])


def test_cached_pixels_equal_the_uncached_path(parts) -> None:
    """The cache changes nothing a request gets: pinned or not, in the model's dtype."""
    img = pil(120, 30, seed=6)
    for dtype in (torch.float32, torch.bfloat16):
        on, off = make(parts, pixel_dtype=dtype), make(parts, cache_bytes=0, pixel_dtype=dtype)
        ref = off.process(prompt(off, [img]))
        assert ref.images.pixel_values.dtype == dtype
        for _ in range(2):
            assert same_inputs(on.process(prompt(on, [img])), ref)


def test_one_image_shares_its_entry_two_are_stacked(parts) -> None:
    """A one-image request's pixels are its cache entry itself (a resent image costs no copy);
    two images are stacked into a tensor of their own, and neither path writes the entries."""
    proc = make(parts)
    a, b = pil(120, 30, seed=8), pil(40, 90, seed=9)
    first = proc.process(prompt(proc, [a])).images
    entry = proc.cached_image(first.digests[0], None)
    assert entry is not None
    snapshot = entry.pixel_values.clone()
    again = proc.process(prompt(proc, [a])).images
    for got in (first, again):
        assert got.pixel_values.shape == (1, *entry.pixel_values.shape)
        assert got.pixel_values.data_ptr() == entry.pixel_values.data_ptr()
    both = proc.process(prompt(proc, [a, b])).images
    assert both.pixel_values.data_ptr() != entry.pixel_values.data_ptr()
    assert both.pixel_values[0].equal(snapshot)
    assert entry.pixel_values.equal(snapshot)


def test_tenants_salts_keep_their_entries_apart(parts) -> None:
    """A hit is visible in timing, so each salt has its own entries; the image's identity
    (what prefix keys are built from) is the same for all of them."""
    proc = make(parts)
    data = png(pil(50, 50, seed=8))
    media = ImageMediaConnector()

    def show(salt: str | None) -> Any:
        images = asyncio.run(media.fetch_images_async([data_url(data)], proc.image_lookup(salt)))
        return proc.process(prompt(proc, images, **({"cache_salt": salt} if salt else {})))

    a = show("tenant-a")
    assert show("tenant-a").cache_salt == "tenant-a" and proc.image_processor.images == 1
    b = show("tenant-b")
    assert proc.image_processor.images == 2 and len(proc.image_cache) == 2
    show(None)
    assert proc.image_processor.images == 3
    assert same_inputs(a, b) and a.images.digests == b.images.digests
    img = pil(30, 30, seed=9)  # offline PIL images too
    proc.process(prompt(proc, [img], cache_salt="x"))
    proc.process(prompt(proc, [img], cache_salt="y"))
    proc.process(prompt(proc, [img], cache_salt="x"))
    assert proc.image_processor.images == 5


def _entry(nbytes: int) -> ProcessedImage:
    return ProcessedImage(torch.zeros(nbytes - ENTRY_OVERHEAD_BYTES, dtype=torch.uint8), 1, 1)


def test_lru_bounded_in_bytes() -> None:
    size = 4096
    cache = ProcessedImageCache(3 * size)
    for key in (b"a", b"b", b"c"):
        cache.put(key, _entry(size))
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"d", _entry(size))  # evicts b, the least recently used
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d"))
    cache.put(b"big", _entry(2 * size))  # evicts c and a
    assert [k in cache for k in (b"a", b"c", b"d", b"big")] == [False, False, True, True]
    assert cache.num_bytes == 3 * size
    cache.put(b"huge", _entry(4 * size))  # larger than the whole cache: not stored
    assert b"huge" not in cache and cache.num_bytes == 3 * size
    cache.put(b"d", _entry(size))  # a second store replaces, it does not double count
    assert cache.num_bytes == 3 * size and len(cache) == 2
    assert (cache.queries, cache.hits) == (1, 1)
    with pytest.raises(ValueError):
        ProcessedImageCache(-1)


def test_concurrent_use_keeps_the_bound() -> None:
    """Server decode threads and engine input threads at once: the byte count stays exact
    and within the bound, and a hit is always the entry stored under that key."""
    size = 1024
    cache = ProcessedImageCache(8 * size)
    entries = {bytes([k]): _entry(size) for k in range(32)}
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            key = bytes([rng.randrange(32)])
            hit = cache.get(key)
            if hit is not None and hit is not entries[key]:
                errors.append("wrong entry")
            if hit is None:
                cache.put(key, entries[key])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stored = [k for k in entries if k in cache]
    assert cache.num_bytes == len(stored) * size <= 8 * size
    assert cache.queries == 8000


def test_digest_is_sha256_of_length_prefixed_fields(parts) -> None:
    """Independent recomputation: the digest is SHA-256 over the documented fields, and a
    one-byte change of the image or of the options changes it."""
    fp = make(parts).fingerprint
    data = b"\x89PNG not really"

    def field(b: bytes) -> bytes:
        return len(b).to_bytes(8, "little") + b

    expected = hashlib.sha256(
        field(b"vllm/mllama/image/encoded/v1") + field(fp) + field(data)
    ).digest()
    assert encoded_image_digest(data, fp) == expected
    assert encoded_image_digest(data + b"\0", fp) != expected
    assert encoded_image_digest(data, bytes([fp[0] ^ 1]) + fp[1:]) != expected


def test_cache_salt_is_checked_and_carried(parts) -> None:
    proc = make(parts)
    assert proc.process({"prompt_token_ids": [5, 6]}).cache_salt is None
    assert proc.process({"prompt_token_ids": [5, 6], "cache_salt": "tenant-a"}).cache_salt == (
        "tenant-a"
    )
    explicit = {
        "encoder_prompt": {"prompt": ""},
        "decoder_prompt": {"prompt": "hi", "cache_salt": "t"},
    }
    assert proc.process(explicit).cache_salt == "t"
    explicit["encoder_prompt"]["cache_salt"] = "u"
    with pytest.raises(ValueError, match="different salts"):
        proc.process(explicit)
    for bad in ("", 5, ["a"], "x" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(ValueError, match="cache_salt"):
            proc.process({"prompt_token_ids": [5, 6], "cache_salt": bad})
    assert proc.process({"prompt": "x", "cache_salt": "y" * MAX_CACHE_SALT_CHARS}).cache_salt


def test_offline_check_prompt_refuses_bad_salts() -> None:
    from vllm.entrypoints.llm import check_prompt

    check_prompt({"prompt": "a", "cache_salt": "s"})
    with pytest.raises(ValueError, match=r"prompts\[0\]: cache_salt"):
        check_prompt({"prompt": "a", "cache_salt": ""}, "prompts[0]")
