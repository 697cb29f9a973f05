"""CUDA graphs for the vision tower and projector, one per tile count.

An image is always encoded at the model's maximum tile count, so for a given number of real
tiles the whole tower has one fixed shape. Replaying a captured graph per image removes the
tower's ~600 kernel launches from the host, which lets the host prepare the text part of the
prefill while the GPU is still encoding (the prefill of one image + 128 tokens was bounded by
host launch time, not by the GPU). Eager encoding is used when graphs are off.
"""

from __future__ import annotations

import time

import torch

from vllm.logger import init_logger
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration

logger = init_logger(__name__)


class VisionGraphRunner:
    """Captures ``encode_images`` for one image of each tile count and replays it per image."""

    def __init__(self, model: MllamaForConditionalGeneration, device: torch.device) -> None:
        v = model.spec.vision
        self.model = model
        self.max_tiles = v.max_num_tiles
        dtype = model.dtype
        self.pixels = torch.zeros(1, v.max_num_tiles, v.num_channels, v.image_size,
                                  v.image_size, dtype=dtype, device=device)
        self.aspect_ratio = torch.ones(1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_time_s = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for nt in range(self.max_tiles, 0, -1):
            for _ in range(2):
                self.model.encode_images(self.pixels, self.aspect_ratio, [nt])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.encode_images(self.pixels, self.aspect_ratio, [nt])
            self.graphs[nt], self.outputs[nt] = graph, out
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0
        logger.info("Captured vision graphs for 1..%d tiles in %.1f s", self.max_tiles,
                    self.capture_time_s)

    def encode(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
               num_tiles: list[int]) -> torch.Tensor:
        """Same contract as ``MllamaForConditionalGeneration.encode_images``."""
        outs = []
        for i, nt in enumerate(num_tiles):
            self.pixels.copy_(pixel_values[i:i + 1])
            self.aspect_ratio.copy_(aspect_ratio_ids[i:i + 1])
            outs.append(self._replay(nt))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def encode_host(self, host_pixels: list[torch.Tensor], aspect_ratio_ids: list[int],
                    num_tiles: list[int]) -> torch.Tensor:
        """``encode`` for images still on the host (``host_pixels``: [n_i, max_tiles, C, S, S]
        tensors holding the images in order): each image is copied straight into the graph's
        input buffer, without a device copy of the batch first, and without blocking the host
        when the tensors are pinned (the input processor pins them on CUDA)."""
        images = [p[j:j + 1] for p in host_pixels for j in range(p.shape[0])]
        assert len(images) == len(num_tiles) == len(aspect_ratio_ids)
        outs = []
        for img, ar, nt in zip(images, aspect_ratio_ids, num_tiles, strict=True):
            self.pixels.copy_(img if img.is_pinned() else img.pin_memory(), non_blocking=True)
            self.aspect_ratio.fill_(ar)  # a kernel argument: no host copy
            outs.append(self._replay(nt))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _replay(self, num_tiles: int) -> torch.Tensor:
        self.graphs[num_tiles].replay()
        return self.outputs[num_tiles].clone()  # the next replay reuses the buffer


def capture_vision_graphs(model: MllamaForConditionalGeneration,
                          device: torch.device) -> VisionGraphRunner | None:
    """The vision graphs, captured (before the memory profile, so their memory is accounted
    for); None where capture fails (the tower then runs eagerly)."""
    graphs = VisionGraphRunner(model, device)
    try:
        graphs.capture()
    except RuntimeError as e:  # e.g. an attention back-end that cannot be captured
        logger.warning("Vision tower runs eagerly: capture failed (%s)", e)
        torch.cuda.synchronize()
        return None
    return graphs
