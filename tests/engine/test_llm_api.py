"""``vllm.LLM``'s offline interface: prompt forms, output fields, sampling semantics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from vllm import LLM, CompletionOutput, RequestOutput, SamplingParams
from vllm.sequence import Logprob


def _image(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", max_model_len=512, max_num_seqs=8,
               limit_mm_per_prompt={"image": 2})


def test_prompt_forms_agree(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tok(text)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], params,
                        use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[0].prompt == text and outs[2].prompt is None
    img_ids = tok("<|image|><|begin_of_text|>A photo of")["input_ids"]
    a = llm.generate({"prompt": "<|image|><|begin_of_text|>A photo of",
                      "multi_modal_data": {"image": _image()}}, params, use_tqdm=False)
    b = llm.generate({"prompt_token_ids": img_ids, "multi_modal_data": {"image": [_image()]}},
                     params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_request_output_fields(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    (out,) = llm.generate("Hello world", params, use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished
    (c,) = out.outputs
    assert isinstance(c, CompletionOutput)
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
    assert c.stop_reason is None
    assert len(c.logprobs) == 5
    total = 0.0
    for tok, step in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in step and all(isinstance(v, Logprob) for v in step.values())
        assert 3 <= len(step) <= 4
        assert step[tok].rank >= 1 and step[tok].decoded_token is not None
        ranked = sorted((v for k, v in step.items() if k != tok or v.rank <= 3),
                        key=lambda v: -v.logprob)
        assert ranked[0].logprob <= 0.0
        total += step[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in step and len(step) <= 3
    assert out.metrics is not None and out.metrics.first_token_time is not None


def test_greedy_logprob_rank_is_one(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    (out,) = llm.generate("Ranks of greedy tokens", params, use_tqdm=False)
    for tok, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        assert step[tok].rank == 1


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate("Stop test prompt", base, use_tqdm=False)
    text = full.outputs[0].text
    ids = full.outputs[0].token_ids
    # A stop string spanning several tokens (the tiny tokenizer is byte-level).
    stop = text[5:8]
    assume_unique = text.find(stop)
    (out,) = llm.generate("Stop test prompt", SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)
    assert out.outputs[0].text == text[:assume_unique]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    (inc,) = llm.generate("Stop test prompt", SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True), use_tqdm=False)
    assert inc.outputs[0].text == text[:assume_unique + len(stop)]
    (tok,) = llm.generate("Stop test prompt", SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[3]]),
        use_tqdm=False)
    first = ids.index(ids[3])
    assert tok.outputs[0].token_ids == ids[:first + 1]
    assert tok.outputs[0].stop_reason == ids[3]


def test_min_tokens_and_eos(llm: LLM) -> None:
    eos = llm.llm_engine.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = llm.generate([f"Prompt {i} for eos" for i in range(6)], params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop" and c.stop_reason is None:
            assert c.token_ids[-1] in eos
    forced = SamplingParams(temperature=0, max_tokens=40, min_tokens=30)
    for o in llm.generate([f"Prompt {i} for eos" for i in range(6)], forced, use_tqdm=False):
        toks = o.outputs[0].token_ids
        assert len(toks) >= 30
        assert not set(toks[:29]) & set(eos)


def test_seeded_sampling_distribution(llm: LLM) -> None:
    """Different seeds give different samples; the same seed the same; temperature scales."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True)
              for s in range(8)]
    a = llm.generate(["Sample me"] * 8, params, use_tqdm=False)
    b = llm.generate(["Sample me"] * 8, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert len({tuple(o.outputs[0].token_ids) for o in a}) > 4
    cold = [SamplingParams(temperature=0.01, seed=s, max_tokens=6, ignore_eos=True)
            for s in range(4)]
    greedy = llm.generate("Sample me", SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)
    for o in llm.generate(["Sample me"] * 4, cold, use_tqdm=False):
        assert o.outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_top_k_one_is_greedy_and_penalties_change_output(llm: LLM) -> None:
    g = llm.generate("Penalty test", SamplingParams(temperature=0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
    k1 = llm.generate("Penalty test", SamplingParams(temperature=1.0, top_k=1, seed=3,
                                                     max_tokens=16, ignore_eos=True),
                      use_tqdm=False)
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids
    rep = llm.generate("Penalty test", SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True, frequency_penalty=2.0),
                       use_tqdm=False)
    toks = rep[0].outputs[0].token_ids
    assert len(set(toks)) >= len(set(g[0].outputs[0].token_ids))


def test_n_and_order_and_errors(llm: LLM) -> None:
    outs = llm.generate(["a", "bb", "ccc"], [SamplingParams(max_tokens=i + 1, ignore_eos=True)
                                            for i in range(3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("x", SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 99999]}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()


def test_default_params_use_generation_config(llm: LLM) -> None:
    p = llm.get_default_sampling_params()
    assert p.temperature == pytest.approx(0.6) and p.top_p == pytest.approx(0.9)


def test_prompt_logprobs_with_an_image_token(llm: LLM) -> None:
    """The image token is outside the vocabulary: its position has no logprob."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    (out,) = llm.generate({"prompt": "Look <|image|> here",
                           "multi_modal_data": {"image": _image(3)}}, params, use_tqdm=False)
    image_id = llm.llm_engine.config.model_config.spec.image_token_id
    pos = out.prompt_token_ids.index(image_id)
    assert out.prompt_logprobs[pos] is None
    assert out.prompt_logprobs[pos + 1] is not None


def test_token_options_outside_the_vocabulary_are_rejected(llm: LLM) -> None:
    for bad in (SamplingParams(allowed_token_ids=[5, 600]), SamplingParams(logit_bias={600: 1.0}),
                SamplingParams(stop_token_ids=[9999])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate("x", bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
