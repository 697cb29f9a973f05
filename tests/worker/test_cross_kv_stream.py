"""The cross layers' vision K/V projected one layer ahead (on CUDA on a side stream).

On every device the text model projects the next cross layer's K/V before the cross layer in
front of it runs; on CUDA that projection runs on a side stream. These tests check the order
(one layer ahead, never more) on any device, and on CUDA that the side stream changes no bit
of the outputs, also when the side stream is made to lag far behind the main stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.model_executor.models import mllama
from vllm.model_executor.models.mllama import MllamaCrossAttention

DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


PROMPTS = [
    {"prompt": "<|image|><|begin_of_text|>Describe the picture:",
     "multi_modal_data": {"image": _image(80, 56, 1)}},
    "A text-only prompt in the same batch",
    {"prompt": "<|begin_of_text|>Two of them <|image|> and <|image|>, compare",
     "multi_modal_data": {"image": [_image(56, 112, 2), _image(112, 112, 3)]}},
]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="demo/mllama-tiny", dtype=DTYPE, max_model_len=256, max_num_seqs=4)


def _text_model(llm: LLM):
    return llm.llm_engine.runner.model.language_model.model


def _outputs(llm: LLM) -> list[tuple[list[int], list]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def test_projected_one_layer_ahead(llm: LLM, monkeypatch) -> None:
    """Each cross layer's K/V exists before the layer runs, at most one more ahead."""
    text = _text_model(llm)
    ids = text.cross_layer_ids
    assert len(ids) >= 2
    events: list[tuple[str, int]] = []
    owner = {id(text.layers[i].cross_attn): i for i in ids}
    real = MllamaCrossAttention.project_kv

    def project(self, vision):
        events.append(("project", owner[id(self)]))
        return real(self, vision)

    monkeypatch.setattr(MllamaCrossAttention, "project_kv", project)
    hooks = [text.layers[i].register_forward_pre_hook(
        lambda m, a, i=i: events.append(("layer", i))) for i in ids]
    try:
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    projected = [i for k, i in events if k == "project"]
    assert projected == ids  # each layer's K/V projected once (in the prefill), in order
    layer_at = [n for n, (k, _) in enumerate(events) if k == "layer"]
    assert len(layer_at) > len(ids)  # the decode steps ran the cross layers too
    for j, n in enumerate(layer_at[:len(ids)]):  # the prefill's cross layers
        before = sum(1 for k, _ in events[:n] if k == "project")
        assert before == min(j + 2, len(ids)), events


@cuda_only
def test_side_stream_changes_no_bit(llm: LLM, monkeypatch) -> None:
    text = _text_model(llm)
    used = []
    real_side = mllama._side_stream
    monkeypatch.setattr(mllama, "_side_stream", lambda d: used.append(d) or real_side(d))
    assert text.cross_kv_side_stream
    with_side = _outputs(llm)
    assert used, "the side stream was not used"
    text.cross_kv_side_stream = False
    try:
        used.clear()
        in_line = _outputs(llm)
        assert not used
    finally:
        text.cross_kv_side_stream = True
    assert with_side == in_line


@cuda_only
def test_lagging_side_stream_is_waited_for(llm: LLM, monkeypatch) -> None:
    """The side stream spins ~10 ms before each projection: the main stream must wait for
    it (a missing wait reads K/V not yet written, or freed memory)."""
    text = _text_model(llm)
    text.cross_kv_side_stream = False
    try:
        reference = _outputs(llm)
    finally:
        text.cross_kv_side_stream = True
    real = MllamaCrossAttention.project_kv

    def slow(self, vision):
        torch.cuda._sleep(20_000_000)  # on the current (side) stream
        return real(self, vision)

    monkeypatch.setattr(MllamaCrossAttention, "project_kv", slow)
    assert _outputs(llm) == reference
