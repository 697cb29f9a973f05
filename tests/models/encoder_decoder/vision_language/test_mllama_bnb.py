"""bitsandbytes 4-bit checkpoints: ``vllm.LLM`` against HF transformers running the same folder.

The folders are written by transformers + bitsandbytes from the tiny demo checkpoint
(``helpers/bnb_checkpoints.py``): NF4 with everything transformers quantizes by default, NF4
with a skip list, FP4 with float32 block scales, NF4 with fp16 compute. Batched prompts with 0,
1 and 2 images decode through the CPU graph path (and eagerly for two of them); greedy tokens
and logprobs are compared with ``check_logprobs_close``. The HF side runs each prompt alone with
the Meta-parity shim, on bitsandbytes' portable CPU forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("bitsandbytes")  # the checkpoints are written by it (a test dependency)
from helpers.bnb_checkpoints import load_hf_bnb_model
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.cuda_paths import use_fused_kernels
from helpers.hf_runner import hf_greedy_logprobs, hf_inputs
from helpers.no_sync import NoHostSync
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization.bitsandbytes import Bnb4bitFormat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU checkpoints and reference")

MAX_TOKENS = 8
NUM_LOGPROBS = 5


@cache
def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed * 7919 + w * 31 + h)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


PROMPTS = [
    "The color of the sky is blue but sometimes it can also be",
    {
        "prompt": "<|image|><|begin_of_text|>The meaning of the image is",
        "multi_modal_data": {"image": [_image(112, 56, 1)]},
    },
    {
        "prompt": "<|image|><|image|><|begin_of_text|>Describe 2 images.",
        "multi_modal_data": {"image": [_image(56, 56, 2), _image(224, 224, 3)]},
    },
]
DTYPES = {"nf4": "bfloat16", "nf4-skip": "bfloat16", "fp4": "bfloat16", "nf4-fp16": "float16"}


def _hf_reference(llm: LLM, model: torch.nn.Module, dtype: torch.dtype) -> list:
    engine = llm.llm_engine
    spec = engine.config.model_config.spec
    out = []
    for p in PROMPTS:
        processed = engine.process_inputs(p)
        kw = hf_inputs(
            processed.prompt_token_ids,
            processed.images,
            spec.image_token_id,
            spec.vision.max_num_tiles,
            "cpu",
            dtype,
        )
        out.append(hf_greedy_logprobs(model, kw, MAX_TOKENS, NUM_LOGPROBS))
    return out


@pytest.fixture(scope="module")
def hf_reference(bnb_checkpoint: Callable[[str], Path]) -> Callable[[str, LLM], list]:
    """``(name, llm) -> HF greedy outputs`` for a checkpoint variant, computed once: the
    reference does not depend on how the engine decodes."""
    done: dict[str, list] = {}

    def get(name: str, llm: LLM) -> list:
        if name not in done:
            dtype = getattr(torch, DTYPES[name])
            model = load_hf_bnb_model(bnb_checkpoint(name), dtype)
            done[name] = _hf_reference(llm, model, dtype)
        return done[name]

    return get


# Both decode paths on the double-quantized NF4 folder, and the float32-scale FP4 folder eager;
# the graph path on the others.
CASES = [("nf4", False), ("nf4", True), ("nf4-skip", False), ("fp4", True), ("nf4-fp16", False)]


@pytest.mark.parametrize(
    ("name", "eager"), CASES, ids=[f"{n}-{'eager' if e else 'graphs'}" for n, e in CASES]
)
def test_bnb_checkpoint_matches_hf(name: str, eager: bool, bnb_checkpoint, hf_reference) -> None:
    dtype = DTYPES[name]
    llm = LLM(
        model=str(bnb_checkpoint(name)),
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2},
        enforce_eager=eager,
    )
    engine = llm.llm_engine
    assert engine.config.model_config.quantization == "bitsandbytes"  # from config.json
    model = engine.runner.model
    quantized = [
        m for m in model.modules() if isinstance(m, Linear) and isinstance(m.fmt, Bnb4bitFormat)
    ]
    vision = [m for m in model.vision_model.modules() if m in quantized]
    assert vision and model.language_model.lm_head not in quantized
    launch = engine.runner.launch

    def strict_launch(*args: object) -> object:  # the 4-bit torch path reads nothing on the host
        with NoHostSync():
            return launch(*args)

    engine.runner.launch = strict_launch
    outputs = llm.generate(
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=NUM_LOGPROBS),
        use_tqdm=False,
    )
    check_logprobs_close(hf_reference(name, llm), vllm_greedy(outputs), "hf", "vllm")
    if not eager:
        assert engine.runner.stats.eager_decode_steps == 0  # every decode step replayed
    engine.check_integrity()


def _run(path: str, monkeypatch, fused: bool) -> list:
    if fused:
        use_fused_kernels(monkeypatch)
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2},
        cuda_graph_sizes=[4],
    )
    mlp = llm.llm_engine.runner.model.language_model.model.layers[0].mlp
    kinds = [k.__qualname__.split(".")[0] for k in mlp.gate_up_proj._kernels]
    if fused:  # the 4-bit GEMM for the decode bucket, the dequantized scratch for the rest
        assert kinds == ["linear_kernel", "Bnb4bitFormat"]
        assert mlp.gate_up_proj._silu_kernels[0] is not None
    outputs = llm.generate(
        PROMPTS[:1],
        SamplingParams(temperature=0, max_tokens=3, logprobs=NUM_LOGPROBS),
        use_tqdm=False,
    )
    assert llm.llm_engine.runner.stats.eager_decode_steps == 0
    monkeypatch.undo()
    return vllm_greedy(outputs)


def test_fused_kernels_on_cpu_match_the_torch_path(bnb_checkpoint, monkeypatch) -> None:
    """The CUDA code path run on the CPU in Triton's interpreter with its bounds checks: the
    4-bit decode GEMMs (the SiLU epilogue for gate|up) inside the emulated graphs, prefill and
    the vision tower through the dequantized scratch, against the torch path. (In float32:
    the interpreter truncates float32 to bfloat16, which no GPU does.)"""
    path = str(bnb_checkpoint("nf4"))
    reference = _run(path, monkeypatch, fused=False)
    check_logprobs_close(reference, _run(path, monkeypatch, fused=True), "torch", "triton")
