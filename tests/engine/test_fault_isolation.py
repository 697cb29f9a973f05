"""A failure caused by one request fails that request alone; the engine and the rest go on."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.model_executor.layers import sampler as sampler_mod
from vllm.transformers_utils import detokenizer as detok_mod

MARK = 31337  # a seed that the injected faults recognise


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8)


def _params(marked: bool = False, penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0 if not marked else 0.5, seed=MARK if marked else None,
                          max_tokens=10, ignore_eos=True, repetition_penalty=penalty)


PROMPTS = ["First prompt here", "Second, the faulty one", "Third prompt here"]


@pytest.mark.parametrize("fail_after", [0, 3], ids=["in_prefill", "in_decode"])
def test_sampling_failure_fails_one_request(llm: LLM, monkeypatch, fail_after: int) -> None:
    reference = llm.generate(PROMPTS, _params(), use_tqdm=False)
    original = sampler_mod.SamplingMetadata.build.__func__

    def build(cls, rows, vocab_size, device):
        for r in rows:
            if r.params.seed == MARK and len(r.output_token_ids) >= fail_after:
                raise ValueError("injected sampling failure")
        return original(cls, rows, vocab_size, device)

    monkeypatch.setattr(sampler_mod.SamplingMetadata, "build", classmethod(build))
    # Sampling inputs that depend on the outputs (here a penalty) are rebuilt every step, so
    # that is where a failure can start mid-decode; others are built once per batch.
    marked = _params(marked=True, penalty=1.2 if fail_after else 1.0)
    outs = llm.generate(PROMPTS, [_params(), marked, _params()], use_tqdm=False)
    assert isinstance(outs[1].error, ValueError) and outs[1].finished
    for i in (0, 2):
        assert outs[i].error is None
        assert outs[i].outputs[0].token_ids == reference[i].outputs[0].token_ids
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.pool.usage() == 0.0


def test_output_processing_failure_fails_one_request(llm: LLM, monkeypatch) -> None:
    original = detok_mod.IncrementalDetokenizer.add_tokens
    bad_prompt_ids = set(llm.get_tokenizer()(PROMPTS[1])["input_ids"])

    def add_tokens(self, new_ids, check_stop=True):
        if getattr(self, "_poisoned", None) is None:
            self._poisoned = False
        if self._poisoned:
            raise UnicodeError("injected detokenizer failure")
        return original(self, new_ids, check_stop)

    created = detok_mod.IncrementalDetokenizer.__init__

    def init(self, tokenizer, prompt_token_ids, *args, **kwargs):
        created(self, tokenizer, prompt_token_ids, *args, **kwargs)
        self._poisoned = set(prompt_token_ids) == bad_prompt_ids

    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "add_tokens", add_tokens)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert isinstance(outs[1].error, UnicodeError)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 10
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == 10
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.block_manager.pool.usage() == 0.0


def test_unattributable_failure_is_an_engine_failure(llm: LLM, monkeypatch) -> None:
    engine = llm.llm_engine

    def broken(out):
        raise RuntimeError("device lost")

    engine.add_request("x", "hello", _params())
    monkeypatch.setattr(engine.runner, "launch", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("x")
    engine.check_integrity()
