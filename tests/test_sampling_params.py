"""SamplingParams: vLLM defaults, validation errors that name the parameter, normalisation."""

from __future__ import annotations

import copy
import math

import pytest

from vllm.sampling_params import (
    MAX_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)

VLLM_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "truncate_prompt_tokens": None,
    "output_kind": RequestOutputKind.CUMULATIVE,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
}


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    for name, expected in VLLM_DEFAULTS.items():
        assert getattr(params, name) == expected, name
    assert params.sampling_type == SamplingType.RANDOM
    assert params.all_stop_token_ids == frozenset()
    assert MAX_LOGPROBS == 20
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


# (kwargs, parameter named in the message)
INVALID = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": 2.0, "temperature": 0.0}, "min_p"),  # checked even where greedy ignores it
    ({"top_p": 0.0, "temperature": 0.0}, "top_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": "x", "detokenize": False}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"bad_words": ["foo"]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"output_kind": 7}, "output_kind"),
    ({"temperature": 0.0, "n": 2}, "n"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_values_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(name) or f" {name}" in message, message
    bad = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if isinstance(bad, (int, float)) and not isinstance(bad, bool):
        assert str(bad) in message or repr(bad) in message, message


def test_temperature_message_is_exact() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be non-negative, got -1.0.$"):
        SamplingParams(temperature=-1.0)


def test_normalisation() -> None:
    params = SamplingParams(
        top_k=-1, seed=-1, stop="###", stop_token_ids=(5, 6), logprobs=True, output_kind=1
    )
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 6]
    assert params.logprobs == 1
    assert params.output_kind is RequestOutputKind.DELTA
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2}
    assert SamplingParams(best_of=1).best_of == 1
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


def test_greedy_resets_filters() -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert params.sampling_type == SamplingType.GREEDY
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-4).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type == SamplingType.GREEDY


def test_generation_config_fills_only_unset_fields() -> None:
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 40,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
        "eos_token_id": [128001, 128008, 128009],
    }
    params = SamplingParams(temperature=1.0, top_k=5)
    params.update_from_generation_config(config, eos_token_ids=128009)
    assert params.temperature == 1.0  # explicitly passed, even though it equals the default
    assert params.top_k == 5
    assert params.top_p == 0.9
    assert params.repetition_penalty == 1.1
    assert params.max_tokens == 64
    # Config EOS ids other than the tokenizer's are stop tokens (reported as stop_reason).
    assert params.stop_token_ids == [128001, 128008]
    assert params.eos_token_ids == {128001, 128008, 128009}
    assert params.all_stop_token_ids == {128001, 128008, 128009}
    params.update_from_generation_config(config, eos_token_ids=128009)  # idempotent
    assert params.stop_token_ids == [128001, 128008]

    positional = SamplingParams(1, None, 0.0, 0.0, 1.0, 0.7)
    positional.update_from_generation_config(config)
    assert positional.temperature == 0.7


def test_generation_config_keeps_greedy_neutral_and_ignore_eos() -> None:
    params = SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[7])
    params.update_from_generation_config({"top_p": 0.5, "eos_token_id": 2}, eos_token_ids=[1])
    assert params.top_p == 1.0  # still greedy: filters stay neutral
    assert params.stop_token_ids == [7]  # ignore_eos: config EOS is not a stop token
    assert params.all_stop_token_ids == {1, 2, 7}


def test_generation_config_revalidates() -> None:
    params = SamplingParams(min_tokens=10)
    with pytest.raises(ValueError, match="min_tokens"):
        params.update_from_generation_config({"max_new_tokens": 5})


def test_clone_and_repr() -> None:
    params = SamplingParams(temperature=0.5, stop=["a"], logit_bias={1: 1.0})
    params.update_from_generation_config({}, eos_token_ids=9)
    clone = params.clone()
    assert clone == params and clone is not params
    clone.stop.append("b")
    assert params.stop == ["a"]
    assert clone.all_stop_token_ids == {9}
    assert clone.explicit_fields == params.explicit_fields
    assert copy.copy(params) == params
    text = repr(params)
    assert text.startswith("SamplingParams(") and "temperature=0.5" in text and "stop=['a']" in text


# Finite in Python, not in float32 (the sampler's precision): NaN logits or token 0 repeated.
FLOAT32_GARBAGE = [
    ({"logit_bias": {5: 1e300}}, "logit_bias must be 0 or between"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty must be 0 or between"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty must be 0 or between"),
    ({"repetition_penalty": 1e-31}, r"repetition_penalty must be in \[1e-30, 1e\+30\]"),
    ({"top_p": 1e-300}, "top_p must be 0 or between"),
    ({"temperature": 1e300}, "temperature must be 0 or between"),
    ({"min_p": 1e-300}, "min_p must be 0 or between"),
]


@pytest.mark.parametrize("kwargs,match", FLOAT32_GARBAGE, ids=[str(k) for k, _ in FLOAT32_GARBAGE])
def test_values_outside_float32_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_float32_edges_that_work_are_kept() -> None:
    assert SamplingParams(temperature=1e-300).sampling_type == SamplingType.GREEDY
    assert SamplingParams(logit_bias={5: -3e38}).logit_bias == {5: -3e38}
    assert SamplingParams(repetition_penalty=1e-30).repetition_penalty == 1e-30


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a list of token ids, got 3"),
        ({"allowed_token_ids": 3}, "allowed_token_ids must be a list of token ids"),
        ({"bad_words": 7}, "bad_words must be a list of strings"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop has 65 strings; at most 64"),
        ({"stop": ["x" * 3000, "y" * 3000]}, "6000 characters in total; at most 4096"),
        ({"n": 1025, "temperature": 1.0}, "n must be at most 1024"),
        ({"n": 2000, "best_of": 2000}, "n must be at most 1024"),
    ],
)
def test_clear_messages_and_bounds_for_lists_and_counts(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
