"""Turns a prompt (text or token ids, plus images) into what the engine schedules and runs.

Images go through the checkpoint's Mllama image processor (resize to the best tile canvas, pad,
normalise, split into tiles, pack at the maximum tile count), unless the processed-image cache
(``image_cache.py``) already holds them under the image's digest (``image_identity.py``). Which
images each token sees is kept as runs over image indices (``cross_attention.py``), turned into
vision-token ranges once the tile counts are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from vllm.inputs import check_cache_salt
from vllm.multimodal.cross_attention import (
    ImageRun,
    count_image_tokens,
    image_runs,
    last_group,
)
from vllm.multimodal.image import DECODER_RULES
from vllm.multimodal.image_cache import DigestMemo, ProcessedImage, ProcessedImageCache
from vllm.multimodal.image_identity import (
    HashedImage,
    cache_key,
    data_url_key,
    encoded_image_digest,
    pil_image_digest,
    processing_fingerprint,
)
from vllm.transformers_utils.config import MllamaSpec

# Resent data: URLs remembered by their text (64 bytes of digests each, plus the dict's own).
DATA_URL_MEMO_ENTRIES = 4096


@dataclass
class ImageInputs:
    """A request's images, processed. pixel_values: [N, max_tiles, C, S, S] in the model's
    dtype; for one image, a view of its processed-image entry (shared, so never written to)."""

    pixel_values: torch.Tensor
    aspect_ratio_ids: torch.Tensor  # [N] int64 (1-based; 0 is never used here)
    num_tiles: list[int]
    # Per image, its identity (``image_identity.py``): SHA-256 of its encoded bytes or pixels
    # and of the processing options. Prefix-cache and cross-KV keys are built from these.
    digests: list[bytes] = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return len(self.num_tiles)


@dataclass
class ProcessedInputs:
    """A validated request input: token ids, images and the token -> image visibility."""

    prompt_token_ids: list[int]
    images: ImageInputs | None = None
    runs: list[ImageRun] = field(default_factory=list)
    last_group: tuple[int, int] | None = None
    prompt: str | None = None
    tokens_per_tile: int = 0
    image_token_id: int = 0
    image_token: str = "<|image|>"
    # vLLM's request field: requests share cached KV only when their salts are equal.
    cache_salt: str | None = None
    # With prefix caching, the prompt's page keys (``core.prefix_keys.PageKeyChain``), made
    # when the inputs are processed (off the engine loop in the server), so that admission
    # does not hash the prompt again.
    page_chain: Any = None

    def image_token_offsets(self) -> list[int]:
        """Start of each image in the request's packed vision tokens (plus the total)."""
        offsets = [0]
        for nt in self.images.num_tiles if self.images else []:
            offsets.append(offsets[-1] + nt * self.tokens_per_tile)
        return offsets

    @property
    def num_vision_tokens(self) -> int:
        return self.image_token_offsets()[-1]

    @property
    def cached_vision_range(self) -> tuple[int, int]:
        """[start, end) of the last image group in the packed vision tokens (what is cached)."""
        if self.last_group is None:
            return 0, 0
        offsets = self.image_token_offsets()
        return offsets[self.last_group[0]], offsets[self.last_group[1]]

    @property
    def encoder_seq_len(self) -> int:
        start, end = self.cached_vision_range
        return end - start

    @property
    def num_images(self) -> int:
        return self.images.num_images if self.images else 0

    def sees_images(self, start: int, end: int) -> bool:
        """Whether any of the tokens ``[start, end)`` sees an image (tokens past the prompt,
        a recomputed sequence's outputs, see the last image group)."""
        if self.last_group is not None and end > len(self.prompt_token_ids):
            return True
        return any(r.tok_start < end and r.tok_end > start and r.img_end > r.img_start
                   for r in self.runs)

    def sees_last_group(self, start: int) -> bool:
        """Whether every token from ``start`` on sees exactly the last image group, as decode
        tokens do (no image token among them, no earlier group in view)."""
        if self.last_group is None or not self.runs:
            return False
        if start >= len(self.prompt_token_ids):
            return True
        # The trailing runs that see the whole group (the group's last image token, then
        # the text after it), back to back up to the prompt's end.
        first = len(self.prompt_token_ids)
        for run in reversed(self.runs):
            if run.tok_end != first or (run.img_start, run.img_end) != self.last_group:
                break
            first = run.tok_start
        return start >= first

    @cached_property
    def encoder_prompt_token_ids(self) -> list[int]:
        """vLLM's encoder prompt for this model: one image token per vision token of the last
        image group (1,601 per 560-px tile), empty without images. Usage counts add it to the
        decoder prompt, as vLLM's do; built once per request and shared by its outputs."""
        return [self.image_token_id] * self.encoder_seq_len

    @cached_property
    def encoder_prompt(self) -> str:
        return self.image_token * self.encoder_seq_len


def tile_arrangements(max_tiles: int) -> list[tuple[int, int]]:
    """The Mllama image processor's table of tile arrangements (width, height) for at most
    ``max_tiles`` tiles, in its order; an aspect-ratio id is 1 + an index into it."""
    sizes = range(1, max_tiles + 1)
    return [(w, h) for w in sizes for h in sizes if w * h <= max_tiles]


def _as_image_list(data: Any) -> list[Any]:
    from PIL import Image

    images = data if isinstance(data, (list, tuple)) else [data]
    for i, img in enumerate(images):
        if not isinstance(img, (Image.Image, HashedImage)):
            raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, "
                             f"got {type(img).__name__}")
    return list(images)


@dataclass(frozen=True)
class ImageLookup:
    """The processed-image cache as one request's image fetching sees it (its salt)."""

    processor: MllamaInputProcessor
    cache_salt: str | None

    def lookup_encoded(self, data: bytes) -> tuple[bytes, ProcessedImage | None]:
        """The digest of fetched bytes, and the processed image if the cache holds it (then
        it is neither decoded nor tiled again)."""
        digest = encoded_image_digest(data, self.processor.fingerprint)
        return digest, self.processor.cached_image(digest, self.cache_salt)

    def find_data_url(self, payload: str) -> tuple[bytes, tuple[bytes, ProcessedImage] | None]:
        """A resent ``data:`` URL: the digest its bytes had, and the cached processed image,
        found from its base64 text alone (``data_url_key``); None when either is unknown."""
        key = data_url_key(payload, self.processor.fingerprint, self.cache_salt)
        if not self.processor.image_cache.enabled:
            return key, None
        digest = self.processor.data_urls.get(key)
        hit = None if digest is None else self.processor.cached_image(digest, self.cache_salt)
        return key, None if hit is None else (digest, hit)

    def remember_data_url(self, key: bytes, digest: bytes) -> None:
        if self.processor.image_cache.enabled:
            self.processor.data_urls.put(key, digest)


class MllamaInputProcessor:
    """Tokenises prompts, processes images and validates the pair against the model.

    Thread-safe: the async engine runs it in a pool of worker threads (the processed-image
    cache has its own lock; everything else is read-only after construction)."""

    def __init__(self, spec: MllamaSpec, tokenizer: Any, image_processor: Any,
                 limit_images: int, max_model_len: int,
                 pixel_dtype: torch.dtype = torch.float32, pin_memory: bool = False,
                 processor_kwargs: dict[str, Any] | None = None,
                 image_cache_bytes: int = 0) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.limit_images = limit_images
        self.max_model_len = max_model_len
        # Pixels leave here in the model's dtype and, on CUDA, in pinned memory: the cast and
        # the pinning happen in the input-processing thread, off the step's critical path.
        self.pixel_dtype = pixel_dtype
        self.pin_memory = pin_memory
        self.image_token = str(tokenizer.convert_ids_to_tokens(spec.image_token_id))
        # --mm-processor-kwargs (checked by EngineArgs), passed on every call.
        self.processor_kwargs = dict(processor_kwargs or {})
        # --mm-processor-cache-gb: processed images by digest (0 bytes: off).
        self.image_cache = ProcessedImageCache(image_cache_bytes)
        # data: URL text -> the digest of its bytes (``ImageLookup.find_data_url``).
        self.data_urls = DigestMemo(DATA_URL_MEMO_ENTRIES)
        self.fingerprint = processing_fingerprint(
            {"class": type(image_processor).__qualname__, **image_processor.to_dict()},
            self.processor_kwargs, spec.vision.max_num_tiles,
            list(spec.vision.supported_aspect_ratios), str(pixel_dtype), DECODER_RULES)

    # ------------------------------------------------------------------ images
    def image_lookup(self, cache_salt: str | None = None) -> ImageLookup:
        """What the server's image fetching asks before decoding, for one request."""
        return ImageLookup(self, check_cache_salt(cache_salt))

    def cached_image(self, digest: bytes, cache_salt: str | None) -> ProcessedImage | None:
        """The processed image under ``digest`` for a request salted ``cache_salt``, or None."""
        if not self.image_cache.enabled:
            return None
        return self.image_cache.get(cache_key(digest, cache_salt))

    def process_images(self, images: Sequence[Any],
                       cache_salt: str | None = None) -> ImageInputs:
        """PIL images and :class:`HashedImage` s -> the request's pixel values and identities;
        only images the cache does not hold (under ``cache_salt``) go through the image
        processor."""
        digests, entries = [], []
        for img in images:
            if isinstance(img, HashedImage):
                digest, entry = img.digest, img.processed
            else:
                digest, entry = pil_image_digest(img, self.fingerprint), None
            if entry is None:
                entry = self.cached_image(digest, cache_salt)
            if entry is None:
                entry = self._process_one(img.image if isinstance(img, HashedImage) else img)
                if self.image_cache.enabled:
                    self.image_cache.put(cache_key(digest, cache_salt), entry)
            digests.append(digest)
            entries.append(entry)
        first = entries[0].pixel_values
        if len(entries) == 1 and (first.is_pinned() or not self.pin_memory):
            # One image: its (pinned) cache entry as is, never written to (``ProcessedImage``),
            # so a resent image costs no copy and no pinned allocation.
            pixels = first.unsqueeze(0)
        else:
            pixels = torch.empty((len(entries), *first.shape), dtype=first.dtype,
                                 pin_memory=self.pin_memory)
            torch.stack([e.pixel_values for e in entries], out=pixels)
        ratio_ids = torch.tensor([e.aspect_ratio_id for e in entries], dtype=torch.long)
        return ImageInputs(pixel_values=pixels, aspect_ratio_ids=ratio_ids,
                           num_tiles=[e.num_tiles for e in entries], digests=digests)

    def _process_one(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[[image]], return_tensors="pt",
                                   **self.processor_kwargs)
        pixels = out["pixel_values"][0]
        ratio_ids = out["aspect_ratio_ids"][0].long()
        if pixels.shape[1] < self.spec.vision.max_num_tiles:  # max_image_tiles was lowered
            pixels, ratio_ids = self._to_model_tiles(pixels, ratio_ids)
        # [max_tiles, C, S, S], owning its storage (a cache entry keeps nothing else alive);
        # on CUDA in pinned memory, where a one-image request uses it without a copy.
        tiles = pixels[0].to(self.pixel_dtype)
        if self.pin_memory:
            tiles = tiles.pin_memory()
        elif not tiles.is_contiguous() or tiles.untyped_storage().nbytes() != tiles.nbytes:
            tiles = tiles.clone(memory_format=torch.contiguous_format)
        return ProcessedImage(tiles, int(ratio_ids[0]), int(out["num_tiles"][0][0]),
                              tuple(image.size))

    def _to_model_tiles(
        self, pixels: torch.Tensor, ratio_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images tiled at fewer than the model's ``max_num_tiles``: the tiles are padded with
        zeros to the model's count, and the aspect-ratio ids, which index the arrangements for
        the lower count, are mapped to the model's table of arrangements."""
        used = pixels.shape[1]
        pad = self.spec.vision.max_num_tiles - used
        pixels = torch.cat([pixels, pixels.new_zeros((pixels.shape[0], pad, *pixels.shape[2:]))], 1)
        theirs = tile_arrangements(used)
        ours = [tuple(r) for r in self.spec.vision.supported_aspect_ratios]
        mapped = [ours.index(theirs[int(i) - 1]) + 1 for i in ratio_ids]
        return pixels, torch.tensor(mapped, dtype=torch.long)

    # ------------------------------------------------------------------ prompts
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def build(self, token_ids: list[int], images: Sequence[Any] | None,
              prompt: str | None = None, cache_salt: str | None = None) -> ProcessedInputs:
        """Validates ids against images and limits; processes the images."""
        spec = self.spec
        if not token_ids:
            raise ValueError("The prompt is empty.")
        limit = spec.text.num_embeddings
        if min(token_ids) < 0 or max(token_ids) >= limit:  # scans in C, then find which
            bad = next(t for t in token_ids if not 0 <= t < limit)
            raise ValueError(f"Token id {bad} is out of vocabulary "
                             f"(valid ids are 0..{limit - 1}).")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, which leaves no room to generate "
                f"within this model's maximum context length of {self.max_model_len} tokens.")
        images = list(images or [])
        if len(images) > self.limit_images:
            raise ValueError(
                f"You set image={self.limit_images} (or defaulted to 1) in "
                f"`--limit-mm-per-prompt`, but passed {len(images)} image items in the same "
                "prompt.")
        n_tokens = count_image_tokens(token_ids, spec.image_token_id)
        if n_tokens != len(images):
            raise ValueError(f"The number of image tokens ({n_tokens}) must be the same as the "
                             f"number of images ({len(images)})")
        cache_salt = check_cache_salt(cache_salt)
        image_inputs = self.process_images(images, cache_salt) if images else None
        return ProcessedInputs(
            prompt_token_ids=token_ids,
            images=image_inputs,
            runs=image_runs(token_ids, spec.image_token_id),
            last_group=last_group(token_ids, spec.image_token_id),
            prompt=prompt,
            tokens_per_tile=spec.vision.tokens_per_tile,
            image_token_id=spec.image_token_id,
            image_token=self.image_token,
            cache_salt=cache_salt,
        )

    def process(self, prompt: Any) -> ProcessedInputs:
        """vLLM prompt forms: a string; ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``
        with optional ``multi_modal_data={"image": img | [img, ...]}`` and ``cache_salt``; or
        an explicit ``{"encoder_prompt": ..., "decoder_prompt": ...}`` pair."""
        if isinstance(prompt, str):
            return self.build(self.tokenize(prompt), None, prompt)
        if not isinstance(prompt, dict):
            raise TypeError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        if "encoder_prompt" in prompt or "decoder_prompt" in prompt:
            return self._process_explicit(prompt)
        salt = check_cache_salt(prompt.get("cache_salt"))  # before any image is processed
        images = self._images_of(prompt)
        if "prompt_token_ids" in prompt:
            ids = list(map(int, prompt["prompt_token_ids"]))
            return self.build(ids, images, prompt.get("prompt"), salt)
        if "prompt" in prompt:
            return self.build(self.tokenize(prompt["prompt"]), images, prompt["prompt"], salt)
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")

    @staticmethod
    def _images_of(prompt: dict[str, Any]) -> list[Any]:
        mm = prompt.get("multi_modal_data") or {}
        unknown = set(mm) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modalities {sorted(unknown)} "
                             "(this model takes 'image')")
        return _as_image_list(mm["image"]) if "image" in mm else []

    def _process_explicit(self, prompt: dict[str, Any]) -> ProcessedInputs:
        """The encoder prompt supplies the images (its text may hold only image tokens); the
        decoder prompt the text. Without image tokens in the decoder prompt the images lead it,
        exactly as the implicit prompt ``"<|image|>" * n + decoder_text`` would. A
        ``cache_salt`` may sit in either part (or beside them); two different ones are refused."""
        enc = prompt.get("encoder_prompt") or {}
        dec = prompt.get("decoder_prompt") or ""
        enc = {"prompt": enc} if isinstance(enc, str) else enc
        salts = {check_cache_salt(part.get("cache_salt"))
                 for part in (prompt, enc, dec) if isinstance(part, dict)} - {None}
        if len(salts) > 1:
            raise ValueError("cache_salt: the encoder and decoder prompts give different salts")
        salt = salts.pop() if salts else None
        images = self._images_of(enc)
        enc_text = enc.get("prompt", "")
        image_tok = self.image_token
        if enc_text.replace(image_tok, "").strip():
            raise ValueError("encoder_prompt may only contain image tokens for this model")
        if isinstance(dec, dict) and "prompt_token_ids" in dec:
            ids = list(map(int, dec["prompt_token_ids"]))
            if images and count_image_tokens(ids, self.spec.image_token_id) == 0:
                ids = [self.spec.image_token_id] * len(images) + ids
            return self.build(ids, images, cache_salt=salt)
        text = dec.get("prompt", "") if isinstance(dec, dict) else dec
        if images and image_tok not in text:
            text = image_tok * len(images) + text
        return self.build(self.tokenize(text), images, text, salt)
