"""The grammar compiler's bounds: compiled constraints are cached per constraint (in flight
too), a compilation that runs past its time limit is an error at once (and the same
constraint is refused at once afterwards), oversized constraints are refused before
compiling, and the cache stays within its byte budget."""

from __future__ import annotations

import threading
import time

import pytest

from vllm.config import DecodingConfig
from vllm.guided_params import GuidedDecodingError, GuidedDecodingParams
from vllm.model_executor.guided_decoding.compiler import GrammarCompilerService
from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint
from vllm.transformers_utils.tokenizer import get_tokenizer

# A schema with many bounded numbers (a few milliseconds to compile).
SLOW = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "integer", "minimum": -(10**i), "maximum": 10**i + 7}
        for i in range(1, 12)
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(get_demo_checkpoint("demo/mllama-tiny"))


def _service(tokenizer, **kw) -> GrammarCompilerService:
    return GrammarCompilerService(tokenizer, 512, [257, 265], DecodingConfig(**kw))


def test_cached_per_constraint(tokenizer) -> None:
    svc = _service(tokenizer)
    a = svc.compile(GuidedDecodingParams(json={"type": "object", "properties": {"x": {}}}))
    b = svc.compile(GuidedDecodingParams(json='{"properties": {"x": {}}, "type": "object"}'))
    assert a.grammar is b.grammar and len(svc.compile_seconds) == 1
    compact = svc.compile(
        GuidedDecodingParams(json={"type": "object"}, disable_any_whitespace=True)
    )
    assert compact.grammar is not a.grammar and len(svc.compile_seconds) == 2
    # Concurrent requests for one new constraint compile it once.
    params = GuidedDecodingParams(regex="[a-f]{3,9}")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(svc.compile(params))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r.grammar) for r in results}) == 1 and len(svc.compile_seconds) == 3


def test_time_limit(tokenizer) -> None:
    """Compilations held up (a gate stands for a hostile schema) time out; the constraint is
    refused at once afterwards; with every thread held by an overdue compilation new ones
    are refused; an overdue result is not cached."""
    svc = _service(tokenizer, compile_timeout_s=0.05)
    gate = threading.Event()
    real = svc._compile_one

    def held(params: GuidedDecodingParams):
        gate.wait(30)
        return real(params)

    svc._compile_one = held  # type: ignore[method-assign]
    start = time.perf_counter()
    for i in range(2):  # one overdue compilation per thread
        with pytest.raises(GuidedDecodingError, match="longer than 0.05 s"):
            svc.compile(GuidedDecodingParams(regex=f"[a-z]{{{i + 1}}}"))
    with pytest.raises(GuidedDecodingError, match="longer than"):  # refused at once now
        svc.compile(GuidedDecodingParams(regex="[a-z]{1}"))
    with pytest.raises(GuidedDecodingError, match="busy"):
        svc.compile(GuidedDecodingParams(json=SLOW))
    assert time.perf_counter() - start < 10
    gate.set()
    svc._pool.shutdown(wait=True)
    assert not svc._cache and not svc._overdue and not svc._running


def test_size_limits(tokenizer) -> None:
    svc = _service(tokenizer, max_spec_chars=100)
    with pytest.raises(GuidedDecodingError, match="more than the limit of 100"):
        svc.compile(GuidedDecodingParams(choice=["x" * 60, "y" * 60]))
    deep: dict = {"type": "object"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    big = _service(tokenizer)
    with pytest.raises(GuidedDecodingError, match="nests deeper than 64"):
        big.compile(GuidedDecodingParams(json=deep))


def test_cache_stays_within_its_budget(tokenizer) -> None:
    svc = _service(tokenizer, cache_bytes=1)
    for i in range(4):
        svc.compile(GuidedDecodingParams(regex=f"[a-z]{{{i + 1}}}"))
    assert len(svc._cache) == 1  # only the newest is kept when each is over the budget
    svc2 = _service(tokenizer)
    for i in range(4):
        svc2.compile(GuidedDecodingParams(regex=f"[a-z]{{{i + 1}}}"))
    assert len(svc2._cache) == 4 and svc2.cache_size_bytes > svc.cache_size_bytes
