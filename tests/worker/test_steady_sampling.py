"""Decode sampling inputs are built once per steady batch when they cannot change between
steps, and reusing them changes no output."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.model_executor.layers import sampler as sampler_mod
from vllm.worker import model_runner as runner_mod

PROMPTS = ["one two three", "four five", "six seven eight nine"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8)


def _generate(llm: LLM, params: list[SamplingParams], monkeypatch,
              reuse: bool) -> tuple[list, int]:
    builds = []
    original = sampler_mod.SamplingMetadata.build.__func__

    def build(cls, rows, vocab_size, device):
        builds.append(len(rows))
        return original(cls, rows, vocab_size, device)

    with monkeypatch.context() as m:
        m.setattr(sampler_mod.SamplingMetadata, "build", classmethod(build))
        if not reuse:
            m.setattr(runner_mod, "_step_invariant", lambda seq: False)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return outs, len(builds)


def _tokens(outs) -> list:
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


def test_reused_inputs_give_the_same_outputs(llm: LLM, monkeypatch) -> None:
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12,
                             ignore_eos=True, n=2),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6,
                             ignore_eos=True, min_tokens=4)]
    reused, n_reused = _generate(llm, params, monkeypatch, reuse=True)
    rebuilt, n_rebuilt = _generate(llm, params, monkeypatch, reuse=False)
    assert _tokens(reused) == _tokens(rebuilt)
    # Rebuilt: once per step. Reused: once per batch change and per step still under
    # min_tokens; the last ~6 steps (after the third request's end) need one build.
    assert n_rebuilt >= 12 and n_reused <= n_rebuilt - 4, (n_reused, n_rebuilt)


def test_output_dependent_inputs_are_rebuilt_every_step(llm: LLM, monkeypatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.3)
    _, builds = _generate(llm, [params] * 3, monkeypatch, reuse=True)
    _, builds_without_reuse = _generate(llm, [params] * 3, monkeypatch, reuse=False)
    assert builds == builds_without_reuse >= 11
