"""Encoding images a few layers at a time gives bitwise the tokens of one call (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_runner import demo_path

from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.mllama_vision import ImagesEncoding
from vllm.transformers_utils.config import load_mllama_config


@pytest.fixture(scope="module")
def model():
    path = demo_path()
    spec = load_mllama_config(path)
    return get_model(spec, path, "auto", torch.float32, torch.device("cpu"), max_position=256)


def _pixels(num_images: int, spec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = spec.vision
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(num_images, v.max_num_tiles, v.num_channels, v.image_size,
                         v.image_size, generator=g)
    ar_ids = torch.randint(1, len(v.supported_aspect_ratios) + 1, (num_images,), generator=g)
    return pixels, ar_ids


@pytest.mark.parametrize("num_tiles", [[4], [1, 3], [2, 2, 1], [3, 1, 3]])
@pytest.mark.parametrize("budget", [1, 2, 5, 1000])
@torch.inference_mode()
def test_chunked_equals_one_call(model, num_tiles: list[int], budget: int) -> None:
    vm = model.vision_model
    pixels, ar_ids = _pixels(len(num_tiles), model.spec, seed=len(num_tiles) * 7 + budget)
    whole = vm(pixels, ar_ids, num_tiles)
    enc = ImagesEncoding(vm, pixels, ar_ids, num_tiles)
    layers = len(vm.transformer.layers) + len(vm.global_transformer.layers)
    assert enc.remaining_layers() == layers * len(num_tiles)
    calls = 0
    while not enc.advance(budget):
        calls += 1
        assert calls < 1000
        with pytest.raises(AssertionError):
            enc.output()  # not finished
    assert enc.remaining_layers() == 0
    if budget < layers:
        assert calls > 0  # it did take several steps
    assert torch.equal(enc.output(), whole)


@torch.inference_mode()
def test_budget_bounds_the_work_per_call(model) -> None:
    """A call runs at most ``budget`` image-layers, and always some work."""
    vm = model.vision_model
    pixels, ar_ids = _pixels(3, model.spec, seed=3)
    enc = ImagesEncoding(vm, pixels, ar_ids, [2, 2, 4])  # groups of 2 and 1 images
    before = enc.remaining_layers()
    while not enc.done:
        enc.advance(3)
        after = enc.remaining_layers()
        assert 1 <= before - after <= 3
        before = after


@pytest.mark.parametrize("size", [(56, 56), (30, 45)])  # exact patches; partial edge patches
def test_patch_gemm_equals_the_convolution(size: tuple[int, int]) -> None:
    """The patch embedding runs as a GEMM over the patches: the same numbers as the stride-p
    convolution the checkpoint's weight belongs to."""
    from vllm.model_executor.models.mllama_vision import _patchify

    g = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, *size, generator=g, dtype=torch.float64)
    weight = torch.randn(8, 3, 14, 14, generator=g, dtype=torch.float64)
    conv = torch.nn.functional.conv2d(images, weight, stride=14)  # [3, 8, H/14, W/14]
    gemm = _patchify(images, 14) @ weight.reshape(8, -1).T  # [3, patches, 8]
    torch.testing.assert_close(gemm, conv.flatten(2).transpose(1, 2), rtol=1e-12, atol=1e-12)
