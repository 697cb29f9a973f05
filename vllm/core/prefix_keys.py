"""Prefix-cache keys: when two requests may share cached KV.

Two kinds of cached KV, two kinds of keys (32-byte SHA-256 digests):

* A **self page** holds ``block_size`` tokens of self-attention K/V for every self-attention
  layer. Its key is a hash chain: ``key[i] = H(key[i-1], tokens of page i, digests of the
  images whose <|image|> token lies in page i)``, with ``key[-1]`` the chain root,
  ``H(block_size, cache_salt)``. Two sequences share page ``i`` only if they agree on every
  token of pages ``0..i``, on every image any of those tokens sees, and on the salt.
* A **cross group** holds the cross-attention K/V of a request's decode-visible image group
  (the last group: the only one decode tokens see, so the only one whose K/V is kept). Its key
  is ``H(cache_salt, digests of the group's images in order)``: it depends on the images alone,
  not on the text around them, since the K/V are projections of the vision tower's output.

Image digests come from ``vllm.multimodal.image_identity`` (the image's bytes or pixels and
every processing option that shapes its tiles), so the same token ids with another image, or
the same image under other processing options, never share a page or a group.

Which images a token sees in Mllama
-----------------------------------
The processor's cross-attention mask (HF ``get_cross_attention_token_mask`` and Meta's
reference; here ``multimodal/cross_attention.py``, turned into one ``[kv_start, kv_end)`` range
per token by ``worker/prefill_inputs.py``): consecutive ``<|image|>`` tokens form a group; the
k-th ``<|image|>`` token of a group sees images 1..k of its group; every later token sees the
whole group until the next group's first ``<|image|>`` token, and tokens after the last group
(generated tokens included) see the last group. A token before the first image sees nothing:
its cross-attention and cross-MLP outputs are zeroed (``full_text_row_masked_out_mask``), so its
hidden states do not depend on any image at all.

So what a token sees depends only on the tokens up to and including it: visibility is causal.
The K/V a self-attention layer stores for token ``t`` depend on the hidden states of tokens
``0..t``, hence on every image seen by any of them. An image is seen by its own ``<|image|>``
token, and by no token before it. Therefore the images that pages ``0..i`` depend on are
exactly the images whose ``<|image|>`` token lies in pages ``0..i``, and the chain above,
which adds each image's digest in the page holding its token, covers them: equal keys mean
equal tokens and equal images seen, token for token. A text-only prefix (a system prompt
before the first image) gets the same keys with any image after it, or none.

Only prompt tokens introduce images: a generated token is never an image (the image token id
lies outside the LM head, and the engine gives generated tokens the last group whatever their
id), so pages past the prompt add no digests, and a next turn that resends those tokens as its
prompt gets the same keys.

A request must compute at least its last prompt token (its logits give the first output
token), so it takes at most :func:`max_cached_pages` pages from the cache. The images it still
has to encode are those seen by the tokens it computes (:func:`images_seen`); when that is
only its last group and the group's cross KV is cached, it runs no vision at all.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.multimodal.cross_attention import ImageRun
from vllm.multimodal.processing import ProcessedInputs

_ROOT = b"vllm/mllama/prefix/root/v1"
_PAGE = b"vllm/mllama/prefix/page/v1"
_CROSS = b"vllm/mllama/prefix/cross/v1"


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _salt(cache_salt: str | None) -> bytes:
    # A flag byte, so that "no salt" is distinct from every salt.
    return b"\0" if cache_salt is None else b"\1" + _field(cache_salt.encode("utf-8"))


def chain_root(block_size: int, cache_salt: str | None) -> bytes:
    """The key before page 0: the page size and the salt."""
    return hashlib.sha256(
        _field(_ROOT) + struct.pack("<Q", block_size) + _salt(cache_salt)
    ).digest()


def page_key(parent: bytes, tokens: Sequence[int], image_digests: Sequence[bytes]) -> bytes:
    """The key of one full self page: its parent's key, its tokens, and the digests of the
    images whose ``<|image|>`` token it holds (in prompt order)."""
    h = hashlib.sha256(_field(_PAGE) + _field(parent))
    h.update(_field(struct.pack(f"<{len(tokens)}I", *tokens)))
    h.update(struct.pack("<Q", len(image_digests)))
    for d in image_digests:
        h.update(_field(d))
    return h.digest()


def cross_group_key(image_digests: Sequence[bytes], cache_salt: str | None) -> bytes:
    """The key of a cross group: the decode-visible images (in order) and the salt."""
    if not image_digests:
        raise ValueError("a cross group holds at least one image")
    h = hashlib.sha256(_field(_CROSS) + _salt(cache_salt))
    h.update(struct.pack("<Q", len(image_digests)))
    for d in image_digests:
        h.update(_field(d))
    return h.digest()


@dataclass
class PageKeyChain:
    """The keys of one sequence's full self pages, extended as its pages fill (prompt pages at
    admission, output pages as decode fills them).

    ``image_digests`` are the prompt's images in order; ``prompt_len`` bounds where
    ``<|image|>`` tokens introduce images."""

    block_size: int
    prompt_len: int
    image_token_id: int
    image_digests: Sequence[bytes]
    cache_salt: str | None = None
    keys: list[bytes] = field(default_factory=list)
    _images_used: int = 0

    def update(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys for the pages that ``token_ids`` (the sequence so far, whose first pages are
        the ones already keyed) completes; returns the new ones."""
        b = self.block_size
        new: list[bytes] = []
        while (len(self.keys) + 1) * b <= len(token_ids):
            start = len(self.keys) * b
            page = token_ids[start : start + b]
            prompt_part = page[: max(0, self.prompt_len - start)]
            n = sum(1 for t in prompt_part if t == self.image_token_id)
            digests = self.image_digests[self._images_used : self._images_used + n]
            if len(digests) != n:
                raise ValueError(
                    f"the prompt has more <|image|> tokens than images ({len(self.image_digests)})"
                )
            self._images_used += n
            parent = self.keys[-1] if self.keys else chain_root(b, self.cache_salt)
            self.keys.append(page_key(parent, page, digests))
            new.append(self.keys[-1])
        return new

    def fork(self) -> PageKeyChain:
        """A copy for a sibling that shares this sequence's tokens so far."""
        return PageKeyChain(
            self.block_size,
            self.prompt_len,
            self.image_token_id,
            self.image_digests,
            self.cache_salt,
            list(self.keys),
            self._images_used,
        )


def page_keys(
    token_ids: Sequence[int],
    prompt_len: int,
    image_token_id: int,
    image_digests: Sequence[bytes],
    block_size: int,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The keys of every full page of ``token_ids`` (see :class:`PageKeyChain`)."""
    chain = PageKeyChain(block_size, prompt_len, image_token_id, image_digests, cache_salt)
    return chain.update(token_ids)


def chain_for(inputs: ProcessedInputs, block_size: int) -> PageKeyChain:
    """The page-key chain of a request's sequence (its prompt pages are keyed by the first
    ``update(prompt_token_ids)``)."""
    return PageKeyChain(
        block_size,
        len(inputs.prompt_token_ids),
        inputs.image_token_id,
        inputs.images.digests if inputs.images is not None else [],
        inputs.cache_salt,
    )


def cross_key_for(inputs: ProcessedInputs) -> bytes | None:
    """The key of a request's cross group (its last image group), None without images."""
    if inputs.last_group is None or inputs.images is None:
        return None
    first, end = inputs.last_group
    return cross_group_key(inputs.images.digests[first:end], inputs.cache_salt)


def max_cached_pages(prompt_len: int, block_size: int) -> int:
    """Pages a prompt may take from the cache: every full page before its last token, which
    is always computed (its logits sample the first output token)."""
    return (prompt_len - 1) // block_size


def images_seen(runs: Sequence[ImageRun], tok_start: int, tok_end: int) -> tuple[int, int]:
    """``[img_start, img_end)``: the images seen by tokens ``[tok_start, tok_end)`` (one
    contiguous run: from the group of the first token that sees any image to the last image
    any of them sees), ``(0, 0)`` when none sees an image."""
    lo, hi = None, 0
    for r in runs:
        if r.tok_end <= tok_start or r.tok_start >= tok_end:
            continue
        lo = r.img_start if lo is None else min(lo, r.img_start)
        hi = max(hi, r.img_end)
    return (0, 0) if lo is None else (lo, hi)
