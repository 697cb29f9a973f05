"""``max_tokens=0``: the request is scored, not continued. It ends when its prefill's results
arrive, with no output token, its prompt logprobs delivered and every page freed; requests
batched with it, or decoding while it is admitted, are not disturbed."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", max_model_len=512, max_num_seqs=8)


def _assert_scored(out, prompt_len: int) -> None:
    assert out.finished and len(out.prompt_token_ids) == prompt_len
    for c in out.outputs:
        assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == prompt_len
    assert out.prompt_logprobs[0] is None
    for tok, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in step and all(lp.logprob <= 0.0 for lp in step.values())


def test_alone(llm: LLM) -> None:
    (out,) = llm.generate("Score this prompt", SCORE, use_tqdm=False)
    tok = llm.get_tokenizer()
    _assert_scored(out, len(tok("Score this prompt")["input_ids"]))
    assert out.metrics is not None and out.metrics.first_token_time is not None
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_usage() == 0.0


def test_batched_with_generation(llm: LLM) -> None:
    (alone,) = llm.generate("Keep generating", GREEDY, use_tqdm=False)
    scored, generated = llm.generate(
        ["Score me", "Keep generating"], [SCORE, GREEDY], use_tqdm=False
    )
    _assert_scored(scored, len(scored.prompt_token_ids))
    assert generated.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(generated.outputs[0].token_ids) == 6
    assert llm.llm_engine.kv_cache_usage() == 0.0


def test_n_siblings(llm: LLM) -> None:
    params = SamplingParams(max_tokens=0, n=3, temperature=1.0, prompt_logprobs=0)
    (out,) = llm.generate("Three siblings", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    _assert_scored(out, len(out.prompt_token_ids))
    assert llm.llm_engine.kv_cache_usage() == 0.0


def test_admitted_while_another_decodes(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "long", "A long generation", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    for _ in range(4):
        engine.step()
    engine.add_request("score", "Scored in between", SCORE)
    finished = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"long", "score"}
    _assert_scored(finished["score"], len(finished["score"].prompt_token_ids))
    assert len(finished["long"].outputs[0].token_ids) == 30
    engine.check_integrity()
    assert engine.kv_cache_usage() == 0.0


def test_negative_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        SamplingParams(max_tokens=-1)
