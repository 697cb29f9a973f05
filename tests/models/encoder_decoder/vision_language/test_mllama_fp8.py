"""FP8 checkpoints: ``vllm.LLM`` against HF transformers running the same folder decompressed.

The folders are written by compressed-tensors from the tiny demo checkpoint
(``helpers/fp8_checkpoints.py``): the published layout (FP8_DYNAMIC, vision tower, projector and
LM head in bf16), the same with one cross-attention layer kept in bf16, and per-tensor float32
scales with static input scales (dropped: weight-only). Batched prompts with 0, 1 and 2 images
decode through the CPU graph path and eagerly; greedy tokens and logprobs are compared with
``check_logprobs_close``. The HF side runs each prompt alone with the Meta-parity shim, on the
weights compressed-tensors decompresses (``CompressedTensorsConfig(dequantize=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")  # the checkpoints are written by it
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.cuda_paths import use_fused_kernels
from helpers.fp8_checkpoints import load_hf_fp8_model
from helpers.hf_runner import hf_greedy_logprobs, hf_inputs
from helpers.no_sync import NoHostSync
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization.fp8 import Fp8Format

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
DTYPES = {
    "fp8-dynamic": "bfloat16",
    "fp8-keep-cross": "bfloat16",
    "fp8-tensor": "float32",
    "fp8-all": "bfloat16",
}


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
def hf_reference(fp8_checkpoint: Callable[[str], Path]) -> Callable[[str, LLM], list]:
    """``(name, llm) -> HF greedy outputs`` for a checkpoint variant, computed once: the
    reference does not depend on how the engine decodes."""
    done: dict[str, list] = {}

    def get(name: str, llm: LLM) -> list:
        if name not in done:
            dtype = getattr(torch, DTYPES[name])
            model = load_hf_fp8_model(fp8_checkpoint(name), dtype)
            done[name] = _hf_reference(llm, model, dtype)
        return done[name]

    return get


# Both decode paths on the published layout; the graph path on the others.
CASES = [
    ("fp8-dynamic", False),
    ("fp8-dynamic", True),
    ("fp8-keep-cross", False),
    ("fp8-tensor", False),
    ("fp8-all", False),
]


@pytest.mark.parametrize(
    ("name", "eager"), CASES, ids=[f"{n}-{'eager' if e else 'graphs'}" for n, e in CASES]
)
def test_fp8_checkpoint_matches_hf(name: str, eager: bool, fp8_checkpoint, hf_reference) -> None:
    dtype = DTYPES[name]
    llm = LLM(
        model=str(fp8_checkpoint(name)),
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2},
        enforce_eager=eager,
    )
    engine = llm.llm_engine
    assert engine.config.model_config.quantization == "compressed-tensors"  # from config.json
    model = engine.runner.model
    quantized = [
        m for m in model.modules() if isinstance(m, Linear) and isinstance(m.fmt, Fp8Format)
    ]
    cross = model.language_model.model.layers[3].cross_attn  # FP8 in every variant
    assert cross.kv_proj in quantized and model.language_model.lm_head not in quantized
    vision = [m for m in model.vision_model.modules() if m in quantized]
    assert bool(vision) == (name == "fp8-all")
    launch = engine.runner.launch

    def strict_launch(*args: object) -> object:  # the FP8 torch path reads nothing on the host
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
    if fused:  # the FP8 GEMM for the decode bucket, the dequantized scratch for the rest
        assert kinds == ["linear_kernel", "Fp8Format"]
        assert mlp.gate_up_proj._silu_kernels[0] is not None
    outputs = llm.generate(
        PROMPTS[:2],
        SamplingParams(temperature=0, max_tokens=3, logprobs=NUM_LOGPROBS),
        use_tqdm=False,
    )
    assert llm.llm_engine.runner.stats.eager_decode_steps == 0
    monkeypatch.undo()
    return vllm_greedy(outputs)


def test_fused_kernels_on_cpu_match_the_torch_path(fp8_checkpoint, monkeypatch) -> None:
    """The CUDA code path run on the CPU in Triton's interpreter with its bounds checks: the
    FP8 decode GEMMs (the SiLU epilogue for gate|up) inside the emulated graphs of both
    families, prefill and the (here FP8) vision tower through the dequantized scratch, against
    the torch path. (In float32: the interpreter truncates float32 to bfloat16, which no GPU
    does.)"""
    path = str(fp8_checkpoint("fp8-all"))
    reference = _run(path, monkeypatch, fused=False)
    check_logprobs_close(reference, _run(path, monkeypatch, fused=True), "torch", "triton")
