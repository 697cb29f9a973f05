"""The engine's Triton kernels at their real call sites, against the torch reference (CPU).

On CPU the kernels run in Triton's interpreter with its bounds checks (``tests/conftest.py``):
an out-of-bounds load or store fails the test. The scenario mixes a text request, an image
request and a two-image request with chunked prefills next to decodes, so paged KV writes
with RoPE, causal, chunk-after-context and ranged-cross prefill, and paged self and cross
decode over padded graph batches all run. The second test also takes every CUDA-only code
path of the model (fused norms, vision embedding, SiLU, row advance, in-graph argmax,
key-split cross prefill with an H200's SM count) by choosing the fused kernels at load on
CPU. (On CUDA the engine runs these kernels anyway, compared with HF by the model tests.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.cuda_paths import use_fused_kernels
from PIL import Image

from vllm import LLM, SamplingParams

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the interpreter's checks are CPU-only")


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (70, 120, 3), dtype=np.uint8))


PROMPTS = [
    "A text request",
    {"prompt": "<|image|><|begin_of_text|>What is it", "multi_modal_data": {"image": _image(0)}},
    {"prompt": "<|image|><|image|><|begin_of_text|>Two of them",
     "multi_modal_data": {"image": [_image(1), _image(2)]}},
]


def _run(backend: str, monkeypatch, fused: bool = False) -> list:
    from vllm.attention.backends.torch_attn import TorchBackend
    from vllm.attention.backends.triton_attn import TritonBackend
    from vllm.worker import loaded_model

    if fused:
        use_fused_kernels(monkeypatch)
    else:
        make = {"triton": lambda device: TritonBackend(),
                "torch": lambda device: TorchBackend()}[backend]
        monkeypatch.setattr(loaded_model, "get_attn_backend", make)
    llm = LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=4, dtype="float32",
              limit_mm_per_prompt={"image": 2}, enable_chunked_prefill=True,
              max_num_batched_tokens=8, encoder_layers_per_step=2)
    engine = llm.llm_engine
    kind = type(engine.runner.model.language_model.model.layers[0].self_attn.attn.backend)
    assert kind is (TorchBackend if backend == "torch" else TritonBackend)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    # Staggered arrivals: decode steps run next to the others' prefill chunks.
    engine.add_request("0", PROMPTS[0], params)
    engine.step()
    engine.step()
    engine.add_request("1", PROMPTS[1], params)
    engine.add_request("2", PROMPTS[2], params)
    done = {}
    for _ in range(100):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    monkeypatch.undo()
    assert sorted(done) == ["0", "1", "2"] and all(o.error is None for o in done.values())
    return vllm_greedy([done[k] for k in ("0", "1", "2")])


@pytest.fixture(scope="module")
def reference() -> list:
    with pytest.MonkeyPatch.context() as mp:
        return _run("torch", mp)


def test_triton_attention_backend_matches_reference(reference, monkeypatch) -> None:
    check_logprobs_close(reference, _run("triton", monkeypatch), "torch", "triton")


def test_cuda_code_paths_match_reference(reference, monkeypatch) -> None:
    from triton.runtime import interpreter

    launched = set()
    init = interpreter.GridExecutor._init_args_hst

    def record(self, args, kwargs):
        launched.add(self.fn.__name__)
        return init(self, args, kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", record)
    out = _run("triton", monkeypatch, fused=True)
    check_logprobs_close(reference, out, "torch", "cuda paths")
    assert {"_vision_embed_kernel", "_add_layer_norm_kernel", "_rms_norm_kernel",
            "_rope_kv_write_kernel", "_silu_and_mul_kernel", "_argmax_tiles_kernel",
            "_advance_rows_kernel", "_gather_rows_kernel", "_decode_segment_kernel",
            "_ranged_cross_kernel", "_split_combine_kernel"} <= launched, launched
