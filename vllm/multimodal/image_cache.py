"""A bounded cache of processed image inputs, keyed by image identity (``image_identity.py``).

Chat clients resend the whole conversation, its images included, on every turn. With this cache
a resent image is neither decoded nor tiled again: the server looks the image's digest up
before decoding, and input processing looks it up before running the image processor.

The cache holds, per image, what the Mllama processor produces for it (the pixel values of its
tiles at the model's tile count, in the model's dtype, its aspect-ratio id and tile count). It
is bounded in bytes (``--mm-processor-cache-gb``, vLLM's flag; 0 disables it), least recently
used first out, and thread-safe: the server's decode threads and the engine's input-processing
threads use it at once. Two requests that miss on the same new image at the same moment both
process it (the second store only refreshes the entry); nothing waits on another request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Bookkeeping per entry beyond its tensor bytes (the dict slot, the dataclass, the digest).
ENTRY_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model takes it. pixel_values: [max_tiles, C, S, S] in the model's
    dtype, on the CPU; shared by every request that shows the image, so never written to."""

    pixel_values: torch.Tensor
    aspect_ratio_id: int  # 1-based index into the model's table of tile arrangements
    num_tiles: int
    # (width, height) of the image as decoded: a hit is held to the pixel limit it would
    # have met when decoded, so that a request's fate does not depend on the cache.
    source_size: tuple[int, int] = (0, 0)

    @property
    def nbytes(self) -> int:
        return self.pixel_values.nbytes + ENTRY_OVERHEAD_BYTES


class ProcessedImageCache:
    """LRU map digest -> :class:`ProcessedImage`, at most ``capacity_bytes`` in all."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"the image cache capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = 0  # lookups
        self.hits = 0  # lookups that found the image

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def get(self, digest: bytes) -> ProcessedImage | None:
        """The processed inputs under ``digest`` (now the most recently used), or None."""
        with self._lock:
            self.queries += 1
            entry = self._entries.get(digest)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(digest)
            return entry

    def put(self, digest: bytes, entry: ProcessedImage) -> None:
        """Stores ``entry`` as the most recently used, evicting the least recently used ones
        until it fits; an entry larger than the whole cache is not stored."""
        size = entry.nbytes
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
            self._entries[digest] = entry
            self._bytes += size

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        """Membership without counting a query or refreshing the entry (for tests and logs)."""
        with self._lock:
            return digest in self._entries

    def clear(self) -> None:
        """Drops every entry and zeroes the counters."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self.queries = self.hits = 0


class DigestMemo:
    """A bounded LRU map key -> digest (both 32 bytes): what a ``data:`` URL's base64 text
    decodes to, so that a resent URL is found without decoding it. Thread-safe."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            digest = self._entries.get(key)
            if digest is not None:
                self._entries.move_to_end(key)
            return digest

    def put(self, key: bytes, digest: bytes) -> None:
        with self._lock:
            self._entries[key] = digest
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
