"""The vision tower is capturable: no host syncs for one image of each tile count (CPU), and
replayed graphs equal the eager tower bitwise (CUDA)."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_runner import demo_path
from helpers.no_sync import NoHostSync

from vllm.model_executor.model_loader.loader import get_model
from vllm.transformers_utils.config import load_mllama_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def model():
    path = demo_path()
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    return get_model(load_mllama_config(path), path, "auto", dtype, DEVICE, 256)


def _image(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 3, 56, 56, generator=g), torch.tensor([seed % 8 + 1])


@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4])
def test_one_image_encode_has_no_host_sync(model, num_tiles: int) -> None:
    pixels, ar = _image(num_tiles)
    with torch.inference_mode(), NoHostSync():
        out = model.encode_images(pixels.to(DEVICE), ar.to(DEVICE), [num_tiles])
    assert out.shape == (num_tiles * 17, model.spec.text.hidden_size)


@pytest.mark.gpu
def test_vision_graphs_equal_eager(model) -> None:
    from vllm.worker.vision_graph import VisionGraphRunner

    graphs = VisionGraphRunner(model, DEVICE)
    graphs.capture()
    images = [_image(s) for s in range(4)]
    pixels = torch.cat([p for p, _ in images]).to(DEVICE, torch.bfloat16)
    ar = torch.cat([a for _, a in images]).to(DEVICE)
    tiles = [3, 1, 4, 3]
    with torch.inference_mode():
        eager = torch.cat([model.encode_images(pixels[i:i + 1], ar[i:i + 1], [n])
                           for i, n in enumerate(tiles)])
        replayed = graphs.encode(pixels, ar, tiles)
    assert torch.equal(eager, replayed)


@pytest.mark.gpu
def test_encode_from_host_equals_encode(model) -> None:
    """Images copied from pinned host tensors (two owners, one with two images) straight into
    the graphs' input buffer: the same output as from a device batch."""
    from vllm.worker.vision_graph import VisionGraphRunner

    graphs = VisionGraphRunner(model, DEVICE)
    graphs.capture()
    images = [_image(s) for s in range(3)]
    host = [torch.cat([images[0][0], images[1][0]]).bfloat16().pin_memory(),
            images[2][0].bfloat16().pin_memory()]
    ar = [int(a) for _, a in images]
    tiles = [2, 4, 1]
    with torch.inference_mode():
        from_device = graphs.encode(torch.cat(host).to(DEVICE),
                                    torch.tensor(ar, device=DEVICE), tiles)
        with NoHostSync():
            from_host = graphs.encode_host(host, ar, tiles)
    assert torch.equal(from_host, from_device)
