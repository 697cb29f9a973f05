"""Loglikelihood scoring over ``/v1/completions``, as lm-evaluation-harness does it: ``echo``
with ``logprobs`` and ``max_tokens`` 0 or 1, prompts as text or token ids, in batches. Every
prompt position's logprob (and its top alternatives) is checked against HF transformers'
log-softmax on the demo checkpoint, with the tolerance of the model tests."""

from __future__ import annotations

import json
from functools import cache

import httpx
import pytest
import torch
from helpers.hf_runner import demo_path, hf_prefill_logits, load_hf_model
from openai_server_utils import MODEL, RunningServer, wait_until_idle

TOL = 1e-4  # as tests/model_executor/test_mllama_model.py compares logits
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello there", "a"]


@cache
def hf_logprobs(token_ids: tuple[int, ...]) -> torch.Tensor:
    """[T - 1, V]: HF's log-softmax at each position, predicting the next prompt token."""
    hf = load_hf_model(str(demo_path()))
    logits = hf_prefill_logits(hf, {"input_ids": torch.tensor([token_ids])})
    return logits[:-1].log_softmax(-1)


def hf_loglikelihood(context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's ``loglikelihood`` of ``continuation`` after ``context`` per HF: the summed
    logprobs of the continuation tokens and whether each is the argmax."""
    ids = (*context, *continuation)
    lp = hf_logprobs(ids)
    rows = lp[len(context) - 1 :]
    targets = torch.tensor(continuation)
    total = rows.gather(1, targets[:, None]).sum().item()
    return total, bool((rows.argmax(-1) == targets).all())


def tokenize(server: RunningServer, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def complete(server: RunningServer, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_against_hf(ids: list[int], logprobs: dict, num_top: int) -> None:
    """Position 0 has no logprob; every later one matches HF, its top entries too."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ref = hf_logprobs(tuple(ids))
    for t in range(1, len(ids)):
        want = ref[t - 1, ids[t]].item()
        got = logprobs["token_logprobs"][t]
        assert abs(got - want) <= TOL, f"position {t}: {got} vs HF {want}"
        # Keyed by token text: two tokens with the same text (say "\ufffd") share a key.
        top = logprobs["top_logprobs"][t]
        assert got in top.values() and len(top) <= num_top + 1
        allowed = [want, *ref[t - 1].topk(num_top).values.tolist()]
        for value in top.values():
            assert min(abs(value - a) for a in allowed) <= TOL, f"position {t}: {value}"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_echo_scores_every_prompt_position(server: RunningServer, prompt: str) -> None:
    body = complete(server, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    (choice,) = body["choices"]
    ids = tokenize(server, prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(ids)
    assert lps["tokens"][0] == "<|begin_of_text|>" and lps["text_offset"][0] == 0
    check_against_hf(ids, lps, 2)
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": None,
    }


def test_lm_eval_request_shape(server: RunningServer) -> None:
    """lm-eval's local-completions request: token-id prompts in a batch, echo, logprobs=1,
    max_tokens=1, temperature 0; its score is the sum over the continuation tokens."""
    pairs = [("Question: is the sky blue? Answer:", " yes"), ("The cat sat on the", " mat")]
    prompts = [tokenize(server, c) + tokenize(server, x)[1:] for c, x in pairs]
    body = complete(
        server, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for (context, _), ids, choice in zip(pairs, prompts, body["choices"], strict=True):
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        check_against_hf(ids, {k: v[:-1] for k, v in lps.items()}, 1)
        ctxlen = len(tokenize(server, context))
        score = sum(lps["token_logprobs"][ctxlen:-1])  # what lm-eval adds up
        want, _ = hf_loglikelihood(ids[:ctxlen], ids[ctxlen:])
        assert score == pytest.approx(want, abs=TOL * len(ids))


def test_prompt_logprobs_field_with_echo(server: RunningServer) -> None:
    """``prompt_logprobs`` (vLLM's extension) keyed by token id, with its own count of
    alternatives, next to the echoed prompt's (``logprobs``); both views agree."""
    ids = tokenize(server, "Two views of one prompt")
    body = complete(server, prompt=ids, echo=True, logprobs=1, prompt_logprobs=3, max_tokens=0)
    (choice,) = body["choices"]
    field, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert field[0] is None and len(field) == len(ids)
    ref = hf_logprobs(tuple(ids))
    for t in range(1, len(ids)):
        entries = field[t]
        assert str(ids[t]) in entries and len(entries) <= 4
        assert len(echoed["top_logprobs"][t]) <= 2
        mine = entries[str(ids[t])]["logprob"]
        assert mine == echoed["token_logprobs"][t]
        assert abs(mine - ref[t - 1, ids[t]].item()) <= TOL
        others = {int(tid): e for tid, e in entries.items() if tid != str(ids[t])}
        assert {e["rank"] for e in others.values()} <= {1, 2, 3}
        values = ref[t - 1].topk(3).values
        for tid, e in others.items():  # each alternative is HF's at its rank (ties aside)
            assert abs(e["logprob"] - values[e["rank"] - 1].item()) <= TOL
            assert abs(ref[t - 1, tid].item() - e["logprob"]) <= TOL


def test_no_echo_max_tokens_zero_and_prompt_logprobs_only(server: RunningServer) -> None:
    body = complete(server, prompt="Nothing to add", max_tokens=0, prompt_logprobs=0)
    (choice,) = body["choices"]
    assert choice["text"] == "" and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert all(len(step) == 1 for step in choice["prompt_logprobs"][1:])
    plain = complete(server, prompt="Nothing to add", max_tokens=1, echo=True)
    assert plain["choices"][0]["text"].startswith("Nothing to add")
    assert "prompt_logprobs" in plain["choices"][0]
    assert plain["choices"][0]["prompt_logprobs"] is None  # only when asked for


def test_echo_stream_equals_the_response(server: RunningServer) -> None:
    body = {"prompt": "Stream the echo", "echo": True, "logprobs": 2, "max_tokens": 3}
    whole = complete(server, **body, temperature=0, ignore_eos=True)["choices"][0]
    url = f"{server.url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "stream": True, "temperature": 0, "ignore_eos": True}
    ) as r:
        events = [json.loads(e[6:]) for e in r.iter_lines() if e and e != "data: [DONE]"]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith("Stream the echo") and "".join(texts) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        streamed = [x for e in events for x in e["choices"][0]["logprobs"][key]]
        assert streamed == whole["logprobs"][key], key
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_stream_max_tokens_zero(server: RunningServer) -> None:
    url = f"{server.url}/v1/completions"
    body = {"prompt": "Only the prompt", "echo": True, "logprobs": 0, "max_tokens": 0}
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        events = [json.loads(e[6:]) for e in r.iter_lines() if e and e != "data: [DONE]"]
    (event,) = events
    choice = event["choices"][0]
    assert choice["text"] == "Only the prompt" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(tokenize(server, "Only the prompt"))


def test_max_tokens_bounds(server: RunningServer) -> None:
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, json={"prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    chat = f"{server.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(chat, json={"messages": msgs, field: 0})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    wait_until_idle(server.engine)
