"""``EngineStats``: the histogram arithmetic, and what an offline engine records for the
requests it runs (the same numbers ``/metrics`` reads)."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.stats import Histogram, step_token_buckets, token_buckets


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((1.0, 2.0, 5.0))
    for value in (0.5, 1.0, 3.0, 9.0):
        h.observe(value)
    assert h.cumulative() == [("1.0", 2), ("2.0", 2), ("5.0", 3), ("+Inf", 4)]
    assert h.total == pytest.approx(13.5)


def test_bucket_layouts() -> None:
    assert token_buckets(512) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
    assert step_token_buckets(100) == (1.0, 8.0, 16.0, 32.0, 64.0, 100.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=8)


def test_offline_requests_are_counted(llm: LLM) -> None:
    stats = llm.llm_engine.stats
    before = stats.snapshot()
    params = [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, n=3, max_tokens=2, ignore_eos=True),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
    ]
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    after = stats.snapshot()
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    assert after["generation_tokens"] - before["generation_tokens"] == 4 + 3 * 2
    success = after["request_success"].get("length", 0) - before["request_success"].get("length", 0)
    assert success == 1 + 3 + 1

    def count(name: str) -> int:
        return after["histograms"][name][1][-1][1] - before["histograms"][name][1][-1][1]

    for name in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_params_n",
        "request_params_max_tokens",
    ):
        assert count(name) == 3, name
    # The greedy request's 3 tokens after its first, the n=3 request's 1 (siblings once).
    assert count("time_per_output_token_seconds") == 3 + 1
    n_sum = after["histograms"]["request_params_n"][2] - before["histograms"]["request_params_n"][2]
    assert n_sum == 1 + 3 + 1


def test_aborted_requests_are_not_successes(llm: LLM) -> None:
    engine = llm.llm_engine
    before = engine.stats.snapshot()
    engine.add_request("gone", "aborted", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats.snapshot()
    assert after["request_success"] == before["request_success"]
    e2e = "e2e_request_latency_seconds"
    assert after["histograms"][e2e][1] == before["histograms"][e2e][1]
    assert after["prompt_tokens"] > before["prompt_tokens"]  # its prefill did run
