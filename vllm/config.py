"""Engine configuration: frozen dataclasses, built once by ``EngineArgs`` and validated there.

Values discovered at run time (how many KV pages fit, what the profile measured) belong to the
components that discover them; they are not written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from vllm.transformers_utils.config import MllamaSpec

_DTYPES = {
    "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float": torch.float32, "float32": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None,
                  device: torch.device) -> torch.dtype:
    """vLLM's rule: ``auto`` keeps a bf16/fp16 checkpoint's dtype; fp32 checkpoints run in fp16
    on CUDA and in fp32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    ckpt = _DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
    if ckpt == torch.float32 and device.type == "cuda":
        return torch.float16
    return ckpt


@dataclass(frozen=True)
class ModelConfig:
    """What to run: the checkpoint, its parsed configuration and how to load it."""

    model: str  # as the user named it (a folder or a demo name)
    model_path: Path
    tokenizer_path: Path
    spec: MllamaSpec
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    limit_images_per_prompt: int = 1
    generation_config: str = "auto"  # "auto" (the checkpoint's), "vllm" (none) or a folder
    max_logprobs: int = 20
    quantization: str | None = None
    revision: str | None = None  # of a hub model (None: the main branch, or not a hub ID)
    tokenizer: str = ""  # as the user named it (the model's name when not given)
    # Image-processor options (--mm-processor-kwargs), checked by EngineArgs.
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict, compare=False)
    # Processed images kept by digest (--mm-processor-cache-gb, GiB of host memory; 0: off).
    mm_processor_cache_gb: float = 4.0
    # Sampling defaults over (or, with generation_config="vllm", instead of) the checkpoint's.
    override_generation_config: dict[str, Any] = field(default_factory=dict, compare=False)

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's configuration as a ``transformers`` config object (after
        ``hf_overrides``), for code written against upstream's ``model_config.hf_config``."""
        from transformers import MllamaConfig

        return MllamaConfig(**self.spec.raw)

    @property
    def max_encoder_seq_len(self) -> int:
        """Most vision tokens one request can have cached (its last image group)."""
        return self.limit_images_per_prompt * self.spec.max_vision_tokens_per_image


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool. A page holds ``block_size`` tokens of every self-attention layer."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space_bytes: int = 4 << 30
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may carry (``core/scheduler.py``).

    ``max_num_batched_tokens``: tokens per step, decode and prefill together (vLLM's meaning).
    With ``enable_chunked_prefill`` a prompt is prefilled over several steps within it;
    without, prompts run whole (prefill-first). ``encoder_layers_per_step``: image-layers of
    the vision encoder per step for waiting requests (an image-layer is one encoder layer over
    one image's tiles), to which a step adds what the token budget leaves (the scheduler's
    ``encoder_layer_tokens``); 0 encodes images whole inside the prefill step.
    ``max_num_encoder_tiles``: tiles of the images whose vision tokens a step's prefill
    carries. ``scheduling_policy``: ``fcfs`` or ``priority`` (lower first, then arrival).
    ``enable_prefix_caching``: full self pages are kept under keys of their tokens and images
    and shared by later prompts that start the same way (``core/prefix_cache.py``).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    max_num_encoder_tiles: int = 16  # each image costs max_num_tiles
    enable_chunked_prefill: bool = False
    encoder_layers_per_step: int = 0
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = False


@dataclass(frozen=True)
class CompilationConfig:
    """Decode batch buckets: the CUDA-graph capture sizes (ascending, the last covering
    ``max_num_seqs``), also the row buckets of the linear layers' kernel tables."""

    cuda_graph_sizes: tuple[int, ...] = ()

    @staticmethod
    def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
        """1, 2, 4, then multiples of 8, up to the first bucket that holds max_num_seqs."""
        sizes = [1, 2, 4] + [8 * i for i in range(1, 1025)]
        out = []
        for s in sizes:
            out.append(s)
            if s >= max_num_seqs:
                break
        return tuple(out)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class DecodingConfig:
    """Structured output (vLLM's ``decoding_config``): the grammar backend and what compiling
    one request's constraint may cost (docs/security.md)."""

    guided_decoding_backend: str = "xgrammar"
    disable_any_whitespace: bool = False  # engine default for JSON constraints
    compile_timeout_s: float = 10.0  # one compilation, queueing included
    max_spec_chars: int = 65536  # a schema, regex, grammar or the choices, in characters
    cache_bytes: int = 256 << 20  # compiled grammars kept for reuse


@dataclass(frozen=True)
class VllmConfig:
    """Everything the engine needs, in one immutable object."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    compilation_config: CompilationConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    decoding_config: DecodingConfig = field(default_factory=DecodingConfig)
