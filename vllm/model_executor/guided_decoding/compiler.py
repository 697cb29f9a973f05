"""Compiling output constraints with xgrammar, cached and bounded.

Every cost is bounded (docs/security.md): the constraint's text (``max_spec_chars``), the time
one compilation may take, queueing included (``compile_timeout_s``: past it the request gets
an error naming the limit, and the same constraint is refused at once afterwards), the
compilations running at once (the pool's threads; xgrammar releases the GIL while it works,
so neither the event loop nor the engine loop waits), and the memory the cache of compiled
grammars holds (``cache_bytes``, least recently used first out).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from vllm.config import DecodingConfig
from vllm.guided_params import GuidedDecodingError, GuidedDecodingParams
from vllm.logger import init_logger
from vllm.model_executor.guided_decoding.matcher import CompiledConstraint
from vllm.model_executor.guided_decoding.schema_check import prepare_schema
from vllm.model_executor.guided_decoding.utf8_guard import Utf8Guard

logger = init_logger(__name__)

# xgrammar's messages start with a timestamp and a source location.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# Runs of optional whitespace JSON constraints allow between tokens (none when compact).
MAX_WHITESPACE_RUN = 20
_REMEMBERED_SLOW = 1024  # constraints that timed out, refused at once afterwards


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary. Special tokens other than the stop tokens are given
    no text, so no constraint ever allows them (their text would vanish from the output with
    ``skip_special_tokens`` and leave it invalid)."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )
    vocab = list(base.decoded_vocab)
    stops = set(stop_token_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id, token in added.items():
        if getattr(token, "special", False) and token_id < vocab_size and token_id not in stops:
            vocab[token_id] = b""
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=base.add_prefix_space,
    )


def clean_error(error: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = str(error).strip()
    return " ".join(_LOG_PREFIX.sub("", text).split()) or type(error).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of ``choices`` (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def spec_chars(params: GuidedDecodingParams) -> int:
    """The size of the constraint's text, in characters."""
    spec: Any = getattr(params, params.kind)
    if isinstance(spec, dict):
        try:
            return len(json.dumps(spec))
        except (RecursionError, TypeError, ValueError) as e:
            raise GuidedDecodingError(
                "guided_json is not a JSON schema (nested too deeply, or not JSON data)."
            ) from e
    if isinstance(spec, list):
        return sum(len(c) + 1 for c in spec)
    return len(spec) if isinstance(spec, str) else 0


class GrammarCompilerService:
    """Compiles constraints for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: DecodingConfig,
        threads: int = 2,
    ) -> None:
        import xgrammar as xgr

        self.config = config
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.utf8 = Utf8Guard(self.tokenizer_info.decoded_vocab, vocab_size)
        # xgrammar's own cache is off: this one is bounded, and it dedupes in-flight work.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=threads, cache_enabled=False
        )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vllm-grammar")
        self._threads = threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._cache_bytes = 0
        self._running: dict[tuple[Any, ...], Future[Any]] = {}
        self._slow: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._overdue: set[tuple[Any, ...]] = set()  # timed out, still holding a thread
        self.compile_seconds: list[float] = []  # per compilation (cache misses), for reports

    # ------------------------------------------------------------------ public
    def compile(self, params: GuidedDecodingParams) -> CompiledConstraint:
        """The compiled constraint of ``params`` (cached); raises ``GuidedDecodingError``."""
        return CompiledConstraint(self._compile_cached(params), self.utf8)

    def _compile_cached(self, params: GuidedDecodingParams) -> Any:
        self._check_size(params)
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if key in self._slow:
                raise self._timeout_error()
            future = self._running.get(key)
            if future is None:
                if len(self._overdue) >= self._threads:
                    raise GuidedDecodingError(
                        "The grammar compiler is busy with constraints that ran past the "
                        f"{self.config.compile_timeout_s:g} s limit; retry later."
                    )
                future = self._pool.submit(self._run, key, params)
                self._running[key] = future
        try:
            return future.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            self._mark_slow(key)
            raise self._timeout_error() from None

    @property
    def cache_size_bytes(self) -> int:
        return self._cache_bytes

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _check_size(self, params: GuidedDecodingParams) -> None:
        size, limit = spec_chars(params), self.config.max_spec_chars
        if size > limit:
            raise GuidedDecodingError(
                f"The guided_{params.kind} constraint has {size} characters, more than the "
                f"limit of {limit}."
            )

    def _timeout_error(self) -> GuidedDecodingError:
        return GuidedDecodingError(
            f"Compiling the constraint took longer than {self.config.compile_timeout_s:g} s "
            "(the grammar compile timeout); simplify the schema or grammar."
        )

    def _mark_slow(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._slow[key] = None
            while len(self._slow) > _REMEMBERED_SLOW:
                self._slow.popitem(last=False)
            if key in self._running:
                self._overdue.add(key)

    def _run(self, key: tuple[Any, ...], params: GuidedDecodingParams) -> Any:
        """A pool thread's work: compile, then cache the result before any waiter sees it
        (a compilation that timed out is not cached: its requests were answered)."""
        try:
            compiled = self._compile_timed(params)
        except BaseException:
            with self._lock:
                self._running.pop(key, None)
                self._overdue.discard(key)
            raise
        with self._lock:
            self._running.pop(key, None)
            if key in self._overdue:
                self._overdue.discard(key)
                return compiled
            self._cache[key] = compiled
            self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > self.config.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes
        return compiled

    def _compile_timed(self, params: GuidedDecodingParams) -> Any:
        t0 = time.perf_counter()
        try:
            compiled = self._compile_one(params)
        except GuidedDecodingError:
            raise
        except Exception as e:  # xgrammar's RuntimeError for a bad schema, regex or grammar
            raise GuidedDecodingError(
                f"Invalid guided_{params.kind} constraint: {clean_error(e)}"
            ) from None
        seconds = time.perf_counter() - t0
        self.compile_seconds.append(seconds)
        logger.debug("Compiled a %s constraint in %.3f s", params.kind, seconds)
        return compiled

    def _compile_one(self, params: GuidedDecodingParams) -> Any:
        kind = params.kind
        compile_fn: Callable[[], Any]
        if kind in ("json", "json_object"):
            # json_object is any JSON object (OpenAI's meaning), not any JSON value.
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as e:
                    raise GuidedDecodingError(f"guided_json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GuidedDecodingError("guided_json must be a JSON schema object.")
            schema = prepare_schema(schema)
            compact = params.disable_any_whitespace or self.config.disable_any_whitespace
            compile_fn = lambda: self._compiler.compile_json_schema(  # noqa: E731
                json.dumps(schema),
                any_whitespace=not compact,
                max_whitespace_cnt=None if compact else MAX_WHITESPACE_RUN,
                strict_mode=True,
            )
        elif kind == "regex":
            compile_fn = lambda: self._compiler.compile_regex(params.regex)  # noqa: E731
        elif kind == "choice":
            assert params.choice is not None
            compile_fn = lambda: self._compiler.compile_grammar(  # noqa: E731
                choice_grammar(params.choice or [])
            )
        else:
            grammar = params.grammar or ""
            # EBNF rules are written "name ::= ..."; Lark's "name: ...".
            if "::=" in grammar:
                compile_fn = lambda: self._compiler.compile_grammar(grammar)  # noqa: E731
            else:
                compile_fn = lambda: self._compiler.compile_lark(grammar)  # noqa: E731
        return compile_fn()
