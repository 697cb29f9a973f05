"""The model on its device, its kernels chosen, and what is captured before the KV pool is sized.

``load_model`` is the first half of building an engine: it needs only the configuration the
user asked for. The memory profile then measures it (``memory.py``), the configuration is fitted
to the pages that fit, and the runner is built once with that final configuration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
from vllm.attention.layer import Attention, CrossAttention
from vllm.attention.selector import get_attn_backend
from vllm.config import VllmConfig
from vllm.model_executor.layers.kernel_target import KernelTarget, kernel_target, select_kernels
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.worker.cache_engine import PageLayout
from vllm.worker.memory import check_device_memory
from vllm.worker.vision_graph import VisionGraphRunner, capture_vision_graphs


@dataclass
class LoadedModel:
    """A loaded model and its load-time choices."""

    model: MllamaForConditionalGeneration
    kernels: KernelTarget
    layout: PageLayout
    vision_graphs: VisionGraphRunner | None
    load_seconds: float  # the weights and kernel choice, the vision graphs not included
    vision_graph_seconds: float


def check_kv_dtype_on_gpu(kv_dtype: torch.dtype, device: torch.device) -> None:
    """An e4m3 KV cache needs the FP8 conversions of compute capability 8.9 (Ada, Hopper)
    and later; refused before anything loads on an older GPU."""
    if kv_dtype != torch.float8_e4m3fn:
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"kv_cache_dtype fp8 (e4m3) needs a GPU of compute capability 8.9 or later; this "
            f"one is {cap[0]}.{cap[1]}. Use --kv-cache-dtype fp8_e5m2 or auto."
        )


def load_model(config: VllmConfig) -> LoadedModel:
    """Builds the model on its device with its weights, binds the attention back-end, chooses
    every layer's kernels for the decode buckets, and captures the vision graphs (CUDA, unless
    ``enforce_eager``)."""
    t0 = time.perf_counter()
    mc = config.model_config
    device = config.device_config.device
    kv_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, mc.dtype)
    if device.type == "cuda":
        check_kv_dtype_on_gpu(kv_dtype, device)
        check_device_memory(config, torch.cuda.get_device_properties(device).total_memory)
    model = get_model(
        mc.spec,
        mc.model_path,
        mc.load_format,
        mc.dtype,
        device,
        max_position=mc.max_model_len,
        seed=mc.seed,
        quantization=mc.quantization,
    )
    backend = get_attn_backend(device)
    for module in model.modules():
        if isinstance(module, (Attention, CrossAttention)):
            module.backend = backend
    target = kernel_target(device, config.compilation_config.cuda_graph_sizes)
    select_kernels(model, target)
    t1 = time.perf_counter()
    vision_graphs = None
    if device.type == "cuda" and not mc.enforce_eager:
        vision_graphs = capture_vision_graphs(model, device)
    layout = PageLayout.for_model(mc.spec, config.cache_config.block_size, kv_dtype)
    return LoadedModel(model, target, layout, vision_graphs, t1 - t0, time.perf_counter() - t1)
