"""Tensor operations of the sampler: penalties, filters, the random draw, logprob gathering.

Every function here is device-agnostic and free of host synchronisation: no ``.item()``,
``nonzero``, boolean-mask indexing or Python branches on tensor values. Per-row parameters are
``[num_rows]`` tensors broadcast over the vocabulary; the caller decides on the host which
functions to call at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

_NEG_INF = float("-inf")
# Smallest positive float32: exponential draws of exactly 0 would turn masked tokens (p = 0)
# into 0 / 0 = NaN, which argmax would pick.
_TINY = torch.finfo(torch.float32).tiny


def host_to_device(
    data: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Copies a (nested) list or array to ``device``; asynchronously from pinned memory on CUDA."""
    if isinstance(data, np.ndarray):
        tensor = torch.from_numpy(data).to(dtype)
    else:
        tensor = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def pad_rows(rows: Sequence[Sequence[int]], pad: int) -> list[list[int]]:
    """Right-pads integer lists to one length (at least 1) with ``pad``."""
    width = max((len(r) for r in rows), default=0) or 1
    return [list(r) + [pad] * (width - len(r)) for r in rows]


def token_histogram(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] float32: occurrences of each token in each row's token lists.

    ``rows[i]`` is a few token lists (say prompt and output) counted together. Ids outside the
    vocabulary (the image token of a prompt, for one) cannot be sampled and are ignored.
    """
    lengths = np.array([sum(len(part) for part in parts) for parts in rows], dtype=np.int64)
    # One flat pass through numpy: 10x faster than building a nested tensor from lists.
    ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain.from_iterable(rows)),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    flat = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab_size, lengths) + ids
    flat = flat[(ids >= 0) & (ids < vocab_size)]
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    if flat.size:
        index = host_to_device(flat, torch.int64, device)
        counts.index_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(rows), vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    repetition_penalty: torch.Tensor | None,
    seen_mask: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    output_counts: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM/HF penalties; ``logits`` [N, V], penalties [N], masks/counts [N, V].

    Repetition (over prompt + output tokens, ``seen_mask``): positive logits are divided by the
    penalty, negative ones multiplied. Frequency and presence (over output tokens):
    ``logits -= frequency * count + presence * (count > 0)``.
    """
    if repetition_penalty is not None and seen_mask is not None:
        rep = repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_mask, penalised, logits)
    if frequency_penalty is not None and presence_penalty is not None and output_counts is not None:
        logits = (
            logits
            - frequency_penalty[:, None] * output_counts
            - presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)
        )
    return logits


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keeps each row's ``top_k`` largest logits (ties at the k-th value are all kept).

    ``top_k`` [N] int64 with rows that have no limit set to a value above ``max_k``, the
    largest limit in the batch (a host integer): one ``topk(max_k)`` instead of a full sort.
    """
    values = logits.topk(max_k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > max_k, _NEG_INF, kth)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p over one descending sort of each row.

    ``top_k`` [N] int64 (``V`` for no limit); ``top_p`` [N] float32 (``inf`` for no limit).
    Top-p keeps the smallest prefix of the sorted (top-k-renormalised) distribution whose mass
    reaches ``p``: a token stays when the mass strictly before it is below ``p``.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below ``min_p`` times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def random_sample(
    probs: torch.Tensor, seeded_rows: Sequence[tuple[int, torch.Generator]]
) -> torch.Tensor:
    """Exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` picks token i w.p. ``p_i``.

    The whole batch draws ``q`` at once from the device's default generator; then each seeded
    row redraws its own row from its generator, so a seeded row's token depends only on its
    probabilities and its generator, never on the rest of the batch. ``probs`` need not be
    normalised (the race is invariant to scaling a row).
    """
    q = torch.empty_like(probs).exponential_()
    for row, generator in seeded_rows:
        q[row].exponential_(generator=generator)
    return (probs / q.clamp_min_(_TINY)).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob of ``token_ids`` followed by the ``num_top`` largest logprobs of each row.

    ``logprobs`` [N, V] float32, ``token_ids`` [N] int64. Returns logprobs [N, 1 + num_top]
    (float32), their ids [N, 1 + num_top] (int64, top ids in descending logprob order) and the
    rank of ``token_ids`` [N] (int64; 1 + the number of strictly more likely tokens).
    """
    token_ids = token_ids.to(torch.int64)[:, None]
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        chosen = torch.cat([chosen, top_values], dim=1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
    return chosen, token_ids, ranks


def row_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax`` over the last dim of a 2-D tensor (optionally into ``out``) in torch;
    ``triton_argmax.argmax_rows`` gives the same answer in fewer launches."""
    if out is None:
        return logits.argmax(dim=-1)
    return torch.argmax(logits, dim=-1, out=out)


def select_row_argmax(fused: bool) -> Callable[..., torch.Tensor]:
    """The row argmax to use: the Triton reduction with fused kernels, else torch's (chosen
    once, when the runner is built)."""
    if not fused:
        return row_argmax
    from vllm.model_executor.layers.triton_argmax import argmax_rows

    return argmax_rows
