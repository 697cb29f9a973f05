"""Property-based fuzzing of ``/v1/chat/completions`` and ``/v1/completions``: random JSON in
the known fields, random extra fields, random message structures. Whatever arrives, the answer
is a 200 or a 4xx with the OpenAI error body (never a 5xx), a stream ends with ``[DONE]`` and
carries no server error, and the server stays healthy.

Bounded: ``FUZZ_EXAMPLES`` per endpoint, derandomized (the same examples on every run; set
``VLLM_FUZZ_RANDOM=1`` to explore new ones), and generation lengths are kept small.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_server_utils import MODEL, RunningServer, png_data_url, wait_until_idle

FUZZ_EXAMPLES = int(os.environ.get("VLLM_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("VLLM_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=list(HealthCheck),
)

SPECIAL = st.sampled_from(["<|image|>", "<|begin_of_text|>", "<|eot_id|>", "\x00", "é", " "])
TEXT = st.text(max_size=24) | SPECIAL
ODD_TEXT = TEXT | st.just("\ud800")  # a lone surrogate: valid JSON escape, not valid text
LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | ODD_TEXT
)
JSON = st.recursive(
    LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(ODD_TEXT, c, max_size=4), max_leaves=8
)


def _long_generation(value: Any) -> bool:
    """Values that pydantic would accept as a token budget worth more than a few steps."""
    try:
        n = float(value) if not isinstance(value, (list, dict)) and value is not None else 0.0
    except (TypeError, ValueError):
        return False
    return math.isfinite(n) and 6 < n < 600


TOKEN_BUDGET = st.integers(1, 6)
WILD_BUDGET = TOKEN_BUDGET | st.integers(max_value=0) | st.integers(min_value=600)
WILD_BUDGET = WILD_BUDGET | JSON.filter(lambda v: not _long_generation(v))
IDS = st.lists(st.integers(0, 511), min_size=1, max_size=5)
IMAGE = st.sampled_from([png_data_url((8, 8)), png_data_url((30, 10), (1, 2, 3))])
BAD_IMAGE = st.sampled_from(
    ["data:image/png;base64,AAAA", "data:,", "", "file:///etc/passwd", "http://10.0.0.1/a.png"]
)


def part(image: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
    url = st.fixed_dictionaries({"url": image})
    return text | st.fixed_dictionaries({"type": st.just("image_url"), "image_url": url})


ROLE = st.sampled_from(["user", "assistant"])
CONTENT = TEXT | st.lists(part(IMAGE), min_size=1, max_size=2)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), min_size=1, max_size=3
)
WILD_ROLE = ROLE | st.sampled_from(["system", "tool", "developer"]) | JSON
WILD_CONTENT = CONTENT | st.lists(part(IMAGE | BAD_IMAGE) | JSON, max_size=3) | JSON
WILD_MESSAGE = st.fixed_dictionaries(
    {"role": WILD_ROLE}, optional={"content": WILD_CONTENT, "name": JSON}
)
WILD_MESSAGES = MESSAGES | st.lists(WILD_MESSAGE | JSON, max_size=3) | JSON
PROMPT = TEXT | IDS | st.lists(TEXT, min_size=1, max_size=3) | st.lists(IDS, min_size=1, max_size=2)
WILD_PROMPT = PROMPT | st.lists(st.integers(-3, 1000), max_size=5) | st.lists(JSON) | JSON

# Valid values, edges included (greedy temperature, top_k = -1, empty stops, ...).
COMMON = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 7, 600]),
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=3),
    "stop_token_ids": IDS,
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": IDS,
    "prompt_logprobs": st.integers(0, 5),
    "truncate_prompt_tokens": st.integers(1, 600),
    "skip_special_tokens": st.booleans(),
    "user": TEXT,
}
CHAT_FIELDS = {
    **COMMON,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["tools", "date_string", "x"]), TEXT),
}
COMPLETION_FIELDS = {**COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans()}
ODD_NUMBERS = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**65), 2**65)
EXTRA = st.dictionaries(st.text(min_size=1, max_size=12), JSON, max_size=3)


def wild(fields: dict[str, Any]) -> dict[str, Any]:
    """Each field: a valid value, an odd number, or anything at all."""
    return {k: v | ODD_NUMBERS | JSON for k, v in fields.items()}


def bodies(required: dict[str, Any], optional: dict[str, Any], wild_required: dict[str, Any]):
    """Mostly well-formed bodies, some with wild values and unknown fields, a few not objects."""
    valid = st.fixed_dictionaries(required, optional=optional)
    odd = st.fixed_dictionaries(wild_required, optional=wild(optional))
    odd = st.builds(lambda extra, k: {**extra, **k}, EXTRA, odd)
    return st.one_of(valid, valid, odd, odd, JSON)


CHAT_BODIES = bodies(
    {"messages": MESSAGES, "max_tokens": TOKEN_BUDGET},
    CHAT_FIELDS,
    {"messages": WILD_MESSAGES, "max_tokens": WILD_BUDGET},
)
COMPLETION_BODIES = bodies(
    {"prompt": PROMPT, "max_tokens": TOKEN_BUDGET},
    COMPLETION_FIELDS,
    {"prompt": WILD_PROMPT, "max_tokens": WILD_BUDGET},
)


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    # No keep-alive: the server drops idle connections after 5 s, which would race with reuse.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, timeout=30, limits=limits) as client:
        yield client


def check_answer(http: httpx.Client, path: str, body: Any) -> None:
    raw = json.dumps(body, allow_nan=True)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (raw[:2000], r.text[:2000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == r.status_code and err["message"], err
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", (raw[:2000], events[-3:])
        for e in events[:-1]:
            chunk = json.loads(e)
            assert chunk.get("error", {}).get("code", 0) < 500, (raw[:2000], chunk)
    else:
        assert r.json()["choices"], r.text
    assert http.get("/health").status_code == 200, raw[:2000]


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat_completions(http: httpx.Client, body: Any) -> None:
    check_answer(http, "/v1/chat/completions", body)


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzz_completions(http: httpx.Client, body: Any) -> None:
    check_answer(http, "/v1/completions", body)


def test_healthy_and_idle_after_fuzzing(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_until_idle(server.engine)
