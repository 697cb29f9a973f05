"""How many KV pages fit, and whether one full-length sequence fits them.

CUDA: a worst-case prefill (``max_num_batched_tokens`` tokens with the per-step vision budget
of images) is run once without caches and its peak is measured, plus what a chunk continuing a
full-length context gathers from the pages; decode-graph memory is reserved before the pool is
sized; the rest of ``gpu_memory_utilization`` becomes pages. No step is larger than the
budget, whatever max_model_len is.
CPU: the pool holds what the scheduler can ever use, capped by ``cpu_kv_cache_space_bytes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader.loader import build_model, plan_quantization
from vllm.model_executor.model_loader.quant_plan import quantized_linears
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ImageInputs, ProcessedInputs
from vllm.worker.cache_engine import PageLayout
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch, step_images

if TYPE_CHECKING:  # loaded_model calls check_device_memory before it loads
    from vllm.worker.loaded_model import LoadedModel

logger = init_logger(__name__)
GiB = 1 << 30


def pages_per_seq(config: VllmConfig, layout: PageLayout) -> int:
    """Self pages of a full-length sequence plus the cross pages of a full image group."""
    mc = config.model_config
    return (layout.pages_for_tokens(mc.max_model_len)
            + layout.cross_pages_for_tokens(mc.max_encoder_seq_len))


def max_concurrency(config: VllmConfig, layout: PageLayout, num_pages: int) -> float:
    """How many full-length sequences, each with a full image group's cross pages, the pool of
    ``num_pages`` (the null page included) holds at once: vLLM's "maximum concurrency"."""
    return (num_pages - 1) / pages_per_seq(config, layout)


def requests_that_fit(layout: PageLayout, num_pages: int, tokens: int, vision_tokens: int) -> int:
    """Requests of ``tokens`` tokens with ``vision_tokens`` of images that the pool of
    ``num_pages`` (the null page included) holds at once."""
    need = layout.pages_for_tokens(tokens) + layout.cross_pages_for_tokens(vision_tokens)
    return (num_pages - 1) // need


def profile_inputs(cfg: VllmConfig) -> list[ProcessedInputs]:
    """Synthetic prompts filling the step budgets: tokens and images at their maxima, no
    prompt longer than ``max_model_len`` (as in any real step: positions past it would index
    past the RoPE tables)."""
    spec = cfg.model_config.spec
    v = spec.vision
    sc = cfg.scheduler_config
    max_len = cfg.model_config.max_model_len
    n_images = sc.max_num_encoder_tiles // v.max_num_tiles
    n_seqs = max(1, min(max(n_images, -(-sc.max_num_batched_tokens // max_len)),
                        sc.max_num_seqs))
    tokens = min(sc.max_num_batched_tokens // n_seqs, max_len)
    per_seq = [n_images // n_seqs + (1 if i < n_images % n_seqs else 0) for i in range(n_seqs)]
    out = []
    gen = torch.Generator().manual_seed(0)
    for k in per_seq:
        ids = [spec.image_token_id] * k + [1] * max(tokens - k, 0)
        images = None
        if k:
            pixels = torch.randn(k, v.max_num_tiles, v.num_channels, v.image_size, v.image_size,
                                 generator=gen)
            images = ImageInputs(pixels, torch.full((k,), len(v.supported_aspect_ratios)),
                                 [v.max_num_tiles] * k)
        out.append(ProcessedInputs(ids, images, image_runs(ids, spec.image_token_id),
                                   last_group(ids, spec.image_token_id),
                                   tokens_per_tile=v.tokens_per_tile))
    return out


@torch.inference_mode()
def run_profile_prefill(cfg: VllmConfig, model: MllamaForConditionalGeneration,
                        layout: PageLayout) -> torch.Tensor:
    """The worst-case prefill step with no caches bound (vision encoding, text forward, the
    sampled rows' logits); returns the logits. Device-agnostic: the CPU suite runs it with the
    fused kernels, under the bounds-checked Triton interpreter."""
    device = cfg.device_config.device
    items = [PrefillItem(list(p.prompt_token_ids), p, i) for i, p in
             enumerate(profile_inputs(cfg))]
    batch = build_prefill_batch(items, layout.block_size, layout.cross_block_size, device,
                                pad_rows=True)
    images = step_images(items, device)
    vision = None
    if images is not None:
        vision = model.encode_images(images.pixel_values, images.aspect_ratio_ids,
                                     images.num_tiles)
    with set_forward_context(batch.metadata):
        hidden = model(batch.input_ids, batch.positions, vision)
    return model.compute_logits(hidden[batch.logits_indices])


def profile_prefill_peak(cfg: VllmConfig, loaded: LoadedModel) -> int:
    """Peak bytes allocated while running the worst-case prefill step (no caches bound)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    logits = run_profile_prefill(cfg, loaded.model, loaded.layout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del logits
    torch.cuda.empty_cache()
    return peak


def weight_bytes(config: VllmConfig) -> int:
    """Bytes of the model's parameters and buffers in its dtype, quantized layers as they are
    stored plus their shared dequantization scratch (built on the meta device: nothing is
    allocated)."""
    mc = config.model_config
    plan = plan_quantization(mc.model_path, mc.load_format, mc.quantization, mc.spec)
    model = build_model(mc.spec, mc.dtype, torch.device("meta"), mc.max_model_len, plan.config)
    tensors = [*model.parameters(), *model.buffers()]
    # Quantized layers share one dense scratch matrix (prefill), as large as the largest.
    elem = torch.empty((), dtype=mc.dtype).element_size()
    scratch = max((m.out_features * m.in_features for m in quantized_linears(model).values()),
                  default=0) * elem
    return sum(t.numel() * t.element_size() for t in tensors) + scratch


def prefill_activation_estimate(config: VllmConfig) -> int:
    """An upper estimate of the worst-case prefill step's activations: at the MLP of a text
    layer the residual, the normed input, the gate|up output and its activation are live, for
    every token of the step (the logits are computed for the sampled rows only)."""
    t = config.model_config.spec.text
    sc = config.scheduler_config
    tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * config.model_config.max_model_len)
    elem = torch.empty((), dtype=config.model_config.dtype).element_size()
    return tokens * (3 * t.intermediate_size + 4 * t.hidden_size) * elem


def context_gather_bytes(config: VllmConfig) -> int:
    """Bytes the prefill chunks with context hold beyond what the profile (chunks without
    context) measures: a group's layer keys and values of up to max_model_len tokens gathered
    from the pages (``ops/sdpa.py``; ``build_prefill_batch`` bounds a group so), one of them
    twice while it is gathered, plus one more for the allocator's slack; and the queries of a
    group of several chunks picked out of the step and their output (the TRITON back-end),
    at most the step's token budget of rows each. Only chunked prefill continues a sequence
    from its pages."""
    if not config.scheduler_config.enable_chunked_prefill:
        return 0
    t = config.model_config.spec.text
    elem = torch.empty((), dtype=config.model_config.dtype).element_size()
    gather = 4 * config.model_config.max_model_len * t.num_key_value_heads * t.head_dim
    rows = 2 * config.scheduler_config.max_num_batched_tokens * t.num_attention_heads * t.head_dim
    return (gather + rows) * elem


def check_device_memory(config: VllmConfig, total_bytes: int) -> None:
    """Refuses, before anything is allocated, a configuration whose weights and worst-case
    prefill cannot fit in ``gpu_memory_utilization`` of ``total_bytes`` (raises ValueError
    naming the flags), instead of failing inside the load or the memory profile."""
    mc, sc = config.model_config, config.scheduler_config
    util = config.cache_config.gpu_memory_utilization
    budget = int(total_bytes * util)
    weights = weight_bytes(config)
    dtype = str(mc.dtype).replace("torch.", "")
    if mc.quantization is not None:
        dtype = f"{dtype} with {mc.quantization} weights"
    if weights > budget:
        smaller = (
            "FP8 weights with --quantization fp8 or an FP8 checkpoint need about half of "
            "that, 4-bit ones with --quantization bitsandbytes about a quarter; "
            if mc.quantization is None else "")
        tp = config.parallel_config.tensor_parallel_size
        where = "one GPU" if tp == 1 else f"{tp} GPUs (this is one rank's part)"
        raise ValueError(
            f"The weights alone need {weights / GiB:.1f} GiB in {dtype}, more than the "
            f"{budget / GiB:.1f} GiB that --gpu-memory-utilization {util} allows on this GPU "
            f"({total_bytes / GiB:.1f} GiB): this model does not fit on {where} in {dtype} "
            f"({smaller}--tensor-parallel-size splits it over more GPUs).")
    activations = prefill_activation_estimate(config) + context_gather_bytes(config)
    if weights + activations > budget:
        raise ValueError(
            f"The weights ({weights / GiB:.1f} GiB) and the largest prefill step "
            f"(max_num_batched_tokens {sc.max_num_batched_tokens} at max_model_len "
            f"{mc.max_model_len}: about {activations / GiB:.1f} GiB of activations) need more "
            "than the "
            f"{budget / GiB:.1f} GiB that --gpu-memory-utilization {util} allows on this GPU; "
            "lower --max-num-batched-tokens (without --enable-chunked-prefill prompts are "
            "prefilled whole, so also --max-model-len) or raise --gpu-memory-utilization.")


def decode_graph_reserve(config: VllmConfig) -> int:
    """Bytes set aside for the decode graphs' shared pool, estimated for the largest bucket:
    the shared fp32 logits buffer, one step's activations (logits twice: bf16 and fp32), the
    decode attention's split-KV workspace, plus slack."""
    t = config.model_config.spec.text
    bs = max(config.compilation_config.cuda_graph_sizes)
    elem = torch.empty((), dtype=config.model_config.dtype).element_size()
    act = bs * (2 * t.intermediate_size + 6 * t.hidden_size) * elem
    logits = bs * t.vocab_size * (4 + 4 + elem)
    workspace = bs * t.num_attention_heads * 64 * (t.head_dim + 2) * 4
    return 2 * (act + workspace) + logits + (256 << 20)


def determine_num_pages(cfg: VllmConfig, loaded: LoadedModel) -> int:
    """Number of pages in the pool, the null page included."""
    lo = loaded.layout
    device = cfg.device_config.device
    override = cfg.cache_config.num_gpu_blocks_override
    if override is not None:
        return override + 1
    if device.type != "cuda":
        full = cfg.scheduler_config.max_num_seqs * pages_per_seq(cfg, lo)
        cap = cfg.cache_config.cpu_kv_cache_space_bytes // lo.page_bytes
        return max(2, min(full, cap) + 1)
    total = torch.cuda.get_device_properties(device).total_memory
    weights = torch.cuda.memory_allocated()
    peak = profile_prefill_peak(cfg, loaded)
    # Reserved memory after the profile (its cache emptied): weights, buffers and the vision
    # graphs' private pool, which allocated-memory counters do not see.
    resident = torch.cuda.memory_reserved()
    activations = max(peak - weights, 0) + context_gather_bytes(cfg)
    graphs = 0 if cfg.model_config.enforce_eager else decode_graph_reserve(cfg)
    budget = (int(total * cfg.cache_config.gpu_memory_utilization) - resident - activations
              - graphs)
    # Never more than the scheduler could ever fill (max_num_seqs full-length sequences).
    usable = cfg.scheduler_config.max_num_seqs * pages_per_seq(cfg, lo)
    num = min(max(budget // lo.page_bytes, 0), usable)
    logger.info("Memory split (GiB): total %.2f x %.2f; weights %.2f; other resident "
                "(buffers, vision graphs) %.2f; peak activations (with a full-context chunk's "
                "gathered K/V) %.2f; decode graphs "
                "reserved %.2f; KV pages %.2f (%d pages of %d KiB)",
                total / GiB, cfg.cache_config.gpu_memory_utilization, weights / GiB,
                (resident - weights) / GiB, activations / GiB, graphs / GiB,
                num * lo.page_bytes / GiB, num, lo.page_bytes >> 10)
    return num + 1


def largest_fitting_len(config: VllmConfig, layout: PageLayout, num_pages: int) -> int:
    """The longest max_model_len whose one full-length sequence (and its full image group's
    cross pages) fits ``num_pages`` (the null page included); at most the configured one."""
    cross = layout.cross_pages_for_tokens(config.model_config.max_encoder_seq_len)
    fit = (num_pages - 1 - cross) * layout.block_size
    return max(0, min(fit, config.model_config.max_model_len))


def check_context_fits(config: VllmConfig, layout: PageLayout, num_pages: int) -> None:
    """Refuses a configuration whose one full-length sequence cannot fit the KV pool (raises
    ValueError naming the flags and the largest max_model_len that fits), before the runner
    allocates anything: a request as long as max_model_len must always be servable."""
    usable = num_pages - 1
    need = pages_per_seq(config, layout)
    if usable >= need:
        return
    mc = config.model_config
    cc = config.cache_config
    fit = largest_fitting_len(config, layout, num_pages)
    images = f"{mc.limit_images_per_prompt} image(s) of cross-attention pages"
    more = "--gpu-memory-utilization"
    if cc.num_gpu_blocks_override is not None:
        room = f"--num-gpu-blocks-override {cc.num_gpu_blocks_override}"
        more = "--num-gpu-blocks-override"
    elif config.device_config.device.type == "cuda":
        room = (f"--gpu-memory-utilization {cc.gpu_memory_utilization} leaves "
                f"{usable * layout.page_bytes / GiB:.2f} GiB for it")
    else:
        room = (f"the CPU KV cache space is {cc.cpu_kv_cache_space_bytes / GiB:.2f} GiB; on a "
                "GPU, --gpu-memory-utilization sets it")
    quant = ("; --quantization fp8 or bitsandbytes stores the weights in 8 or 4 bits and "
             "leaves the rest to the KV cache"
             if mc.quantization is None and cc.num_gpu_blocks_override is None else "")
    kv = ("; --kv-cache-dtype fp8 would hold twice the tokens"
          if cc.kv_cache_dtype == "auto" and layout.dtype.itemsize > 1 else "")
    if fit >= 2 * layout.block_size:
        fix = (f"The largest max_model_len that fits is {fit}: pass --max-model-len {fit} (or "
               f"less), or raise {more}{quant}.")
    else:
        fix = (f"Not even a {2 * layout.block_size}-token sequence fits: raise {more}, lower "
               f"--max-model-len or --limit-mm-per-prompt{quant}.")
    raise ValueError(
        f"max_model_len {mc.max_model_len} does not fit in the KV cache: one full-length "
        f"sequence needs {need} pages of {layout.block_size} tokens ({images} included), the "
        f"cache has room for {usable} ({room}){kv}. {fix}")
