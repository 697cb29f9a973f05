"""What a request's fields may cost before anything runs: list lengths bounded by the model
(checked from the raw body, before any per-element walk, so a long list neither stalls the
event loop nor grows the process), and sampling values that float32 can hold. The attacks run
beside ordinary requests, which must come back unchanged while /health answers."""

from __future__ import annotations

import math

import httpx
import pytest
from attack_utils import run_attack
from openai_server_utils import RunningServer

MAX_LAG = 2.0  # seconds; the stalls these tests guard against lasted 3 to 13 s


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b'{"max_tokens": 2, "prompt": [%s5]}'),
        ("/detokenize", b'{"tokens": [%s5]}'),
        ("/v1/completions", b'{"max_tokens": 2, "prompt": [[%s5]]}'),
    ],
    ids=["prompt ids", "detokenize ids", "batched prompt ids"],
)
def test_long_lists_are_refused_without_stalling_the_loop(
    server: RunningServer, path: str, body: bytes
) -> None:
    """4 Mi ids (8 MiB): refused from their length before any per-element work; the loop
    stalled for seconds (and grew by gigabytes) while a validator walked them one by one."""
    payload = body % (b"5," * (4 << 20))

    async def attack(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(path, content=payload, headers={"content-type": "application/json"})

    r, lag = run_attack(server, attack)
    assert lag < MAX_LAG, f"the event loop stalled for {lag:.2f} s"
    assert r.status_code == 400, r.text[:300]
    assert "more than 512 (the model's maximum context length" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_long_text_is_refused_before_it_is_tokenized(server: RunningServer, path: str) -> None:
    """16 MiB of text cannot be a prompt of 512 tokens: no need to tokenize it to know."""

    async def attack(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(path, json={"prompt": "ab " * ((16 << 20) // 3), "max_tokens": 2})

    r, lag = run_attack(server, attack)
    assert lag < MAX_LAG, f"the event loop stalled for {lag:.2f} s"
    assert r.status_code == 400, r.text[:300]
    assert "characters, more than any prompt of that many tokens" in r.json()["error"]["message"]


def test_lone_surrogates_are_still_found_with_their_path(server: RunningServer) -> None:
    raw = b'{"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", ' \
          b'"text": "ok"}, {"type": "text", "text": "a\\ud800"}]}]}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[1].text: contains a lone")


def test_float32_overflow_is_refused_or_clamped(server: RunningServer) -> None:
    url = f"{server.url}/v1/completions"
    for field, value in (("repetition_penalty", 1e-300), ("top_p", 1e-300)):
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=30)
        assert r.status_code == 400 and "float32" in r.json()["error"]["message"], r.text
    # logit_bias is clamped to [-100, 100] (OpenAI's range): token 5 wins, logprobs finite.
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0.0, "logprobs": 1,
            "logit_bias": {"5": 1e300}, "ignore_eos": True}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tok = server.engine.get_tokenizer()
    assert lp["tokens"] == [tok.decode([5])] * 3
    assert all(math.isfinite(v) for v in lp["token_logprobs"])
