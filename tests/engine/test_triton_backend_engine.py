"""The Triton attention back-end inside the engine, against the torch reference back-end.

On CPU the kernels run in Triton's interpreter with its bounds checks (``tests/conftest.py``):
paged KV writes with RoPE, causal and ranged-cross prefill, paged self and cross decode over
padded graph batches, with interleaved and spread prefills and two images in one prompt. (On
CUDA the engine always runs this back-end, compared with HF by the model tests.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from PIL import Image

from vllm import LLM, SamplingParams

pytest.importorskip("triton")


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (70, 120, 3), dtype=np.uint8))


def _llm(backend: str, monkeypatch) -> LLM:
    import vllm.worker.model_runner as model_runner
    from vllm.attention.backends.torch_ref import TorchReferenceBackend
    from vllm.attention.backends.triton_attn import TritonBackend

    make = {"triton": lambda device: TritonBackend(prefill="triton"),
            "torch": lambda device: TorchReferenceBackend()}[backend]
    monkeypatch.setattr(model_runner, "get_attn_backend", make)
    return LLM(model="demo/mllama-tiny", max_model_len=256, max_num_seqs=4,
               limit_mm_per_prompt={"image": 2}, decode_interleave_tokens=256,
               encoder_layers_per_step=2, prefill_layers_per_step=2,
               dtype="float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's checks are CPU-only")
def test_triton_backend_matches_reference_in_the_engine(monkeypatch) -> None:
    prompts = [
        "A text request",
        {"prompt": "<|image|><|begin_of_text|>What is it",
         "multi_modal_data": {"image": _image(0)}},
        {"prompt": "<|image|><|image|><|begin_of_text|>Two of them",
         "multi_modal_data": {"image": [_image(1), _image(2)]}},
    ]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    outs = {}
    for backend in ("torch", "triton"):
        llm = _llm(backend, monkeypatch)
        engine = llm.llm_engine
        kind = type(engine.runner.model.language_model.model.layers[0].self_attn.attn.backend)
        expected = {"torch": "TorchReferenceBackend", "triton": "TritonBackend"}[backend]
        assert kind.__name__ == expected
        # Staggered arrivals: decode steps run between (and during spread) prefills.
        engine.add_request("0", prompts[0], params)
        engine.step()
        engine.step()
        engine.add_request("1", prompts[1], params)
        engine.add_request("2", prompts[2], params)
        done = {}
        for _ in range(100):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            if not engine.has_unfinished_requests():
                break
        assert sorted(done) == ["0", "1", "2"] and all(o.error is None for o in done.values())
        outs[backend] = vllm_greedy([done[k] for k in ("0", "1", "2")])
        del llm, engine
    check_logprobs_close(outs["torch"], outs["triton"], "torch_ref", "triton")
