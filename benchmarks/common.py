"""What the benchmarks share: subcommand dispatch, synthetic inputs, GPU timing, and the one
place that reads or patches the engine's internals.

Engine internals (the runner, its decode graphs and counters, the scheduler's queues, the
model's layer classes) are reached only through :class:`EngineView` and the functions in the
last section, so a change inside the engine is adapted here once.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image

from vllm import LLM

# ------------------------------------------------------------------------------ dispatch


def dispatch(
    prog: str, doc: str, commands: dict[str, tuple[str, str]], argv: list[str] | None = None
) -> None:
    """Runs ``prog COMMAND [options]``: ``commands`` maps each name to (module, one-line help);
    the module is imported only when chosen and its ``main(argv, prog)`` parses the rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in commands:
        width = max(map(len, commands))
        text = "\n".join(
            [f"usage: {prog} COMMAND [options]", "", doc, "", "commands:"]
            + [f"  {name:<{width}}  {help_}" for name, (_, help_) in commands.items()]
            + ["", f"{prog} COMMAND --help shows a command's options."]
        )
        if argv and argv[0] in ("-h", "--help"):
            print(text)
            return
        raise SystemExit(text + (f"\n\nunknown command: {argv[0]}" if argv else ""))
    module = importlib.import_module(commands[argv[0]][0])
    module.main(argv[1:], prog=f"{prog} {argv[0]}")


# ------------------------------------------------------------------------------ inputs


def noise_image(size: int, seed: int) -> Image.Image:
    """A square RGB image of seeded uniform noise (never blank)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def dummy_11b(max_num_seqs: int = 8, gpu_memory_utilization: float = 0.5, **kwargs) -> LLM:
    """The 11B Instruct shape with dummy bf16 weights, 4k context (the benchmarks' engine)."""
    return LLM(
        model="demo/mllama-11b",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        **kwargs,
    )


def tiny_llm(max_model_len: int = 512, max_num_seqs: int = 4, **kwargs) -> LLM:
    """The tiny demo checkpoint: what the ``--smoke`` runs use on CPU."""
    return LLM(
        model="demo/mllama-tiny", max_model_len=max_model_len, max_num_seqs=max_num_seqs, **kwargs
    )


def make_prompt(llm: LLM, with_image: bool, n_tokens: int, seed: int) -> dict:
    """``n_tokens`` seeded prompt token ids; with an image, the image token first and one
    noise image of a 2x2-tile canvas (4 tiles)."""
    spec = EngineView(llm).spec
    bos = llm.get_tokenizer().bos_token_id
    span = min(20000, spec.text.vocab_size - 300)
    body = [32 + (seed * 7 + i) % span for i in range(n_tokens - 2)]
    tile = spec.vision.image_size
    if with_image:
        return {
            "prompt_token_ids": [bos, spec.image_token_id] + body,
            "multi_modal_data": {"image": noise_image(2 * tile, seed)},
        }
    return {"prompt_token_ids": [bos, bos] + body}


# ------------------------------------------------------------------------------ timing


@contextlib.contextmanager
def fastest_sdpa() -> Iterator[None]:
    """On CUDA, SDPA with cuDNN's kernel first, then flash, then memory-efficient: the floors'
    attention rate (the default order can pick a slower kernel for the vision tower's head
    size). Elsewhere torch's default choice."""
    if not torch.cuda.is_available():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        yield


def sync() -> None:
    """Waits for the GPU, where there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def event_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Mean ms per call of ``fn`` (CUDA events; wall time on CPU), after one warm-up call."""
    fn()
    if not torch.cuda.is_available():  # CPU smoke runs: wall time
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_graph_us(
    calls: list[Callable[[], object]],
    replays: int = 10,
    before_replay: Callable[[], object] | None = None,
) -> float:
    """Median microseconds per call of one CUDA graph that runs ``calls`` back to back
    (``before_replay``, if given, runs before each timed replay: a barrier across ranks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for fn in calls[: min(len(calls), 2)]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        if before_replay is not None:
            before_replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(samples)


def copy_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    """The report's anchor: device-to-device copy of ``gib`` GiB of bf16, bytes read +
    written per second (TB/s), mean over ``iters`` copies timed by CUDA events."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * n * 2 / seconds / 1e12


def copy_bandwidth_gb_s() -> float:
    """The kernel microbenchmarks' anchor: device-to-device copy of 2 GiB of fp32,
    (bytes read + bytes written) / median time of ``triton.testing.do_bench`` (GB/s)."""
    import triton

    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def read_bandwidth_gb_s() -> float:
    """Read-only anchor: a float32 sum over 2 GiB (bytes read / median ``do_bench`` time,
    GB/s); what a weight-streaming kernel's bytes are held against."""
    import triton

    src = torch.randn(1 << 29, device="cuda")
    ms = triton.testing.do_bench(lambda: src.sum(), warmup=10, rep=200, return_mode="median")
    return src.nbytes / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------ engine internals


def prefill_times_ms(llm: LLM, processed: Any, iters: int, tag: str) -> list[float]:
    """Wall times (ms) of ``iters + 1`` runs of one processed request with ``max_tokens=1``,
    each from ``add_request`` until it finishes (TTFT as a client of the engine sees it; the
    first run warms up)."""
    from vllm import SamplingParams

    engine, view = llm.llm_engine, EngineView(llm)
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for i in range(iters + 1):
        view.add_processed(f"{tag}{time.perf_counter_ns()}-{i}", processed, params)
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


class EngineView:
    """The engine internals the in-process benchmarks read and patch, for one ``LLM``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.llm_engine

    # What the engine is made of.
    @property
    def runner(self) -> Any:
        return self.engine.runner

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def stats(self) -> Any:
        """The runner's counters: graph_replays, eager_decode_steps, host_time_s, ..."""
        return self.runner.stats

    @property
    def layout(self) -> Any:
        """The KV page layout: block sizes, layer and head counts."""
        return self.runner.layout

    @property
    def spec(self) -> Any:
        return self.engine.config.model_config.spec

    @property
    def graphs(self) -> Any:
        """The decode graph runner (None when eager)."""
        return self.runner.graphs

    def model_path(self) -> str:
        return str(self.engine.config.model_config.model_path)

    def startup(self) -> dict:
        """Capture times, graph memory and KV pages of the engine just built."""
        vg = self.runner.vision_graphs
        return {
            "capture_s": self.graphs.capture_time_s,
            "vision_capture_s": vg.capture_time_s if vg is not None else None,
            "graph_memory_gib": self.graphs.graph_memory_bytes / (1 << 30),
            "kv_pages": self.engine.block_manager.pool.num_allocatable,
        }

    # Requests.
    def process(self, prompt: dict) -> Any:
        """The processed inputs of ``prompt`` (tokens, image tiles), reusable across requests."""
        return self.engine.process_inputs(prompt)

    def add_processed(self, request_id: str, processed: Any, params: Any) -> None:
        self.engine.add_request(request_id, None, params, processed=processed)

    def waiting(self) -> bool:
        return bool(self.engine.scheduler.waiting)

    def abort_all(self) -> None:
        self.engine.abort_request(list(self.engine.scheduler.requests))

    def running_kv_bytes(self) -> int:
        """Bytes of self and cross K/V that the running sequences' next decode step reads."""
        lo = self.layout
        per_tok = lo.num_self_layers * 2 * lo.num_kv_heads * lo.head_dim * 2
        per_vis = lo.num_cross_layers * 2 * lo.num_kv_heads * lo.head_dim * 2
        total = 0
        for r in self.engine.scheduler.running:
            for s in r.unfinished_seqs():
                total += len(s) * per_tok + r.inputs.encoder_seq_len * per_vis
        return total

    @staticmethod
    def image_inputs(processed: Any, device: torch.device) -> tuple:
        """(pixel values, aspect-ratio ids, tiles per image) of processed inputs, on device."""
        images = processed.images
        return (
            images.pixel_values.to(device),
            images.aspect_ratio_ids.to(device),
            images.num_tiles,
        )

    @staticmethod
    def image_tiles(processed: Any) -> int:
        """Tiles of all images of processed inputs."""
        return int(sum(processed.images.num_tiles))

    # Decode graphs.
    def decode_graph(self, cross: bool, bs: int) -> torch.cuda.CUDAGraph:
        """The captured decode graph a batch of ``bs`` replays (family cross or text)."""
        graphs = self.graphs
        return graphs.graphs[("cross" if cross else "text", graphs.bucket_for(bs))]

    @property
    def rows(self) -> Any:
        """The decode rows' device state (tokens, positions) that a replay advances."""
        return self.runner.rows

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Decode steps inside run eagerly (the graphs are detached meanwhile)."""
        saved, self.runner.graphs = self.runner.graphs, None
        try:
            yield
        finally:
            self.runner.graphs = saved

    def graph_forward(self, bs: int, family: str) -> torch.Tensor:
        """Runs the function a decode graph captured, eagerly, on its static inputs."""
        return self.graphs.forward(bs, family)

    def park_graph_rows(self) -> None:
        """Points every static row of the decode graphs at the padding row, so replays write
        nowhere (for timing replays outside a step)."""
        self.graphs.static_rows.fill_(self.graphs.null_row)
        self.graphs._uploaded_rows = None

    def release_for_hf(self) -> None:
        """Frees the KV cache and decode graphs (room for an HF model on the same GPU)."""
        from vllm.worker.cache_engine import CacheEngine

        CacheEngine.unbind(self.model)
        self.runner.cache_engine = self.runner.graphs = None
        torch.cuda.empty_cache()

    # Hooks.
    def wrap_runner(self, name: str, wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
        """Replaces the runner's method ``name`` (``launch``, ``collect``) by
        ``wrap(original)``; returns the function that restores it."""
        original = getattr(self.runner, name)
        setattr(self.runner, name, wrap(original))
        return lambda: setattr(self.runner, name, original)


def launch_record(out: Any) -> dict:
    """What a scheduled step carries: kind (decode, prefill or both: ``mixed``), decode
    rows, prefill chunks and tokens, and encoder image-layers."""
    kind = {(True, False): "decode", (False, True): "prefill", (True, True): "mixed"}.get(
        (bool(out.decode_seqs), bool(out.chunks)), "encoder")
    return {
        "kind": kind,
        "seqs": len(out.decode_seqs),
        "chunks": len(out.chunks),
        "prompt_tokens": out.num_prefill_tokens,
        "encoder": sum(w.layers for w in out.encoder_work),
    }


def scheduled_prompt_tokens(out: Any) -> int:
    """Prompt tokens a scheduler output prefills (0 for none)."""
    return 0 if out is None else out.num_prefill_tokens


def engine_state(engine: Any) -> tuple[int, int, bool, bool]:
    """(running, waiting, images being encoded ahead, prompts part-way through their chunks)
    of an engine."""
    from vllm.core.prefill_tracker import PrefillPhase

    tracker = engine.scheduler.tracker
    return (
        len(engine.scheduler.running),
        len(engine.scheduler.waiting),
        tracker.count(PrefillPhase.ENCODING) > 0,
        tracker.count(PrefillPhase.CHUNKED) > 0,
    )


def engine_classes() -> tuple[type, type, type]:
    """(LLMEngine, ModelRunner, Scheduler): what a server-wide trace patches."""
    from vllm.core.scheduler import Scheduler
    from vllm.engine.llm_engine import LLMEngine
    from vllm.worker.model_runner import ModelRunner

    return LLMEngine, ModelRunner, Scheduler


def decode_weights(model: torch.nn.Module, with_cross: bool) -> list[torch.Tensor]:
    """The weight matrices one decode step reads, in the engine's fused layout (not the
    cross-attention K/V projections, whose output is cached)."""
    mats = []
    for layer in model.language_model.model.layers:
        cross = is_cross_layer(layer)
        if cross and not with_cross:
            continue
        a = layer.cross_attn if cross else layer.self_attn
        qkv = a.q_proj if cross else a.qkv_proj
        mats += [m.weight for m in (qkv, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    mats.append(model.language_model.lm_head.weight)
    return mats


def cross_kv_projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The K/V projections of the vision tokens, one per cross-attention layer."""
    return [m.cross_attn.kv_proj for m in model.language_model.model.layers if is_cross_layer(m)]


def is_cross_layer(layer: torch.nn.Module) -> bool:
    """Whether a text decoder layer is a cross-attention layer."""
    from vllm.model_executor.models.mllama import MllamaCrossAttentionDecoderLayer

    return isinstance(layer, MllamaCrossAttentionDecoderLayer)


def hf_weight_source(model: torch.nn.Module) -> Callable[[str], torch.Tensor]:
    """Maps an HF ``MllamaForConditionalGeneration`` parameter name to the engine's tensor
    holding it (a slice of a fused weight where the engine fuses projections)."""
    from vllm.model_executor.models.mllama_weights import to_hub_name, to_param_name

    ours = dict(model.named_parameters())
    fused = {
        f"{name}.weight": mod.shards
        for name, mod in model.named_modules()
        if hasattr(mod, "shards")
    }

    def source(hf_name: str) -> torch.Tensor:
        target, shard = to_param_name(to_hub_name(hf_name))
        src = ours[target]
        if shard is not None:
            start, size = fused[target][shard]
            src = src[start : start + size]
        return src

    return source
