"""``SamplingParams``: vLLM's per-request sampling options, names and defaults.

Validation happens once, in ``__post_init__``, with ``ValueError``s that name the parameter and
the bad value. Options this engine does not implement (``best_of != n``, ``bad_words``) are
rejected with a message that says so, instead of being silently ignored.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from numbers import Integral, Real
from typing import Any

from vllm.guided_params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "SamplingType"]

# Temperatures below this are greedy decoding (vLLM's ``_SAMPLING_EPS``).
_SAMPLING_EPS = 1e-5
# Largest ``logprobs`` / ``prompt_logprobs`` the engine serves (checked by the engine, which may
# be configured with another cap; SamplingParams itself only checks for negatives).
MAX_LOGPROBS = 20
# Stop strings are matched against the new text after every token, so their number and size
# bound per-token work: at most this many, of at most this many characters in all.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
# Each of the n sequences is a sequence the scheduler runs and the response carries.
MAX_N = 1024
# The sampler computes in float32: a value that is finite in Python may not be there (1e300
# becomes inf, 1e-300 becomes 0), and the logits then turn into NaN or a constant token.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
# Logits are divided (or multiplied) by the repetition penalty: beyond this range a logit of
# a few units overflows float32.
REPETITION_PENALTY_RANGE = (1e-30, 1e30)

# HF ``generation_config.json`` keys applied as defaults, and the SamplingParams field each sets.
_GENERATION_CONFIG_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class SamplingType(IntEnum):
    """How a request draws its tokens."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    """What each ``RequestOutput`` of a streamed request carries."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


def _track_explicit_fields(cls: type) -> type:
    """Wraps the dataclass ``__init__`` to record which fields the caller passed.

    Generation-config defaults then apply only to the others (an explicit ``temperature=1.0``
    wins over the checkpoint's 0.6, as in vLLM's OpenAI server).
    """
    init = cls.__init__
    names = tuple(f.name for f in fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._explicit_fields = frozenset(names[: len(args)]) | frozenset(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def _check_float(name: str, value: Any, float32: bool = True) -> float:
    """A number; with ``float32``, one that float32 holds as a finite value and does not
    round to zero (the sampler's precision: see ``FLOAT32_MAX``)."""
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    if float32 and math.isfinite(value) and (
        abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_MIN_NORMAL
    ):
        raise ValueError(
            f"{name} must be 0 or between {FLOAT32_MIN_NORMAL:.4g} and {FLOAT32_MAX:.4g} in "
            f"magnitude (the sampler computes in float32), got {value!r}."
        )
    return value


@_track_explicit_fields
@dataclass
class SamplingParams:
    """Sampling options of one request (vLLM's ``SamplingParams``; the same names and defaults).

    ``temperature`` below 1e-5 means greedy decoding; ``top_k`` 0 or -1 means no top-k filter;
    ``max_tokens=None`` lets the engine generate up to the model's context length;
    ``max_tokens=0`` generates nothing (the request ends after its prefill, with its prompt
    logprobs when asked for: loglikelihood scoring).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        self._eos_token_ids: frozenset[int] = frozenset()
        self._normalise()
        self._verify()
        self._neutralise_greedy()

    # ------------------------------------------------------------------ normalisation
    def _normalise(self) -> None:
        """Canonical forms: lists for stop options, 0 for "no top-k"."""
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        self.stop = _as_list("stop", self.stop, "a string or a list of strings", str)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.bad_words = _as_list("bad_words", self.bad_words, "a list of strings", str)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list(
                "allowed_token_ids", self.allowed_token_ids, "a list of token ids"
            )
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}."
                ) from e
        # OpenAI-style booleans: ``logprobs=True`` asks for the sampled token only.
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError as e:
                raise ValueError(f"output_kind must be 0, 1 or 2, got {self.output_kind!r}.") from e

    def _neutralise_greedy(self) -> None:
        """Greedy: the filters cannot change an argmax, so make them neutral (as vLLM does,
        after checking them: an out-of-range filter is an error even when greedy)."""
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    # ------------------------------------------------------------------ validation
    def _verify(self) -> None:
        _check_int("n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of must equal n (best_of > n is not supported yet), "
                f"got best_of={self.best_of!r}, n={self.n}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _check_float(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= _check_float("repetition_penalty", self.repetition_penalty) <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (positive; logits are "
                f"divided by it in float32), got {self.repetition_penalty}."
            )
        # Below _SAMPLING_EPS decoding is greedy and the temperature is never used.
        greedy = isinstance(self.temperature, Real) and self.temperature < _SAMPLING_EPS
        if not math.isfinite(_check_float("temperature", self.temperature, not greedy)):
            raise ValueError(f"temperature must be finite, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < _check_float("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k!r}."
            )
        if not 0.0 <= _check_float("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if self.max_tokens is not None:
            # 0: nothing is generated; the prompt is scored (prompt_logprobs) and the request
            # ends after its prefill.
            _check_int("max_tokens", self.max_tokens, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        self._verify_token_options()
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_token_options(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed."
            )
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings have {sum(len(s) for s in self.stop)} characters in total; at "
                f"most {MAX_STOP_CHARS} are allowed."
            )
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings are only supported when detokenize is True, got stop={self.stop!r}."
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}."
            )
        if self.bad_words:
            raise ValueError(f"bad_words is not supported yet, got {self.bad_words!r}.")
        if self.guided_decoding is not None and not isinstance(
            self.guided_decoding, GuidedDecodingParams
        ):
            raise ValueError(
                "guided_decoding must be a GuidedDecodingParams, got "
                f"{type(self.guided_decoding).__name__}."
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(
                "allowed_token_ids must be a non-empty list of non-negative integers, "
                f"got {self.allowed_token_ids!r}."
            )
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0 or not math.isfinite(_check_float("logit_bias", bias)):
                    raise ValueError(
                        f"logit_bias must map non-negative token ids to finite numbers, "
                        f"got {token_id}: {bias!r}."
                    )

    # ------------------------------------------------------------------ engine-facing API
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """``stop_token_ids`` plus the model's EOS ids: suppressed while ``min_tokens`` is unmet."""
        return frozenset(self.stop_token_ids) | self._eos_token_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model EOS ids set by ``update_from_generation_config`` (stop unless ignore_eos)."""
        return self._eos_token_ids

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller passed to the constructor."""
        return self._explicit_fields

    def update_from_generation_config(
        self,
        generation_config: dict[str, Any],
        eos_token_ids: int | Iterable[int] | None = None,
    ) -> None:
        """Applies a checkpoint's ``generation_config.json`` and the model's EOS ids.

        Sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens -> max_tokens) fill only the fields the caller did not pass.
        ``eos_token_ids`` (the tokenizer's EOS) and the config's ``eos_token_id`` become stop
        conditions; as in vLLM, config EOS ids other than the tokenizer's are also appended to
        ``stop_token_ids`` (unless ``ignore_eos``), so hitting one reports it as ``stop_reason``.
        """
        for key, name in _GENERATION_CONFIG_DEFAULTS.items():
            value = generation_config.get(key)
            if value is not None and name not in self._explicit_fields:
                setattr(self, name, value)
        model_eos = _as_id_set(eos_token_ids)
        config_eos = _as_id_set(generation_config.get("eos_token_id")) - model_eos
        self._eos_token_ids = self._eos_token_ids | model_eos | config_eos
        if config_eos and not self.ignore_eos:
            assert self.stop_token_ids is not None
            known = set(self.stop_token_ids)
            self.stop_token_ids += sorted(config_eos - known)
        self._normalise()
        self._verify()
        self._neutralise_greedy()

    def clone(self) -> SamplingParams:
        """A deep copy (explicitly-set fields and EOS ids included)."""
        return copy.deepcopy(self)


def _as_list(name: str, value: Any, expected: str, scalar: type | None = None) -> list[Any]:
    """``None`` -> [], a lone ``scalar`` -> [value], any other iterable -> a list; else a
    ValueError naming the parameter (``stop=5`` is a mistake, not "int is not iterable")."""
    if value is None:
        return []
    if scalar is not None and isinstance(value, scalar):
        return [value]
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be {expected}, got {value!r}.")
    return list(value)


def _as_id_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if _is_int(ids):
        return frozenset((int(ids),))
    return frozenset(int(i) for i in ids)
