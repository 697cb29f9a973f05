"""The model's whole context (131072 tokens) with chunked prefill, on the tiny model (CPU): the
memory profile stays within the per-step budgets whatever max_model_len is, a context that
cannot fit the KV pool is refused with the largest max_model_len that fits, and start-up time
is reported split into its phases."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from vllm.engine.arg_utils import DEFAULT_CHUNKED_BATCHED_TOKENS, EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.worker import memory
from vllm.worker.loaded_model import load_model

FULL = 131072  # the model's max_position_embeddings


def _config(max_model_len: int, batched: int, **kw):
    return EngineArgs(
        model="demo/mllama-tiny",
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        max_num_batched_tokens=batched,
        **kw,
    ).create_engine_config()


@pytest.mark.parametrize(("batched", "max_num_seqs", "images"), [(512, 256, 1), (64, 4, 2)])
def test_profile_never_builds_a_step_larger_than_the_budget(
    monkeypatch, batched: int, max_num_seqs: int, images: int
) -> None:
    """With max_model_len at the model's full 131072 the profile's forward (the text decoder
    and the vision tower) sees at most the token budget and the per-step image budget: the
    memory it measures is that of a real step, not of a max_model_len-long prefill."""
    cfg = _config(FULL, batched, max_num_seqs=max_num_seqs, limit_mm_per_prompt={"image": images})
    assert cfg.model_config.max_model_len == FULL
    loaded = load_model(cfg)
    tokens: list[int] = []
    tiles: list[int] = []
    forward = MllamaForConditionalGeneration.forward
    encode = MllamaForConditionalGeneration.encode_images

    def counted_forward(self, input_ids, *args, **kwargs):
        tokens.append(int(input_ids.shape[0]))
        return forward(self, input_ids, *args, **kwargs)

    def counted_encode(self, pixel_values, *args, **kwargs):
        tiles.append(int(pixel_values.shape[0] * pixel_values.shape[1]))
        return encode(self, pixel_values, *args, **kwargs)

    monkeypatch.setattr(MllamaForConditionalGeneration, "forward", counted_forward)
    monkeypatch.setattr(MllamaForConditionalGeneration, "encode_images", counted_encode)
    logits = memory.run_profile_prefill(cfg, loaded.model, loaded.layout)
    assert torch.isfinite(logits).all()
    assert tokens and max(tokens) <= cfg.scheduler_config.max_num_batched_tokens
    assert tiles and max(tiles) <= cfg.scheduler_config.max_num_encoder_tiles
    # Still the budget's worst case, not a smaller step.
    assert max(tokens) > batched // 2
    # The activation estimate the pre-load check uses does not grow with the context either.
    short = _config(4096, batched, max_num_seqs=max_num_seqs, limit_mm_per_prompt={"image": images})
    assert memory.prefill_activation_estimate(cfg) == memory.prefill_activation_estimate(short)


def test_default_max_model_len_is_the_models_full_context_with_chunking() -> None:
    """No --max-model-len on a GPU: the model's max_position_embeddings; the default token
    budget stays the serving default (no longer tied to max_model_len with chunked prefill)."""
    args = EngineArgs(model="demo/mllama-tiny")
    assert args._max_model_len(FULL, torch.device("cuda")) == FULL
    sched = args._scheduler_config(FULL, 1, 4)
    assert sched.enable_chunked_prefill
    assert sched.max_num_batched_tokens == DEFAULT_CHUNKED_BATCHED_TOKENS < FULL


def _small_pool(max_model_len: int, pool_tokens: int):
    # The CPU pool's size is set in bytes; on a GPU it follows the card's memory.
    cfg = _config(max_model_len, 64, max_num_seqs=2, limit_mm_per_prompt={"image": 1}, device="cpu")
    lo = memory.PageLayout.for_model(
        cfg.model_config.spec, cfg.cache_config.block_size, cfg.model_config.dtype
    )
    cross = lo.cross_pages_for_tokens(cfg.model_config.max_encoder_seq_len)
    space = (lo.pages_for_tokens(pool_tokens) + cross) * lo.page_bytes
    cache = dataclasses.replace(cfg.cache_config, cpu_kv_cache_space_bytes=space)
    return dataclasses.replace(cfg, cache_config=cache)


def test_context_that_does_not_fit_is_refused_with_the_largest_that_fits() -> None:
    """A KV pool with room for 1000 tokens (and the image's cross pages) under a 131072-token
    max_model_len: a ValueError at engine construction naming the flags and the largest
    max_model_len that fits; an engine with that value builds and serves a prompt as long,
    and one a page longer is refused again."""
    with pytest.raises(ValueError) as exc:
        LLMEngine(_small_pool(FULL, 1000))
    msg = str(exc.value)
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--quantization"):
        assert flag in msg
    fit = int(re.search(r"largest max_model_len that fits is (\d+)", msg).group(1))
    assert 1000 - 16 < fit <= 1000 + 15 and fit % 16 == 0
    engine = LLMEngine(_small_pool(fit, 1000))
    assert engine.config.model_config.max_model_len == fit
    from vllm import SamplingParams

    engine.add_request(
        "long",
        {"prompt_token_ids": [5] * (fit - 2)},
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    )
    done = []
    for _ in range(100):
        done += [o for o in engine.step() if o.finished]
        if done:
            break
    assert done and len(done[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=f"largest max_model_len that fits is {fit}"):
        LLMEngine(_small_pool(fit + 16, 1000))


def test_serve_exits_with_one_line_when_the_context_does_not_fit() -> None:
    """`vllm serve` with a pool of 20 pages under --max-model-len 4096: the engine's refusal
    becomes one line (SystemExit with the message, no traceback), naming the largest fit."""
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.openai.api_server import run_server

    args = make_parser().parse_args(
        [
            "serve",
            "demo/mllama-tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--max-model-len",
            "4096",
            "--num-gpu-blocks-override",
            "20",
        ]
    )
    with pytest.raises(SystemExit) as exc:
        run_server(args)
    line = exc.value.code
    assert isinstance(line, str) and "\n" not in line
    assert line.startswith("Error: max_model_len 4096 does not fit in the KV cache")
    assert "--num-gpu-blocks-override 20" in line
    cross = re.search(r"largest max_model_len that fits is (\d+)", line)
    assert cross is not None and 0 < int(cross.group(1)) <= 20 * 16


def test_startup_times_are_reported_split(caplog) -> None:
    """The engine keeps its start-up split (benchmarks read it) and logs it in one line: every
    part present, non-negative, and together at most the total."""
    cfg = _config(
        256, 32, max_num_seqs=2, limit_mm_per_prompt={"image": 1}, encoder_layers_per_step=4
    )
    with caplog.at_level(logging.INFO, logger="vllm"):
        engine = LLMEngine(cfg, warmup=True)
    times = engine.startup_times
    parts = times.parts()
    assert set(parts) == {"load", "vision graphs", "profile", "decode graphs", "warm-up"}
    assert all(v >= 0 for v in parts.values())
    assert times.load > 0 and times.warmup > 0
    assert sum(parts.values()) <= times.total
    lines = [r.getMessage() for r in caplog.records if "Start-up took" in r.getMessage()]
    assert len(lines) == 1
    assert all(f"{name} " in lines[0] for name in parts)


def test_full_context_chunk_gather_is_reserved(monkeypatch) -> None:
    """A chunk that continues a 131072-token context gathers its layer's keys and values from
    the pages, which the profile (chunks without context) does not measure: the reserve holds
    them (and a transient copy), and the pre-load check counts it: a GPU with room for the
    profile's step but not for the gather is refused, naming max_model_len."""
    from vllm.attention.metadata import ContextGroup
    from vllm.attention.ops import sdpa

    cfg = _config(FULL, 64, max_num_seqs=2, limit_mm_per_prompt={"image": 1})
    t = cfg.model_config.spec.text
    lo = memory.PageLayout.for_model(cfg.model_config.spec, 16, cfg.model_config.dtype)
    pages = lo.pages_for_tokens(FULL)
    cache = torch.zeros(
        pages + 1, t.num_key_value_heads, 16, t.head_dim, dtype=cfg.model_config.dtype
    )
    gathered: list[int] = []

    def record(query, k, v, group, scale, out) -> None:
        gathered.append(k.nbytes + v.nbytes)

    n = 16
    q = torch.zeros(n, t.num_attention_heads, t.head_dim, dtype=cfg.model_config.dtype)
    kv = torch.zeros(n, t.num_key_value_heads, t.head_dim, dtype=cfg.model_config.dtype)
    group = ContextGroup(
        torch.arange(1, pages + 1), [(0, n, 0, FULL)], torch.zeros(n, 2, dtype=torch.int32)
    )
    sdpa.varlen_causal_attention(q, kv, kv, [n], 1.0, [FULL - n], [group], (cache, cache), record)
    reserve = memory.context_gather_bytes(cfg)
    assert gathered and reserve >= 1.5 * gathered[0]
    whole = EngineArgs(
        model="demo/mllama-tiny",
        max_model_len=FULL,
        enable_chunked_prefill=False,
        max_num_batched_tokens=FULL,
    ).create_engine_config()
    assert memory.context_gather_bytes(whole) == 0  # prompts whole: no chunk has context
    need = memory.weight_bytes(cfg) + memory.prefill_activation_estimate(cfg)
    util = cfg.cache_config.gpu_memory_utilization
    memory.check_device_memory(cfg, int((need + reserve + 1024) / util) + 1)
    with pytest.raises(ValueError, match="at max_model_len 131072"):
        memory.check_device_memory(cfg, int((need + reserve // 2) / util))


def test_concurrency_is_what_the_pool_holds() -> None:
    """The 90B layout (80 self layers, 20 cross: 16-token self pages, 64-token cross pages):
    a 2048-token request with one 4-tile image (6,404 vision tokens) takes 128 + 101 pages,
    so 1,832 usable pages hold 8 of them; the engine's "maximum concurrency" counts
    max_model_len sequences with a full image group the same way."""
    layout = memory.PageLayout(80, 20, 8, 128, 16, 64, torch.bfloat16)
    assert memory.requests_that_fit(layout, 1833, 2048, 6404) == 8
    assert memory.requests_that_fit(layout, 1833 + 228, 2048, 6404) == 8
    assert memory.requests_that_fit(layout, 1833 + 229, 2048, 6404) == 9
    cfg = _config(2048, 2048, limit_mm_per_prompt={"image": 1})
    tiny = memory.PageLayout.for_model(cfg.model_config.spec, 16, torch.float32)
    need = tiny.pages_for_tokens(2048) + tiny.cross_pages_for_tokens(
        cfg.model_config.max_encoder_seq_len
    )
    assert memory.max_concurrency(cfg, tiny, 1 + 3 * need) == 3.0


def test_engine_logs_its_maximum_concurrency(caplog) -> None:
    cfg = _config(256, 64, max_num_seqs=2, limit_mm_per_prompt={"image": 1})
    with caplog.at_level(logging.INFO, logger="vllm"):
        engine = LLMEngine(cfg)
    want = memory.max_concurrency(cfg, engine.runner.layout, engine.block_manager.pool.num_pages)
    lines = [r.getMessage() for r in caplog.records if "Maximum concurrency" in r.getMessage()]
    assert lines == [f"Maximum concurrency for 256 tokens per request with 1 image(s): {want:.2f}x"]
    assert want >= 1.0
