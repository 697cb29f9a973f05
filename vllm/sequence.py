"""Per-token log-probability records, shaped as vLLM's (``RequestOutput`` carries them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log-probability of one token, its rank (1 = most likely) and its text.

    ``decoded_token`` is the token decoded on its own (``tokenizer.decode([id])``), or ``None``
    when the request has ``detokenize=False``.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-k alternatives, keyed by token id.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts the first prompt token).
PromptLogprobs = list[dict[int, Logprob] | None]
