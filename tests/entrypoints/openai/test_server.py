"""The OpenAI-compatible server through the official openai client: chat (text, image,
streaming, n > 1), completions, models, tokenize/detokenize, metrics, health, version."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai_server_utils import MODEL, RunningServer, image_message, png_data_url, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

from vllm.version import __version__


def test_models_shape(server: RunningServer) -> None:
    body = httpx.get(f"{server.url}/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["owned_by"] == "vllm" and card["root"] == MODEL and card["parent"] is None
    assert card["max_model_len"] == 512
    assert card["permission"][0]["object"] == "model_permission"
    assert server.client().models.list().data[0].id == MODEL


def test_health_version_docs(server: RunningServer) -> None:
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200


def test_chat_text(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, temperature=0.0
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.completion_tokens >= 1 and usage.completion_tokens <= 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_image_data_url(server: RunningServer, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=image_message(png_data_url()),
        max_completion_tokens=4,
        temperature=0.0,
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    # As vLLM counts: the decoder prompt (one <|image|> token for the image) plus the encoder
    # prompt, one vision token per patch and class token of each tile: (56/14)^2 + 1 = 17 for
    # the tiny demo's one tile here (1,601 for a 560-px tile).
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"messages": image_message("data:image/png;base64,AA")}
    ).json()
    assert tokenized["tokens"].count(512) == 1  # <|image|>
    assert resp.usage.prompt_tokens == tokenized["count"] + 17
    stream = client.chat.completions.create(
        model=MODEL,
        messages=image_message(png_data_url()),
        max_completion_tokens=4,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(stream)[-1].usage.prompt_tokens == resp.usage.prompt_tokens


def test_chat_model_optional_and_extra_fields_ignored(server: RunningServer) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "some_future_field": 1,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_priority_needs_the_priority_policy(server: RunningServer) -> None:
    """The server runs fcfs: priority 0 is accepted, any other value is a 400 naming it."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for url in ("/v1/chat/completions", "/v1/completions"):
        payload = dict(body) if "chat" in url else {"prompt": "hi", "max_tokens": 2}
        ok = httpx.post(f"{server.url}{url}", json={**payload, "priority": 0})
        assert ok.status_code == 200, ok.text
        bad = httpx.post(f"{server.url}{url}", json={**payload, "priority": 2})
        assert bad.status_code == 400 and "scheduling-policy priority" in bad.text, bad.text


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count!"}],
        max_tokens=6,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert first.finish_reason is None
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    finals = [c for c in chunks[:-1] if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-2]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    offline = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count!"}], max_tokens=6, temperature=0.0
    )
    assert text == offline.choices[0].message.content
    assert usage_chunk.usage.completion_tokens == offline.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == offline.usage.prompt_tokens


def test_chat_stream_raw_sse_ends_with_done(server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("usage" not in p for p in payloads)  # no stream_options: no usage chunk
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in payloads[-1]["choices"][0]


def test_chat_n_greater_than_one(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=4,
        n=3,
        temperature=1.0,
        seed=7,
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert 3 <= resp.usage.completion_tokens <= 12
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=3,
        n=2,
        temperature=1.0,
        stream=True,
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob <= 0.0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token


def test_generation_config_defaults_apply(server: RunningServer) -> None:
    """Unset sampling fields take the checkpoint's generation config (temperature 0.6)."""
    from vllm.entrypoints.openai.serving_engine import OpenAIServing

    handler = OpenAIServing(server.app.state.ctx)
    sp = handler.sampling_params({}, 5, None, stream=False)
    assert sp.temperature == pytest.approx(0.6) and sp.top_p == pytest.approx(0.9)
    sp = handler.sampling_params({"temperature": 1.0}, 5, None, stream=False)
    assert sp.temperature == 1.0 and sp.top_p == pytest.approx(0.9)


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI) -> None:
    long_text = "a" * 405  # 405 byte tokens plus the ~97-token template: near 512
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_text}],
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.total_tokens == 512
    assert resp.choices[0].finish_reason == "length"


def test_completions_forms(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0.0)
    assert resp.object == "text_completion" and len(resp.choices) == 1
    resp2 = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=3, n=2, temperature=0.8
    )
    assert sorted(c.index for c in resp2.choices) == [0, 1, 2, 3]
    ids = client.completions.create(
        model=MODEL, prompt=[256, 104, 105], max_tokens=2, temperature=0.0
    )
    many = client.completions.create(
        model=MODEL, prompt=[[256, 104], [256, 105, 106]], max_tokens=2, temperature=0.0
    )
    assert ids.usage.prompt_tokens == 3 and many.usage.prompt_tokens == 5
    default = client.completions.create(
        model=MODEL, prompt="x", temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert default.usage.completion_tokens == 16  # vLLM's completions default


def test_completions_stream_and_logprobs(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["p", "q"],
            max_tokens=3,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=1,
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 4
    finished = sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason)
    assert finished == [0, 1]
    text = "".join(c.choices[0].text for c in chunks[:-1] if c.choices[0].index == 0)
    ref = client.completions.create(model=MODEL, prompt="p", max_tokens=3, temperature=0.0)
    assert text == ref.choices[0].text


def test_completions_echo(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="echo me", max_tokens=2, temperature=0.0, echo=True
    )
    assert resp.choices[0].text.startswith("echo me")


def test_tokenize_detokenize_round_trip(server: RunningServer) -> None:
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True},
    ).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["tokens"][0] == 256 and len(r["token_strs"]) == r["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"][1:]}).json()
    assert back == {"prompt": "Hello there"}
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}
    ).json()
    assert chat["tokens"].count(256) == 1  # the template's BOS only, not a second one
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_move(server: RunningServer, client: openai.OpenAI) -> None:
    wait_until_idle(server.engine)
    before = _samples(httpx.get(f"{server.url}/metrics").text)
    label = (("model_name", MODEL),)
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "m"}],
        max_tokens=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    after = _samples(httpx.get(f"{server.url}/metrics").text)
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert after[(name, label)] > before.get((name, label), 0.0), name
    assert (
        after[("vllm:generation_tokens_total", label)]
        - before.get(("vllm:generation_tokens_total", label), 0.0)
        == 3
    )
    success = ("vllm:request_success_total", (("finished_reason", "length"), *label))
    assert after[success] == before.get(success, 0.0) + 1
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
    ):
        assert 0.0 <= after[(gauge, label)] <= 16
    assert ("vllm:num_preemptions_total", label) in after
    assert ("vllm:eager_decode_steps_total", label) in after
    for name in ("vllm:images_encoded_ahead_total", "vllm:encoder_steps_total"):
        assert after[(name, label)] >= before.get((name, label), 0.0) >= 0, name
    replays = [k for k in after if k[0] == "vllm:cuda_graph_replays_total"]
    eager = after[("vllm:eager_decode_steps_total", label)]
    assert replays or eager > 0  # decode ran either through a graph bucket or eagerly
    for key in replays:
        assert {"family", "bucket", "model_name"} <= dict(key[1]).keys()


def test_greedy_chat_matches_offline_llm(client: openai.OpenAI) -> None:
    from vllm import LLM, SamplingParams

    messages = image_message(png_data_url((40, 30), (10, 120, 240)), "Describe it.")
    online = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    llm = LLM(MODEL, max_model_len=512, max_num_seqs=4)
    offline = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert online.choices[0].message.content == offline.outputs[0].text
    encoder = offline.encoder_prompt_token_ids
    assert encoder and set(encoder) == {512}  # the vision tokens of the one image
    assert online.usage.prompt_tokens == len(offline.prompt_token_ids) + len(encoder)
    assert offline.prompt_token_ids.count(256) == 1  # one BOS
