"""Structured output end to end on the random demo model, where only the constraint can make
the output valid: the suite batched with free rows (graph path and eager), logprobs of the
masked distribution, a grammar that completes while a step is in flight, ``n > 1``,
preemption and abort mid-grammar, and the errors of bad constraints."""

from __future__ import annotations

import math
import re

import pytest
import xgrammar as xgr
from helpers.compare import check_logprobs_close, vllm_greedy

from benchmarks.engine.guided_schemas import CASES, Case
from vllm import LLM, SamplingParams
from vllm.guided_params import GuidedDecodingError
from vllm.model_executor.guided_decoding.compiler import choice_grammar
from vllm.sampling_params import GuidedDecodingParams

PROMPT = "Answer in the format asked:"


def _llm(**kw) -> LLM:
    args = dict(model="demo/mllama-tiny", max_model_len=512, max_num_seqs=16)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def graphs() -> LLM:
    return _llm()


@pytest.fixture(scope="module")
def eager() -> LLM:
    return _llm(enforce_eager=True)


def _guided(case: Case, compact: bool) -> GuidedDecodingParams:
    return GuidedDecodingParams(**{case.kind: case.spec}, disable_any_whitespace=compact)


def _reference_matcher(llm: LLM, case: Case) -> xgr.GrammarMatcher:
    """A matcher compiled apart from the engine's compiler (xgrammar's stock vocabulary)."""
    engine = llm.llm_engine
    info = xgr.TokenizerInfo.from_huggingface(
        engine.tokenizer, vocab_size=512, stop_token_ids=engine.eos_token_ids
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    if case.kind == "json":
        return xgr.GrammarMatcher(compiler.compile_json_schema(case.spec))
    if case.kind == "regex":
        return xgr.GrammarMatcher(compiler.compile_regex(case.spec))
    return xgr.GrammarMatcher(compiler.compile_grammar(choice_grammar(case.spec)))


def _accepted_prefix(llm: LLM, case: Case, token_ids: list[int]) -> bool:
    matcher = _reference_matcher(llm, case)
    return all(matcher.accept_token(t) for t in token_ids)


@pytest.mark.parametrize("path", ["graphs", "eager"])
def test_suite_batched_with_free_rows(path: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(path)
    engine = llm.llm_engine
    engine.reset_counters()
    prompts, params, cases = [], [], []
    for seed in range(2):
        for case in CASES:
            guided = _guided(case, compact=seed == 0)
            params.append(
                SamplingParams(temperature=1.0, seed=seed, max_tokens=440, guided_decoding=guided)
            )
            prompts.append(PROMPT)
            cases.append(case)
    free = [SamplingParams(temperature=0, max_tokens=40, logprobs=5) for _ in range(2)]
    free_prompts = ["An unconstrained row", "Another free row"]
    outs = llm.generate(prompts + free_prompts, params + free, use_tqdm=False)
    stopped = 0
    for case, out in zip(cases, outs, strict=False):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            stopped += 1
            assert case.valid(c.text), (case.name, c.text)
        else:
            assert c.finish_reason == "length"
            assert _accepted_prefix(llm, case, c.token_ids), (case.name, c.text)
    assert stopped >= 0.8 * len(cases), stopped
    # The free rows sampled from the unmasked logits: as when they run alone.
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    check_logprobs_close(vllm_greedy(alone), vllm_greedy(outs[len(cases) :]), "alone", "mixed")
    stats = engine.runner.stats
    assert engine.runner.grammar_rows.masked_steps > 0
    if path == "graphs":
        assert stats.eager_decode_steps == 0 and sum(stats.graph_replays.values()) > 0
    else:
        assert not stats.graph_replays and stats.eager_decode_steps > 0
    engine.check_integrity()


def test_logprobs_are_of_the_masked_distribution(graphs: LLM) -> None:
    """The first token of a two-way choice against the same token restricted by
    allowed_token_ids (the sampler's other masking path); forced tokens have logprob 0."""
    choice = GuidedDecodingParams(choice=["abc", "bcd"])
    out = graphs.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3, guided_decoding=choice)
    )[0].outputs[0]
    ref = graphs.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=1, logprobs=3, allowed_token_ids=[97, 98]),
    )[0].outputs[0]
    assert out.text in ("abc", "bcd") and out.finish_reason == "stop"
    first, expected = out.logprobs[0], ref.logprobs[0]
    for token in (97, 98):
        assert first[token].logprob == pytest.approx(expected[token].logprob, abs=1e-5)
    eos = graphs.llm_engine.eos_token_ids  # three ids: the top 3 cover the last step
    for i, step in enumerate(out.logprobs[1:], 1):  # later tokens are forced, then EOS
        allowed = {out.token_ids[i]} if i < len(out.text) else set(eos)
        finite = {t for t, lp in step.items() if lp.logprob > float("-inf")}
        assert finite == allowed, (i, step)
        assert sum(math.exp(step[t].logprob) for t in allowed) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("extra", [{}, {"ignore_eos": True}, {"min_tokens": 6}])
def test_grammar_completing_in_flight_forces_eos(graphs: LLM, extra: dict) -> None:
    """A one-token grammar: the step after it is in flight when it completes; the grammar
    then allows only EOS, and nothing after the stop token reaches the output."""
    engine = graphs.llm_engine
    params = SamplingParams(
        temperature=1.0, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["x"]), **extra
    )
    outs = graphs.generate([PROMPT, "and a free one"], [params, SamplingParams(max_tokens=20)])
    c = outs[0].outputs[0]
    assert c.text == "x" and c.finish_reason == "stop"
    assert len(c.token_ids) == 2 and c.token_ids[1] in engine.eos_token_ids
    engine.check_integrity()


def test_length_output_is_an_accepted_prefix(graphs: LLM) -> None:
    case = Case("email", "regex", r"[a-z]{20,30}@[a-z]+\.com")
    out = graphs.generate(
        PROMPT, SamplingParams(max_tokens=7, guided_decoding=_guided(case, True))
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    assert _accepted_prefix(graphs, case, out.token_ids)


def test_n_sequences_have_a_matcher_each(graphs: LLM) -> None:
    case = next(c for c in CASES if c.name == "bounded_array")
    params = SamplingParams(
        n=4, temperature=1.5, seed=3, max_tokens=200, guided_decoding=_guided(case, True)
    )
    out = graphs.generate(PROMPT, params)[0]
    texts = [c.text for c in out.outputs]
    assert all(c.finish_reason == "stop" and case.valid(c.text) for c in out.outputs), texts
    assert len(set(texts)) > 1  # the siblings sampled apart, each under its own matcher


def test_preemption_mid_grammar_resumes_the_matcher() -> None:
    """A pool too small for every request at once: constrained sequences are preempted and
    recomputed, their matchers resuming where their tokens are."""
    # 22 pages: one full-length sequence (21 pages with its image's cross pages), not six.
    tight = _llm(max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=22)
    case = next(c for c in CASES if c.name == "nested")
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, guided_decoding=_guided(case, 1))
        for i in range(6)
    ]
    outs = tight.generate([PROMPT] * 6, params, use_tqdm=False)
    engine = tight.llm_engine
    assert engine.scheduler.num_preemptions > 0
    for o in outs:
        c = o.outputs[0]
        ok = (
            case.valid(c.text)
            if c.finish_reason == "stop"
            else _accepted_prefix(tight, case, c.token_ids)
        )
        assert ok, c.text
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 5
    engine.check_integrity()


def test_abort_mid_grammar(graphs: LLM) -> None:
    engine = graphs.llm_engine
    case = next(c for c in CASES if c.name == "nested")
    params = SamplingParams(temperature=1.0, max_tokens=200, guided_decoding=_guided(case, 0))
    engine.add_request("doomed", PROMPT, params)
    engine.add_request("kept", PROMPT, params)
    for _ in range(6):
        engine.step()
    doomed = engine.scheduler.requests["doomed"]
    assert doomed.seqs[0].grammar is not None and doomed.seqs[0].grammar.num_accepted > 0
    engine.abort_request("doomed")
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    assert set(done) <= {"kept"} and done["kept"].finished
    c = done["kept"].outputs[0]
    assert case.valid(c.text) if c.finish_reason == "stop" else c.finish_reason == "length"
    engine.check_integrity()


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        (dict(json='{"type": "object"'), "guided_json is not valid JSON"),
        (dict(json={"type": "wat"}), 'Unsupported type "wat"'),
        (dict(json={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
        (dict(regex="(abc"), "parenthesis is not closed"),
        (dict(grammar='root ::= "a" | undefined_rule'), 'Rule "undefined_rule" is not defined'),
        (dict(choice=[]), "non-empty list"),
        (dict(regex="a", choice=["a"]), "only use one kind"),
        (dict(json={}, whitespace_pattern=" "), "guided_whitespace_pattern"),
    ],
)
def test_bad_constraints_raise_named_errors(graphs: LLM, guided: dict, message: str) -> None:
    with pytest.raises(GuidedDecodingError, match=message):
        graphs.generate(PROMPT, SamplingParams(guided_decoding=GuidedDecodingParams(**guided)))
    assert not graphs.llm_engine.has_unfinished_requests()


def test_image_rows_under_a_constraint(graphs: LLM) -> None:
    """A constrained request with an image decodes from the cross graphs, next to a
    constrained text request and a free one."""
    import numpy as np
    from PIL import Image

    engine = graphs.llm_engine
    engine.reset_counters()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8))
    regex = r"(red|green|blue) [0-9]{2,4}"
    guided = SamplingParams(
        temperature=1.0, seed=2, max_tokens=30, guided_decoding=GuidedDecodingParams(regex=regex)
    )
    prompts = [
        {
            "prompt": "<|image|><|begin_of_text|>Colour and size:",
            "multi_modal_data": {"image": image},
        },
        PROMPT,
        "free",
    ]
    outs = graphs.generate(prompts, [guided, guided, SamplingParams(max_tokens=8)])
    for o in outs[:2]:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    keys = engine.runner.stats.graph_replays
    assert (
        any(family == "cross" for family, _ in keys) and not engine.runner.stats.eager_decode_steps
    )
