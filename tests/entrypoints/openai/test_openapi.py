"""The published schema (``/openapi.json``) agrees with the server: every status and content
type a route answers is documented, the bounds carry this app's numbers, and each numeric
bound the schema states is the one the server enforces (a value at the bound is accepted,
one just past it refused with a 400)."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from openai_server_utils import MODEL, RunningServer, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine

GENERATION = ("/v1/chat/completions", "/v1/completions", "/invocations")


@pytest.fixture(scope="module")
def schema(server: RunningServer) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json").json()


def _props(schema: dict[str, Any], model: str) -> dict[str, Any]:
    return schema["components"]["schemas"][model]["properties"]


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]


def test_statuses_and_content_types(schema: dict[str, Any]) -> None:
    paths = schema["paths"]
    for path, item in paths.items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)  # the server answers 400
    for path in GENERATION:
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        err = responses["400"]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/health", "/ping"):
        for op in paths[path].values():
            assert op["responses"]["200"].get("content") in (None, {}), path
    assert set(paths["/ping"]) == {"get", "post"}
    metrics = paths["/metrics"]["get"]["responses"]
    assert set(metrics["200"]["content"]) == {"text/plain"}
    assert set(metrics["401"]["content"]) == {"application/json"}
    assert set(paths["/v1/models/{model}"]["get"]["responses"]) >= {"200", "404"}
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids))


def test_app_bounds(schema: dict[str, Any], server: RunningServer) -> None:
    mc = server.engine.config.model_config
    vocab, max_len = mc.spec.text.vocab_size, mc.max_model_len
    prompt = _props(schema, "CompletionRequest")["prompt"]["anyOf"]
    ids = [b for b in prompt if b["type"] == "array" and b["items"]["type"] == "integer"]
    (flat,) = ids
    assert flat["items"] == {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    assert flat["minItems"] == 1 and flat["maxItems"] == max_len
    chat = _props(schema, "ChatCompletionRequest")
    assert _branches(chat["n"])[0]["maximum"] == 16  # --max-num-seqs of the test engine
    assert _branches(chat["top_logprobs"])[0]["maximum"] == mc.max_logprobs
    assert _branches(chat["max_tokens"])[0] == {"type": "integer", "minimum": 1, "maximum": 511}
    assert chat["messages"]["minItems"] == 1 and chat["messages"]["maxItems"] == max_len
    # Untrusted request templates: the only value accepted is null.
    assert {b["type"] for b in chat["chat_template"]["anyOf"]} == {"null"}
    assert "x-vllm-bound" not in httpx.get(f"{server.url}/openapi.json").text
    detok = _props(schema, "DetokenizeRequest")["tokens"]["items"]
    assert detok["maximum"] == len(server.engine.get_tokenizer()) - 1


def test_trusted_templates_are_documented(engine: AsyncLLMEngine) -> None:
    srv = start_server(engine, ["--trust-request-chat-template"])
    try:
        doc = httpx.get(f"{srv.url}/openapi.json").json()
        template = _props(doc, "ChatCompletionRequest")["chat_template"]
        assert {"type": "string"} in template["anyOf"]
    finally:
        srv.stop()


def _bounds(prop: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """(type, minimum, maximum) of each numeric range a property admits."""
    out = []
    for branch in _branches(prop):
        if branch.get("type") not in ("integer", "number"):
            continue
        for part in branch.get("anyOf", [branch]):
            if "minimum" in part or "maximum" in part:
                out.append((branch["type"], part.get("minimum"), part.get("maximum")))
    return out


def _outside(kind: str, value: float, up: bool) -> float:
    if kind == "integer":
        return int(value) + (1 if up else -1)
    return math.nextafter(value, math.inf if up else -math.inf)


def _admitted(prop: dict[str, Any], value: float) -> bool:
    for branch in _branches(prop):
        for part in branch.get("anyOf", [branch]):
            if part.get("const") == value:
                return True
            lo, hi = part.get("minimum", -math.inf), part.get("maximum", math.inf)
            if ("minimum" in part or "maximum" in part) and lo <= value <= hi:
                return True
    return False


# Fields whose bound the server can only meet together with another field (docs/api.md).
CROSS_FIELD = {"best_of"}


def test_numeric_bounds_are_enforced(schema: dict[str, Any], server: RunningServer) -> None:
    props = _props(schema, "CompletionRequest")
    url = f"{server.url}/v1/completions"
    checked = 0
    for name, prop in sorted(props.items()):
        if name in CROSS_FIELD:
            continue
        for kind, lo, hi in _bounds(prop):
            for bound, up in ((lo, False), (hi, True)):
                if bound is None:
                    continue
                beyond = _outside(kind, bound, up)
                # One prompt token, one output token: only the field under test can fail.
                body = {"model": MODEL, "prompt": [256], "max_tokens": 1, name: bound}
                if name == "max_tokens":
                    body = {"model": MODEL, "prompt": [256], name: bound, "ignore_eos": True}
                r = httpx.post(url, json=body, timeout=120)
                assert r.status_code == 200, (name, bound, r.text)
                if not _admitted(prop, beyond):
                    r = httpx.post(url, json={**body, name: beyond}, timeout=120)
                    assert r.status_code == 400, (name, beyond, r.text)
                    checked += 1
    assert checked >= 20  # the penalties, temperature, top_p, min_p, top_k, n, logprobs, ...


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": [256, True]}, "prompt"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": "x", "stream": "false"}, "stream"),
        ({"prompt": "x", "logit_bias": {"5 ": 1.0}}, "logit_bias"),
        ({"prompt": "", "add_special_tokens": False}, "prompt"),
        ({"prompt": "x", "max_tokens": 512}, "max_tokens"),
    ],
)
def test_what_the_schema_refuses_is_refused(
    server: RunningServer, body: dict[str, Any], field: str
) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field, r.text


def test_continue_final_message_excludes_the_generation_prompt(
    schema: dict[str, Any], server: RunningServer
) -> None:
    rule = schema["components"]["schemas"]["ChatCompletionRequest"]["not"]
    assert rule["properties"]["continue_final_message"] == {"const": True}
    body = {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
