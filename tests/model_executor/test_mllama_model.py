"""Prefill logits of our Mllama against HF transformers + the Meta-parity shim (CPU, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_runner import demo_path, hf_inputs, hf_prefill_logits, load_hf_model
from PIL import Image

from vllm.attention.backends.torch_attn import TorchBackend
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader.loader import get_model
from vllm.multimodal.processing import MllamaInputProcessor
from vllm.transformers_utils.config import DEFAULT_ASPECT_RATIOS, load_mllama_config
from vllm.transformers_utils.tokenizer import get_image_processor, get_tokenizer
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch, step_images

TOL = 1e-4
TILE = 56  # the tiny demo's tile size


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _ratio_image(ratio: tuple[int, int], seed: int) -> Image.Image:
    h, w = ratio  # (tiles high, tiles wide)
    return _image(TILE * w, TILE * h, seed)


CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text_only": ("The color of the sky is blue but sometimes it can also be", []),
    "two_leading": ("<|image|><|image|><|begin_of_text|>Describe 2 images.", [(1, 2), (2, 2)]),
    "three_leading": ("<|image|><|image|><|image|><|begin_of_text|>Describe 3 images.",
                      [(1, 1), (3, 1), (1, 4)]),
    "three_mid": ("<|begin_of_text|>Look at these <|image|><|image|><|image|> and compare",
                  [(2, 1), (1, 1), (1, 3)]),
    "interleaved": ("<|begin_of_text|>Between the first image <|image|> and the second "
                    "image<|image|>, which is a stop sign?", [(1, 2), (4, 1)]),
    "text_before": ("<|begin_of_text|>Text before the image <|image|> and after it.", [(2, 2)]),
}
for _i, _r in enumerate(DEFAULT_ASPECT_RATIOS):
    CASES[f"leading_{_r[0]}x{_r[1]}"] = ("<|image|><|begin_of_text|>The meaning of the image is",
                                         [_r])


class Ours:
    """Our model on CPU in fp32, with the prefill path used by the runner (no KV writes)."""

    def __init__(self) -> None:
        path = demo_path()
        self.spec = load_mllama_config(path)
        self.model = get_model(self.spec, path, "auto", torch.float32, torch.device("cpu"), 4096)
        backend = TorchBackend()
        selfs, crosses = self.model.attention_layers()
        for a in (*selfs, *crosses):
            a.backend = backend
        self.processor = MllamaInputProcessor(self.spec, get_tokenizer(path),
                                              get_image_processor(path), 4, 4096)

    def process(self, name: str):
        text, ratios = CASES[name]
        images = [_ratio_image(r, 10 * i + len(name)) for i, r in enumerate(ratios)]
        prompt = {"prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return self.processor.process(prompt)

    @torch.no_grad()
    def logits(self, processed: list, pad_rows: bool = False,
               pad_ids: int = 0) -> list[torch.Tensor]:
        """Per prompt [n, V]; ``pad_rows`` pads the step as the runner does, ``pad_ids``
        (nonzero) refills the padding rows with other tokens at other positions."""
        items = [PrefillItem(p.prompt_token_ids, p, i) for i, p in enumerate(processed)]
        batch = build_prefill_batch(items, 16, 16, torch.device("cpu"), pad_rows=pad_rows)
        real = sum(batch.metadata.seq_lens)
        if pad_ids:
            gen = torch.Generator().manual_seed(pad_ids)
            n = batch.input_ids.shape[0] - real
            batch.input_ids[real:] = torch.randint(0, self.spec.text.vocab_size, (n,),
                                                   generator=gen)
            batch.positions[real:] = torch.randint(0, 4096, (n,), generator=gen)
        vision = None
        images = step_images(items, torch.device("cpu"))
        if images is not None:
            vision = self.model.encode_images(images.pixel_values, images.aspect_ratio_ids,
                                              images.num_tiles)
        with set_forward_context(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions, vision)
        logits = self.model.compute_logits(hidden[:real])
        return list(torch.split(logits, batch.metadata.seq_lens))


@pytest.fixture(scope="module")
def ours() -> Ours:
    return Ours()


@pytest.fixture(scope="module")
def hf():
    return load_hf_model(str(demo_path()))


def _hf_logits(ours: Ours, hf, processed, shim: bool = True) -> torch.Tensor:
    kw = hf_inputs(processed.prompt_token_ids, processed.images, ours.spec.image_token_id,
                   ours.spec.vision.max_num_tiles)
    return hf_prefill_logits(hf, kw, shim=shim)


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_logits_match_reference(ours: Ours, hf, name: str) -> None:
    processed = ours.process(name)
    (mine,) = ours.logits([processed])
    ref = _hf_logits(ours, hf, processed)
    assert mine.shape == ref.shape
    assert torch.isfinite(mine).all()
    diff = (mine - ref).abs().max().item()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e}"


def test_aspect_ratio_ids_cover_all_ratios(ours: Ours) -> None:
    for i, r in enumerate(DEFAULT_ASPECT_RATIOS):
        images = ours.processor.process_images([_ratio_image(r, i)])
        assert images.aspect_ratio_ids.tolist() == [i + 1]
        assert images.num_tiles == [r[0] * r[1]]


def test_mixed_batch_equals_alone(ours: Ours) -> None:
    names = sorted(CASES)
    processed = [ours.process(n) for n in names]
    batched = ours.logits(processed)
    for name, p, b in zip(names, processed, batched, strict=True):
        (alone,) = ours.logits([p])
        diff = (alone - b).abs().max().item()
        assert diff <= TOL, f"{name}: batched vs alone differ by {diff:.2e}"


def test_padded_prefill_rows_match_reference(ours: Ours, hf) -> None:
    """The runner's padded step (rows up to prefill_rows): every real row matches HF, and the
    padding rows' contents cannot reach them (same shapes: bitwise equal)."""
    names = ["interleaved", "text_only", "two_leading"]
    processed = [ours.process(n) for n in names]
    total = sum(len(p.prompt_token_ids) for p in processed)
    assert total % 16, "the case must need padding rows"
    padded = ours.logits(processed, pad_rows=True)
    refilled = ours.logits(processed, pad_rows=True, pad_ids=7)
    for name, p, a, b in zip(names, processed, padded, refilled, strict=True):
        assert torch.equal(a, b), f"{name}: padding rows changed a real row"
        diff = (a - _hf_logits(ours, hf, p)).abs().max().item()
        assert diff <= TOL, f"{name}: padded step vs HF differ by {diff:.2e}"


@pytest.mark.parametrize("name", ["text_only", "interleaved"])
def test_padding_rows_see_nothing(ours: Ours, name: str) -> None:
    """Padding rows get no cache slot and no vision range, and sit outside every sequence."""
    p = ours.process(name)
    n = len(p.prompt_token_ids)
    batch = build_prefill_batch([PrefillItem(p.prompt_token_ids, p, 0, block_table=[3] * 9)],
                                16, 16, torch.device("cpu"), pad_rows=True)
    md = batch.metadata
    rows = batch.input_ids.shape[0]
    assert rows > n and rows % 16 == 0 and md.num_tokens == rows
    assert md.seq_lens == [n]
    assert (md.slot_mapping[n:] == -1).all() and (md.slot_mapping[:n] >= 0).all()
    assert (md.cross_kv_ranges[n:] == 0).all() and md.cross_kv_ranges.shape[0] == rows
    assert all(q1 <= n for _, q1, _, _ in md.cross_range_runs)
    assert batch.logits_indices.tolist() == [n - 1]


@pytest.mark.parametrize("name", ["text_before", "leading_1x1", "interleaved"])
def test_shim_matters(ours: Ours, hf, name: str) -> None:
    """Plain HF (>= 4.56) differs from Meta's semantics on these prompts; the shim fixes it."""
    processed = ours.process(name)
    (mine,) = ours.logits([processed])
    plain = _hf_logits(ours, hf, processed, shim=False)
    assert (mine - plain).abs().max().item() > 1e-2


def test_text_before_image_equals_text_only_prefix(ours: Ours) -> None:
    """Tokens before the first image see nothing: their logits equal the image-free run's."""
    processed = ours.process("text_before")
    (with_image,) = ours.logits([processed])
    first_image = processed.prompt_token_ids.index(ours.spec.image_token_id)
    prefix = ours.processor.build(processed.prompt_token_ids[:first_image], None)
    (text_only,) = ours.logits([prefix])
    # Not bitwise: the two steps' GEMMs have different row counts, and some CPU BLAS builds
    # block (and so sum) differently by row count (docs/architecture.md's equality contract).
    torch.testing.assert_close(with_image[:first_image], text_only, atol=1e-5, rtol=1e-5)
