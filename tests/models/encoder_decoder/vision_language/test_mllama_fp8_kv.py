"""``--kv-cache-dtype fp8`` / ``fp8_e5m2`` end to end against HF transformers whose text
attention reads FP8-rounded K/V (``helpers/hf_fp8_kv.py``, with the Meta-parity shim).

The engine's documented semantics (``vllm/attention/kv_cache_dtype.py``): every attention read
of K/V, prefill included, sees the values rounded to FP8 with scale 1.0. On CPU (float32) the
engine's logprobs agree with that reference to float32 rounding, which plain HF (no rounding)
misses by 1e-2 to 1e-1 on this model, so the tolerance tells the two apart. Covered: text
only, one, two and interleaved images, graphs and eager; prefill chunks that read their
context from FP8 pages; a cached second chat turn (FP8 self pages and a shared cross group).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.hf_fp8_kv import fp8_kv_attention
from helpers.hf_runner import demo_path, hf_greedy_logprobs, hf_inputs, load_hf_model
from PIL import Image

from vllm import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
MAX_TOKENS = 24
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# float32 on CPU: the agreed positions' logprobs within this (rounding-free HF: 1e-2..1e-1).
LOGPROB_TOL = 1e-3 if DTYPE == "float32" else None


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _with(prompt: str, *images: Image.Image) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": list(images)}}


PROMPTS = [
    "The color of the sky is blue but sometimes it can also be",
    _with("<|image|><|begin_of_text|>The meaning of the image is", _image(112, 56, 1)),
    _with("<|image|><|image|><|begin_of_text|>Describe 2 images.", _image(56, 56, 2),
          _image(224, 224, 3)),
    _with("<|begin_of_text|>Between the first image <|image|> and the second image<|image|>, "
          "which is which?", _image(60, 60, 4), _image(120, 50, 5)),
]


def _llm(kv: str, **kw) -> LLM:
    args = dict(model="demo/mllama-tiny", dtype=DTYPE, max_model_len=512, max_num_seqs=4,
                limit_mm_per_prompt={"image": 2}, kv_cache_dtype=kv)
    args.update(kw)
    return LLM(**args)


def _reference(llm: LLM, prompts: list, kv: str) -> list:
    engine = llm.llm_engine
    spec = engine.config.model_config.spec
    model = load_hf_model(str(demo_path()), getattr(torch, DTYPE), DEVICE)
    out = []
    with fp8_kv_attention(FP8[kv]):
        for p in prompts:
            processed = engine.process_inputs(p)
            kw = hf_inputs(processed.prompt_token_ids, processed.images, spec.image_token_id,
                           spec.vision.max_num_tiles, DEVICE, getattr(torch, DTYPE))
            out.append(hf_greedy_logprobs(model, kw, MAX_TOKENS, 5))
    return out


def _compare(llm: LLM, prompts: list, kv: str) -> list:
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               logprobs=5), use_tqdm=False)
    ours, ref = vllm_greedy(got), _reference(llm, prompts, kv)
    check_logprobs_close(ref, ours, "hf fp8 kv", "vllm")
    if LOGPROB_TOL is not None:
        for (ids_r, lps_r), (ids_o, lps_o) in zip(ref, ours, strict=True):
            for tr, to, lr, lo in zip(ids_r, ids_o, lps_r, lps_o, strict=False):
                if tr != to:
                    break
                assert abs(lr[tr] - lo[to]) < LOGPROB_TOL, (tr, lr[tr], lo[to])
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.runner.cache_engine.buffer.dtype == FP8[kv]
    if not engine.config.model_config.enforce_eager:
        assert engine.runner.stats.eager_decode_steps == 0
    return got


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_fp8_kv_matches_hf_reading_rounded_kv(kv: str, eager: bool) -> None:
    _compare(_llm(kv, enforce_eager=eager), PROMPTS, kv)


def test_prefill_chunks_and_a_cached_second_turn_read_fp8_pages() -> None:
    """A 64-token budget splits the prompts into chunks that read their context from the FP8
    pages; the second turn resends the first (image included) and finds its pages cached."""
    llm = _llm("fp8", enable_chunked_prefill=True, max_num_batched_tokens=64,
               enable_prefix_caching=True)
    first = _with("<|image|><|begin_of_text|>" + "A long story about the picture, " * 12,
                  _image(112, 112, 6))
    out = _compare(llm, [first, PROMPTS[0]], "fp8")
    pool = llm.llm_engine.block_manager.pool
    hits = pool.prefix_cache_hits
    second = _with(first["prompt"] + out[0].outputs[0].text + " And then?", _image(112, 112, 6))
    _compare(llm, [second], "fp8")
    assert pool.prefix_cache_hits > hits  # the second turn read cached FP8 pages
