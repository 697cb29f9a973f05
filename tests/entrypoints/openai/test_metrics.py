"""``/metrics``: every series vLLM V0 exposes that this engine can fill, each moved by a known
amount, for streamed requests exactly as for non-streamed ones; ``vllm:cache_config_info``;
the HTTP request metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai_server_utils import (
    MODEL,
    RunningServer,
    image_message,
    parse_server_args,
    start_server,
    wait_until_idle,
)
from prometheus_client.parser import text_string_to_metric_families

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine

LABEL = {"model_name": MODEL}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
REQUEST_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
)


def scrape(server: RunningServer) -> Samples:
    wait_until_idle(server.engine)
    out: Samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({**LABEL, **labels}.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def prompt_len(server: RunningServer, text: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["count"]


def completion(server: RunningServer, stream: bool, **body: Any) -> None:
    body = {"model": MODEL, "temperature": 1.0, "ignore_eos": True, "stream": stream, **body}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert [e for e in r.iter_lines() if e][-1] == "data: [DONE]"
    else:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_request_series_move_by_the_request(server: RunningServer, stream: bool) -> None:
    """Two prompts, n=2, 5 tokens each: 20 generated tokens, 4 sequences, 2 requests."""
    # Prompts of their own: the server caches prefixes, and a cached page is not computed.
    prompts = [f"{'Streamed' if stream else 'Plain'}: count the metrics", f"Again {stream}"]
    lens = [prompt_len(server, p) for p in prompts]
    before = scrape(server)
    completion(server, stream, prompt=prompts, n=2, max_tokens=5)
    after = scrape(server)
    assert delta(before, after, "vllm:generation_tokens_total") == 20
    assert delta(before, after, "vllm:prompt_tokens_total") == sum(lens)
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 4
    for name in REQUEST_HISTOGRAMS:
        assert delta(before, after, f"vllm:{name}_count") == 2, name
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == sum(lens)
    assert delta(before, after, "vllm:request_generation_tokens_sum") == 20
    assert delta(before, after, "vllm:request_max_num_generation_tokens_sum") == 10
    assert delta(before, after, "vllm:request_params_n_sum") == 4
    assert delta(before, after, "vllm:request_params_n_bucket", le="1.0") == 0
    assert delta(before, after, "vllm:request_params_n_bucket", le="2.0") == 2
    assert delta(before, after, "vllm:request_params_max_tokens_sum") == 10
    # vLLM V0's TPOT: once per request and step after its first token (siblings once).
    assert delta(before, after, "vllm:time_per_output_token_seconds_count") == 2 * 4
    # Every step's tokens: the prompts once, then every generated token.
    assert delta(before, after, "vllm:iteration_tokens_total_sum") == sum(lens) + 20
    assert delta(before, after, "vllm:iteration_tokens_total_count") >= 5


def test_phase_times_add_up(server: RunningServer) -> None:
    before = scrape(server)
    completion(server, True, prompt="Phases", max_tokens=8)
    after = scrape(server)

    def total(name: str) -> float:
        return delta(before, after, f"vllm:request_{name}_time_seconds_sum")

    inference = total("inference")
    assert inference > 0 and total("decode") > 0
    assert inference == pytest.approx(total("prefill") + total("decode"), abs=1e-6)
    e2e = delta(before, after, "vllm:e2e_request_latency_seconds_sum")
    assert e2e == pytest.approx(total("queue") + inference, abs=1e-6)
    ttft = delta(before, after, "vllm:time_to_first_token_seconds_sum")
    assert ttft == pytest.approx(total("queue") + total("prefill"), abs=1e-3)


def test_scoring_request_generates_nothing(server: RunningServer) -> None:
    before = scrape(server)
    completion(server, False, prompt="Score", max_tokens=0, echo=True, logprobs=1)
    after = scrape(server)
    assert delta(before, after, "vllm:generation_tokens_total") == 0
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 1
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == 1
    assert delta(before, after, "vllm:time_per_output_token_seconds_count") == 0
    assert delta(before, after, "vllm:request_params_max_tokens_bucket", le="1.0") == 1


def test_chat_stream_counts_every_token(server: RunningServer) -> None:
    """The red-team finding: a stream counted only its last delta."""
    body = {
        "messages": [{"role": "user", "content": "stream"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    before = scrape(server)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and len([e for e in r.iter_lines() if e]) >= 3
    after = scrape(server)
    assert delta(before, after, "vllm:generation_tokens_total") == 6
    assert delta(before, after, "vllm:time_per_output_token_seconds_count") == 5
    assert delta(before, after, "vllm:request_generation_tokens_sum") == 6


def test_cache_config_info(server: RunningServer) -> None:
    samples = scrape(server)
    (labels,) = [dict(k[1]) for k in samples if k[0] == "vllm:cache_config_info"]
    pool = server.engine.engine.block_manager.pool
    assert labels["block_size"] == "16" and labels["cache_dtype"] == "auto"
    assert labels["num_gpu_blocks"] == str(pool.num_allocatable)
    assert labels["enable_prefix_caching"] == "True"  # the server's default
    assert samples[("vllm:cache_config_info", tuple(sorted(labels.items())))] == 1.0


def _http(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_http_request_metrics(server: RunningServer) -> None:
    before = scrape(server)
    completion(server, False, prompt="http", max_tokens=2)
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    for path in ("/no/such/path", "/another/made/up/path"):
        assert httpx.get(f"{server.url}{path}").status_code == 404
    httpx.get(f"{server.url}/health")
    after = scrape(server)
    route = {"handler": "/v1/completions", "method": "POST"}
    for status, count in (("2xx", 1), ("4xx", 1)):
        name = "http_requests_total"
        got = _http(after, name, **route, status=status) - _http(
            before, name, **route, status=status
        )
        assert got == count, status
    unknown = {"handler": "none", "method": "GET", "status": "4xx"}
    assert (
        _http(after, "http_requests_total", **unknown)
        - _http(before, "http_requests_total", **unknown)
        == 2
    )  # one series for every path no route serves
    handlers = {dict(k[1]).get("handler") for k in after if k[0] == "http_requests_total"}
    assert not handlers & {"/health", "/metrics", "/no/such/path"}
    name = "http_request_duration_seconds_count"
    latency = {"handler": "/v1/completions", "method": "POST"}
    assert _http(after, name, **latency) - _http(before, name, **latency) == 2
    sizes = "http_response_size_bytes_sum", {"handler": "/v1/completions"}
    assert _http(after, sizes[0], **sizes[1]) > _http(before, sizes[0], **sizes[1])
    assert _http(after, "http_request_duration_highr_seconds_count") >= 4


def _png_data_url() -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_prefix_cache_counters() -> None:
    """With --enable-prefix-caching: queried and cached prompt tokens, vLLM's names."""
    args = parse_server_args(["--enable-prefix-caching"])
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    server = start_server(engine, ["--enable-prefix-caching"])
    try:
        prompt = "A prompt that is long enough to fill a few pages of the cache " * 3
        n = prompt_len(server, prompt)
        assert n > 2 * 16
        before = scrape(server)
        completion(server, False, prompt=prompt, max_tokens=2)
        middle = scrape(server)
        completion(server, False, prompt=prompt, max_tokens=2)
        after = scrape(server)
        assert delta(before, middle, "vllm:prefix_cache_queries_total") == n
        assert delta(before, middle, "vllm:prefix_cache_hits_total") == 0
        assert delta(middle, after, "vllm:prefix_cache_queries_total") == n
        assert delta(middle, after, "vllm:prefix_cache_hits_total") == (n - 1) // 16 * 16
        for name in ("vllm:cross_cache_queries_total", "vllm:cross_cache_hits_total"):
            assert delta(before, after, name) == 0  # no image: no cross group looked up
        # The same image twice: its cross group is looked up each time, found the second.
        url = _png_data_url()
        for turn in range(2):
            start = scrape(server)
            body = {"model": MODEL, "messages": image_message(url), "max_tokens": 2}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            end = scrape(server)
            assert delta(start, end, "vllm:cross_cache_queries_total") >= 1
            assert (delta(start, end, "vllm:cross_cache_hits_total") >= 1) == (turn == 1)
        (labels,) = [dict(k[1]) for k in after if k[0] == "vllm:cache_config_info"]
        assert labels["enable_prefix_caching"] == "True"
    finally:
        server.stop()
        engine.shutdown()
