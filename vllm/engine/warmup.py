"""Start-up warm-up: synthetic requests through the engine's own step loop.

Capture and the memory profile do not reach every kernel variant a served request can hit:
the prefill's cache writes, cross-attention with key splits (their count follows the prompt
length), the sampler's general path, the encoder spread over steps, prefill chunks that attend
to their earlier chunks. Each first use costs a
JIT compile (Triton: 0.1-0.7 s per kernel cold, a few ms from the disk cache) or a library plan,
and in a server that time stalls every running stream. The warm-up pays it before the first
request: a long-running text request decodes while image prompts of every tile count, prompts
of several lengths and a sampled request with logprobs go through the same scheduler paths as
served traffic (prefills while nothing decodes and next to the decode of others, prompts longer
than the token budget in chunks, images encoded over steps). Afterwards the engine holds no
request, every page is free and the runner's counters start from zero; its random images are
not kept in the processed-image cache. Before the requests, the runner runs each text-layer
GEMM at every padded prefill row count (``ModelRunner.warm_up_prefill_gemms``): cuBLAS's first
call at a new row count costs host milliseconds, and prompt lengths vary without end; and it
compiles the attention back-end's prefill kernel at every key-split count
(``ModelRunner.warm_up_attention_kernels``), which depends on the lengths of a step's prompts
together, so the requests alone may miss some.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.config import MllamaSpec

if TYPE_CHECKING:  # the engine imports this module to call warm_up
    from vllm.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

WARMUP_PREFIX = "__warmup__"
_MAX_STEPS = 20_000  # a bound on the loop; the warm-up takes a few hundred steps


@dataclass
class WarmupStats:
    requests: int
    steps: int
    seconds: float
    prefill_gemms: int = 0  # GEMM calls made at the padded prefill row counts


def _sentence(engine: LLMEngine) -> list[int]:
    """Ordinary text token ids to fill the warm-up prompts with."""
    return [t for t in engine.input_processor.tokenize("The quick brown fox jumps over it.")
            if t < engine.config.model_config.spec.text.vocab_size] or [1]


def _tile_shapes(spec: MllamaSpec) -> list[tuple[int, int]]:
    """One (width, height) in tiles for every tile count the processor can produce."""
    shapes: dict[int, tuple[int, int]] = {}
    for w, h in spec.vision.supported_aspect_ratios:
        shapes.setdefault(w * h, (w, h))
    return [shapes[n] for n in sorted(shapes, reverse=True)]


def _image(spec: MllamaSpec, tiles: tuple[int, int], seed: int) -> Any:
    import numpy as np
    from PIL import Image

    s = spec.vision.image_size
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(tiles[1] * s, tiles[0] * s, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompts(engine: LLMEngine) -> tuple[list[Any], list[Any]]:
    """(first wave, second wave) of ``(processed inputs, SamplingParams)``. The first wave is
    prefilled while nothing decodes; the second while its long-running request decodes."""
    mc = engine.config.model_config
    spec = mc.spec
    proc = engine.input_processor
    max_len = mc.max_model_len
    limit = mc.limit_images_per_prompt
    sentence = _sentence(engine)

    def filler(n: int) -> list[int]:
        return [sentence[i % len(sentence)] for i in range(n)]

    def length(n: int) -> int:  # room for the image token and two outputs
        return max(1, min(n, max_len - 8))

    def text(n: int) -> Any:
        return proc.build(filler(length(n)), None)

    def with_images(n: int, shapes: list[tuple[int, int]], seed: int) -> Any:
        ids = [spec.image_token_id] * len(shapes) + filler(length(n) - len(shapes))
        return proc.build(ids, [_image(spec, t, seed + i) for i, t in enumerate(shapes)])

    short = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    # Decodes while the second wave is encoded and prefilled (about 100 steps on the 11B
    # model), then is aborted; bounded so that a batch of one, where the second wave waits for
    # it, still finishes quickly.
    long_runner = SamplingParams(max_tokens=max(2, min(max_len - 40, 512)), ignore_eos=True,
                                 temperature=0.0)
    sampled = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_p=0.9,
                             top_k=20, min_p=0.01, seed=0, presence_penalty=0.1,
                             repetition_penalty=1.1, logprobs=2, prompt_logprobs=1)
    shapes = _tile_shapes(spec) if limit > 0 else []
    first: list[Any] = [(text(33), long_runner)]
    if shapes:
        first.append((with_images(40, shapes[:1], 0), short))
    # Text prompts of 1 token, a multiple of 16 and neither: Triton specialises integer
    # arguments on those cases.
    second: list[Any] = [(text(n), short) for n in (1, 64, 257)]
    second.append((text(48), sampled))
    # Every tile count through the spread encoder; text lengths on both sides of the
    # cross-attention's key-split steps (one query tile of 128, two, more).
    lengths = (17, 200, 300)
    for i in range(max(len(shapes), len(lengths) if shapes else 0)):
        second.append((with_images(lengths[i % 3], [shapes[i % len(shapes)]], i), short))
    if limit >= 2 and len(shapes) >= 2:
        second.append((with_images(60, shapes[:2], 99), short))
    sc = engine.config.scheduler_config
    if sc.enable_chunked_prefill:  # prompts over several chunks, with and without an image
        over = sc.max_num_batched_tokens + 77
        second.append((text(over), short))
        if shapes:
            second.append((with_images(over, shapes[:1], 7), short))
    return first, second


def warm_up_kernels(engine: LLMEngine) -> int:
    """The runner's part of the warm-up (no collectives, no engine calls): every text-layer
    GEMM at each padded prefill row count and the attention kernels' variants. Returns the
    number of GEMM calls. A tensor-parallel rank other than 0 runs only this: rank 0's
    warm-up requests reach it as rank 0's calls."""
    gemms = engine.runner.warm_up_prefill_gemms()
    engine.runner.warm_up_attention_kernels()
    return gemms


def warm_up(engine: LLMEngine) -> WarmupStats:
    """Runs the warm-up requests to completion on ``engine`` (which must be idle) and resets
    the runner's counters. Raises RuntimeError if the engine is busy or the loop overruns."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    t0 = time.perf_counter()
    gemms = warm_up_kernels(engine)
    first, second = _prompts(engine)
    engine.input_processor.image_cache.clear()  # the warm-up's random images: no one's
    ids = [f"{WARMUP_PREFIX}{i}" for i in range(len(first) + len(second))]
    for rid, (inputs, params) in zip(ids[:len(first)], first, strict=True):
        engine.add_request(rid, None, params, processed=inputs)
    runner_id = ids[0]
    pending = set(ids[1:])
    steps = 0

    def advance() -> None:
        nonlocal steps
        steps += 1
        if steps > _MAX_STEPS:
            raise RuntimeError(f"warm-up did not finish in {_MAX_STEPS} steps")
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error!r}")
            if out.finished:
                pending.discard(out.request_id)

    # The first wave is admitted while nothing decodes; once the long-running request has its
    # first token, the second wave arrives and is interleaved with its decode steps.
    while not engine.scheduler.running or engine.scheduler.waiting:
        advance()
    for rid, (inputs, params) in zip(ids[len(first):], second, strict=True):
        engine.add_request(rid, None, params, processed=inputs)
    while pending and engine.has_unfinished_requests():
        advance()
    engine.abort_request(runner_id)
    while engine.has_unfinished_requests():
        advance()
    engine.reset_prefix_cache()  # the warm-up's pages and cross groups: no one's
    engine.reset_counters()
    stats = WarmupStats(len(ids), steps, time.perf_counter() - t0, gemms)
    logger.info("Warm-up: %d prefill GEMMs, %d requests, %d steps in %.1f s",
                stats.prefill_gemms, stats.requests, stats.steps, stats.seconds)
    return stats
