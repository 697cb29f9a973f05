"""The on-device sampler: logits [num_rows, vocab] -> one token per row, plus logprobs.

The host describes each row once per step (``SamplingRow``); ``SamplingMetadata.build`` turns
the batch into device tensors and host flags, and ``Sampler.forward`` uses only those: it never
synchronises with the host, so sampling overlaps the next step's scheduling.

Order of operations (vLLM's): the grammar's token bitmask (structured output: disallowed
tokens to ``-inf``), allowed_token_ids / logit_bias, min_tokens suppression,
repetition / frequency / presence penalties, then temperature, top-k, top-p, min-p, draw.
Greedy rows take ``argmax`` of the penalised logits (lowest index on ties).

Logprobs are ``log_softmax`` of the logits **after** the grammar mask, logit_bias /
allowed_token_ids / min_tokens and penalties but **before** temperature, top-k, top-p and
min-p (the model's distribution as steered by the request, not the truncated sampling
distribution; under a constraint, the masked distribution, as upstream). Without penalties or logit
edits they are the raw ``log_softmax`` of the model's logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm.model_executor.guided_decoding.matcher import apply_token_bitmask
from vllm.model_executor.layers import sampling_utils as ops
from vllm.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingRow:
    """Host description of one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None  # per-request, on the logits' device; None if unseeded
    min_tokens_stop_ids: Sequence[int] = ()  # suppressed while len(output) < min_tokens


@dataclass
class SamplingMetadata:
    """One step's sampling inputs: device tensors ([num_rows] unless noted) and host flags.

    Built by ``build``; a tensor is ``None`` when no row needs that operation, which is how
    ``Sampler.forward`` skips work without looking at tensor values.
    """

    rows: list[SamplingRow]
    vocab_size: int = 0
    all_greedy: bool = False
    all_random: bool = False
    seeded_rows: list[tuple[int, torch.Generator]] = field(default_factory=list)
    max_num_logprobs: int | None = None  # largest ``logprobs`` in the batch; None: no logprobs
    greedy_mask: torch.Tensor | None = None  # bool, only for a mixed greedy/random batch
    temperature: torch.Tensor | None = None  # float32 (1.0 on greedy rows)
    top_k: torch.Tensor | None = None  # int64; no limit = vocab_size (or > max_top_k)
    max_top_k: int = 0  # largest top_k in use (host), for the topk-only path
    top_p: torch.Tensor | None = None  # float32; no limit = inf
    min_p: torch.Tensor | None = None  # float32
    repetition_penalty: torch.Tensor | None = None  # float32
    seen_mask: torch.Tensor | None = None  # [N, V] bool: token in prompt or output
    frequency_penalty: torch.Tensor | None = None  # float32
    presence_penalty: torch.Tensor | None = None  # float32
    output_counts: torch.Tensor | None = None  # [N, V] float32: occurrences in the output
    bias_index: torch.Tensor | None = None  # [B] int64 flat indices row * V + token
    bias_values: torch.Tensor | None = None  # [B] float32
    allowed_rows: torch.Tensor | None = None  # [R] int64 rows with allowed_token_ids
    disallowed_mask: torch.Tensor | None = None  # [R, V] bool: True = not allowed
    min_tokens_index: torch.Tensor | None = None  # [M] int64 flat indices to set to -inf
    # [N, ceil(V / 32)] int32 grammar masks (all ones for rows without a constraint); set by
    # the runner per step (``guided_decoding.matcher.TokenBitmask``), None: no constraint.
    token_bitmask: torch.Tensor | None = None

    @property
    def any_penalties(self) -> bool:
        return self.repetition_penalty is not None or self.frequency_penalty is not None

    @property
    def any_logit_edits(self) -> bool:
        return (
            self.any_penalties
            or self.bias_index is not None
            or self.allowed_rows is not None
            or self.min_tokens_index is not None
            or self.token_bitmask is not None
        )

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        """Builds the step's tensors on ``device`` (host-to-device copies only, no syncs)."""
        device = torch.device(device)
        params = [r.params for r in rows]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        md = cls(rows=rows, vocab_size=vocab_size)
        md.all_greedy = all(greedy)
        md.all_random = not any(greedy)
        md.seeded_rows = [
            (i, r.generator)
            for i, r in enumerate(rows)
            if r.generator is not None and not greedy[i]
        ]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(requested) if requested else None
        if not md.all_greedy:
            md._build_random(params, greedy, device)
        md._build_penalties(rows, device)
        md._build_logit_edits(rows, device)
        return md

    def _build_random(
        self, params: list[SamplingParams], greedy: list[bool], device: torch.device
    ) -> None:
        vocab = self.vocab_size
        if not self.all_random:
            self.greedy_mask = ops.host_to_device(greedy, torch.bool, device)
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        if any(t != 1.0 for t in temps):
            self.temperature = ops.host_to_device(temps, torch.float32, device)
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            self.top_k = ops.host_to_device(top_ks, torch.int64, device)
            self.max_top_k = max(k for k in top_ks if k < vocab)
        if any(p.top_p < 1.0 for p in params):
            top_ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
            self.top_p = ops.host_to_device(top_ps, torch.float32, device)
        if any(p.min_p > 0.0 for p in params):
            self.min_p = ops.host_to_device([p.min_p for p in params], torch.float32, device)

    def _build_penalties(self, rows: list[SamplingRow], device: torch.device) -> None:
        params = [r.params for r in rows]
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalty = ops.host_to_device(
                [p.repetition_penalty for p in params], torch.float32, device
            )
            seen = [(r.prompt_token_ids, r.output_token_ids) for r in rows]
            self.seen_mask = ops.token_histogram(seen, self.vocab_size, device) > 0
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            self.frequency_penalty = ops.host_to_device(
                [p.frequency_penalty for p in params], torch.float32, device
            )
            self.presence_penalty = ops.host_to_device(
                [p.presence_penalty for p in params], torch.float32, device
            )
            outputs = [(r.output_token_ids,) for r in rows]
            self.output_counts = ops.token_histogram(outputs, self.vocab_size, device)

    def _build_logit_edits(self, rows: list[SamplingRow], device: torch.device) -> None:
        vocab = self.vocab_size
        bias_index: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        allowed_ids: list[list[int]] = []
        min_tokens_index: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            for token_id, bias in (p.logit_bias or {}).items():
                _check_in_vocab("logit_bias", token_id, vocab)
                bias_index.append(i * vocab + token_id)
                bias_values.append(float(bias))
            if p.allowed_token_ids is not None:
                for token_id in p.allowed_token_ids:
                    _check_in_vocab("allowed_token_ids", token_id, vocab)
                allowed_rows.append(i)
                allowed_ids.append(list(p.allowed_token_ids))
            if len(row.output_token_ids) < p.min_tokens:
                # Ids outside the vocabulary can never be sampled: nothing to suppress.
                min_tokens_index += [i * vocab + t for t in row.min_tokens_stop_ids if t < vocab]
        if bias_index:
            self.bias_index = ops.host_to_device(bias_index, torch.int64, device)
            self.bias_values = ops.host_to_device(bias_values, torch.float32, device)
        if allowed_rows:
            self.allowed_rows = ops.host_to_device(allowed_rows, torch.int64, device)
            # Pad with each row's first id: scattering it twice is harmless.
            ids = ops.host_to_device(ops.pad_rows(allowed_ids, -1), torch.int64, device)
            ids = torch.where(ids < 0, ids[:, :1], ids)
            mask = torch.ones(len(allowed_rows), vocab, dtype=torch.bool, device=device)
            self.disallowed_mask = mask.scatter_(1, ids, False)
        if min_tokens_index:
            self.min_tokens_index = ops.host_to_device(min_tokens_index, torch.int64, device)


def _check_in_vocab(name: str, token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(
            f"{name} contains token id {token_id}, outside the vocabulary of size {vocab_size}."
        )


@dataclass
class SamplerOutput:
    """One step's samples; every tensor is on the logits' device (copy to host asynchronously)."""

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor | None = None  # [num_rows, 1 + k] float32: sampled token, then top-k
    logprob_token_ids: torch.Tensor | None = None  # [num_rows, 1 + k] int64
    sampled_ranks: torch.Tensor | None = None  # [num_rows] int64, 1 = most likely


class Sampler(nn.Module):
    """Turns a step's logits into tokens (see the module docstring for the exact semantics).

    ``argmax``: the row argmax (``sampling_utils.select_row_argmax``); torch's by default."""

    def __init__(self, argmax: Callable[..., torch.Tensor] = ops.row_argmax) -> None:
        super().__init__()
        self.argmax = argmax

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
        """``greedy_ids``: the row argmax of these logits if already computed (the decode
        graphs do it); used only when no logit edit applies."""
        assert logits.dim() == 2 and logits.shape[0] == len(metadata.rows), logits.shape
        assert logits.shape[1] == metadata.vocab_size, (logits.shape, metadata.vocab_size)
        if logits.dtype != torch.float32:
            logits = logits.to(torch.float32)
        if metadata.any_logit_edits:
            logits = self._edit_logits(logits, metadata)

        if metadata.all_random:
            greedy_ids = None
        elif greedy_ids is None or metadata.any_logit_edits:
            greedy_ids = self.argmax(logits)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)
        if metadata.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            sampled = self._sample_random(logits, metadata)
            if greedy_ids is not None:
                assert metadata.greedy_mask is not None
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)

        if logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        assert metadata.max_num_logprobs is not None
        values, ids, ranks = ops.gather_logprobs(logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, values, ids, ranks)

    @staticmethod
    def _edit_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The grammar mask, allowed_token_ids, logit_bias, min_tokens, penalties; returns a
        new tensor."""
        logits = logits.clone(memory_format=torch.contiguous_format)
        flat = logits.view(-1)
        if md.token_bitmask is not None:
            apply_token_bitmask(logits, md.token_bitmask)
        if md.allowed_rows is not None and md.disallowed_mask is not None:
            masked = logits.index_select(0, md.allowed_rows).masked_fill_(
                md.disallowed_mask, float("-inf")
            )
            logits.index_copy_(0, md.allowed_rows, masked)
        if md.bias_index is not None and md.bias_values is not None:
            flat.index_add_(0, md.bias_index, md.bias_values)
        if md.min_tokens_index is not None:
            flat.index_fill_(0, md.min_tokens_index, float("-inf"))
        if md.any_penalties:
            logits = ops.apply_penalties(
                logits,
                md.repetition_penalty,
                md.seen_mask,
                md.frequency_penalty,
                md.presence_penalty,
                md.output_counts,
            )
        return logits

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.temperature is not None:
            logits = logits / md.temperature[:, None]
        if md.top_p is not None or (md.top_k is not None and md.max_top_k * 8 > md.vocab_size):
            logits = ops.apply_top_k_top_p(logits, md.top_k, md.top_p)
        elif md.top_k is not None:
            logits = ops.apply_top_k_only(logits, md.top_k, md.max_top_k)
        if md.min_p is not None:
            logits = ops.apply_min_p(logits, md.min_p)
        return ops.random_sample(logits.softmax(dim=-1), md.seeded_rows)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt logprobs: row t of ``logits`` [T, V] predicts ``target_ids[t]`` [T].

    Returns logprobs [T, 1 + num_top] (float32: the target's, then the top ``num_top``),
    their ids [T, 1 + num_top] (int64) and the targets' ranks [T] (int64). The raw
    ``log_softmax`` of the model's logits: no penalties or filters apply to the prompt.
    """
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    return ops.gather_logprobs(logprobs, target_ids, num_top)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator on ``device``, seeded with its ``SamplingParams.seed``."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator
