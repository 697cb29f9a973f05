"""Physical anchors of the report: the decode GEMV floor, TTFT's component floors, and HF.

The GEMV floor applies every weight matrix a decode step reads (in the engine's own fused
layout; not the cross-attention K/V projections, whose output is cached) once per token, from
a CUDA graph: no step can be faster than this. The copy bandwidth is
:func:`benchmarks.common.copy_bandwidth`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.common import (
    cross_kv_projections,
    decode_weights,
    event_ms,
    fastest_sdpa,
    hf_weight_source,
)


def graph_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Mean ms per call of ``fn`` replayed from one CUDA graph of ``calls`` calls: kernels
    shorter than their launch cost are timed as the model's graphs run them."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def gemv_floor(model, batch: int, with_cross: bool, iters: int = 20) -> dict:
    """Time of x @ W^T for every decode weight, replayed from one CUDA graph."""
    mats = decode_weights(model, with_cross)
    xs = [torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in mats]
    outs = []

    def run() -> None:
        outs.clear()
        for x, w in zip(xs, mats, strict=True):
            outs.append(torch.matmul(x, w.t()))

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    return {"ms": ms, "bytes": nbytes, "tb_per_s": nbytes / (ms / 1e3) / 1e12}


def _vision_attention_ms(q, k, vv, valid: int, tokens: int) -> tuple[float, float, float]:
    """(maskless attention, padding rows by SDPA, padding rows at the faster of SDPA and the
    split kernel) ms per vision layer."""
    import torch.nn.functional as F

    from vllm.attention.ops.vision_attention import padding_rows_attention, padding_rows_ranges

    with fastest_sdpa():
        attn = event_ms(lambda: F.scaled_dot_product_attention(q, k, vv))
        pad = (
            event_ms(
                lambda: F.scaled_dot_product_attention(
                    q[:, :, valid:], k[:, :, :valid], vv[:, :, :valid]
                )
            )
            if valid < tokens
            else 0.0
        )
    # The model runs few padding rows through a split kernel that beats SDPA there; the floor
    # keeps SDPA's rate (its definition) and also reports the floor at the faster of the two.
    # The split kernel is timed in a CUDA graph, as the vision graph runs it (eager, its two
    # ~10 us launches would be timed instead).
    pad_split = pad
    ranges = padding_rows_ranges(tokens, valid, q.device, split=q.is_cuda)
    if ranges is not None:
        o = torch.empty_like(q)
        pad_split = min(pad, graph_ms(lambda: padding_rows_attention(q, k, vv, o, valid, ranges)))
    return attn, pad, pad_split


def ttft_floor(model, copy_tb_s: float, num_tiles: int = 4) -> dict:
    """Sum of the component floors of an image prefill (one image of ``num_tiles`` tiles):
    the vision tower's attention (maskless SDPA over all padded tokens plus the padding rows
    over the valid keys) and linears at the rates this GPU measures for those exact shapes, the
    projector, the cross K/V projections of the vision tokens, and the text weights read once
    at copy bandwidth. Norms, activations and the text tokens' own work are left out."""
    import torch.nn.functional as F

    v = model.spec.vision
    dtype = model.multi_modal_projector.weight.dtype
    dev = model.multi_modal_projector.weight.device
    tokens = v.max_num_tiles * v.padded_tokens_per_tile
    valid = num_tiles * v.tokens_per_tile
    heads, hd, d = v.attention_heads, v.head_dim, v.hidden_size

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype)

    q = rand(1, heads, tokens, hd)
    k, vv = rand(1, heads, tokens, hd), rand(1, heads, tokens, hd)
    layers = v.num_hidden_layers + v.num_global_layers
    attn, pad, pad_split = _vision_attention_ms(q, k, vv, valid, tokens)
    x, h4 = rand(tokens, d), rand(tokens, v.intermediate_size)
    lin = 0.0
    for n_in, n_out, inp in (
        (d, 3 * d, x),
        (d, d, x),
        (d, v.intermediate_size, x),
        (v.intermediate_size, d, h4),
    ):
        w, b = rand(n_out, n_in), rand(n_out)
        lin += event_ms(lambda inp=inp, w=w, b=b: F.linear(inp, w, b))
    feats = rand(valid, model.multi_modal_projector.weight.shape[1])
    proj = event_ms(lambda: model.multi_modal_projector(feats))
    cross = cross_kv_projections(model)
    vis = rand(valid, model.spec.text.hidden_size)
    kv_ms = (event_ms(lambda: cross[0](vis)) * len(cross)) if cross else 0.0
    text_bytes = sum(p.numel() * p.element_size() for p in model.language_model.parameters())
    weights_ms = text_bytes / (copy_tb_s * 1e12) * 1e3
    parts = {
        "vision_attention_ms": layers * (attn + pad),
        "vision_linears_ms": layers * lin,
        "projector_ms": proj,
        "cross_kv_ms": kv_ms,
        "text_weights_ms": weights_ms,
    }
    floor = sum(parts.values())
    return {
        **parts,
        "floor_ms": floor,
        "floor_ms_split_padding_rows": floor - layers * (pad - pad_split),
        "padding_rows_per_layer_ms": {"sdpa": pad, "split": pad_split},
    }


def hf_model_from(model, path: str):
    """An HF ``MllamaForConditionalGeneration`` holding the same (dummy) weights."""
    from transformers import AutoConfig, MllamaForConditionalGeneration

    cfg = AutoConfig.from_pretrained(path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            hf = MllamaForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    hf = hf.to_empty(device="cuda").eval()
    source = hf_weight_source(model)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(source(name).view(p.shape))
    # to_empty() left the rotary buffers uninitialised: rebuild them from the config.
    text = hf.model.language_model
    text.rotary_emb = type(text.rotary_emb)(config=hf.config.text_config).to("cuda")
    return hf


def hf_generate_times(
    hf, processor, image, text_tokens: int, batch: int, new_tokens: int = 33
) -> dict:
    """TTFT and per-step decode time of HF generate() (eager, greedy)."""
    prompt = "<|image|><|begin_of_text|>" + "hello " * (text_tokens - 3)
    inputs = processor(
        text=[prompt] * batch,
        images=[[image]] * batch,
        return_tensors="pt",
        add_special_tokens=False,
    ).to("cuda")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(**inputs, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)  # warm-up
    ttft = min(timed(1) for _ in range(2))
    total = timed(new_tokens)
    return {"ttft_ms": ttft * 1e3, "ms_per_step": (total - ttft) / (new_tokens - 1) * 1e3}
