"""The synchronous engine: requests in, one scheduled step at a time, ``RequestOutput``s out.

``step()``: schedule -> run (prefill or decode) -> append tokens, detokenize, check stops ->
free what finished -> outputs. Bad input raises at ``add_request`` and never reaches a step.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.core.block_manager import BlockManager
from vllm.core.scheduler import Scheduler, encoder_layer_tokens
from vllm.core.scheduler_output import SchedulerOutput
from vllm.core.sequence import Request
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.errors import DeviceError, device_error, is_device_error
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.startup import StartupTimes
from vllm.engine.stats import EngineStats
from vllm.engine.warmup import warm_up, warm_up_kernels
from vllm.logger import init_logger
from vllm.model_executor.guided_decoding.compiler import GrammarCompilerService
from vllm.multimodal.processing import MllamaInputProcessor
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_image_processor, get_tokenizer
from vllm.worker.loaded_model import load_model
from vllm.worker.memory import check_context_fits, determine_num_pages, max_concurrency
from vllm.worker.model_runner import ModelRunner, RunnerStats
from vllm.worker.step_results import StepHandle

logger = init_logger(__name__)


def load_generation_config(config: VllmConfig) -> dict[str, Any]:
    """The checkpoint's generation_config.json (``auto``), none (``vllm``) or a folder's, with
    ``override_generation_config`` over it."""
    choice = config.model_config.generation_config
    overrides = config.model_config.override_generation_config
    if choice == "vllm":
        return dict(overrides)
    folder = config.model_config.model_path if choice == "auto" else Path(choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice != "auto":
            raise FileNotFoundError(f"{path}: generation config not found")
        return dict(overrides)
    return {**json.loads(path.read_text()), **overrides}


class LLMEngine:
    """Owns the tokenizer, input processor, scheduler and model runner."""

    def __init__(self, config: VllmConfig, log_stats: bool = True,
                 async_scheduling: bool = True, warmup: bool | None = None,
                 tp_rank: int = 0) -> None:
        t0 = time.perf_counter()
        # Tensor parallelism: rank 0 (this engine, unless ``tp_rank`` says it is another
        # rank's replica) starts the other ranks and sends them its state-changing calls
        # (vllm/distributed/tp_engine.py).
        tp = config.parallel_config.tensor_parallel_size
        self._ranks = None
        self._tp_rank = tp_rank
        if tp > 1 and tp_rank == 0:
            from vllm.distributed.tp_engine import rank_device, start_ranks

            # The replicas schedule as this engine does and warm up with its calls.
            self._ranks = start_ranks(
                config, type(self), dict(async_scheduling=async_scheduling, warmup=warmup))
            config = rank_device(config, 0)  # GPU 0 (rank r of the others: GPU r)
        try:
            self._build(config, log_stats, async_scheduling, warmup, t0)
        except BaseException:
            if self._ranks is not None:  # the other ranks stop with this one
                self._ranks.terminate()
            raise

    def _build(self, config: VllmConfig, log_stats: bool, async_scheduling: bool,
               warmup: bool | None, t0: float) -> None:
        mc = config.model_config
        tp = config.parallel_config.tensor_parallel_size
        self.tokenizer = get_tokenizer(mc.tokenizer_path)
        # The model first, with the configuration as asked; the memory profile fits the
        # configuration to the pages that fit, and the runner is built with that one.
        loaded = load_model(config)
        t_profile = time.perf_counter()
        num_pages = determine_num_pages(config, loaded)
        if tp > 1:
            from vllm.distributed.tp_engine import agree_min

            num_pages = agree_min(num_pages)  # one page table for every rank's KV heads
            # Every request samples from seeded generators (``add_request``); anything else
            # drawing from the global generator draws the same on every rank.
            torch.manual_seed(mc.seed)
        profile_seconds = time.perf_counter() - t_profile
        check_context_fits(config, loaded.layout, num_pages)
        self.config = config
        self.runner = ModelRunner(config, loaded, num_pages)
        mc = config.model_config
        self.input_processor = MllamaInputProcessor(
            mc.spec, self.tokenizer, get_image_processor(mc.model_path),
            mc.limit_images_per_prompt, config.model_config.max_model_len,
            pixel_dtype=mc.dtype, pin_memory=self.runner.device.type == "cuda",
            processor_kwargs=mc.mm_processor_kwargs,
            image_cache_bytes=int(mc.mm_processor_cache_gb * (1 << 30)))
        lo = self.runner.layout
        self.block_manager = BlockManager(
            num_pages, lo.block_size, lo.cross_block_size,
            enable_prefix_caching=config.scheduler_config.enable_prefix_caching)
        vision = mc.spec.vision
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager,
                                   vision.max_num_tiles,
                                   vision.num_hidden_layers + vision.num_global_layers,
                                   encoder_layer_tokens(mc.spec.text, vision))
        self.generation_config = load_generation_config(config)
        eos = set(mc.spec.text.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.stats = EngineStats(mc.max_model_len, config.scheduler_config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, config, self.stats)
        self.log_stats = log_stats
        # Launch step N+1 before reading step N's results, so host work overlaps the GPU.
        self.async_scheduling = async_scheduling
        self._pending: StepHandle | None = None
        self._grammar_compiler: GrammarCompilerService | None = None
        self._compiler_lock = threading.Lock()
        self._last_log = time.monotonic()
        self._tokens_since_log = [0, 0]
        self._host_at_log = (0.0, 0)
        logger.info("Engine ready in %.1f s (model load %.1f s): %d KV pages of %d tokens, "
                    "max_model_len %d, max_num_seqs %d", time.perf_counter() - t0,
                    loaded.load_seconds,
                    num_pages - 1, lo.block_size, config.model_config.max_model_len,
                    config.scheduler_config.max_num_seqs)
        logger.info("Maximum concurrency for %d tokens per request with %d image(s): %.2fx",
                    config.model_config.max_model_len, mc.limit_images_per_prompt,
                    max_concurrency(config, lo, num_pages))
        # None: on CUDA only, where first uses of kernels compile (see vllm/engine/warmup.py).
        warmup_seconds = 0.0
        if warmup if warmup is not None else self.runner.device.type == "cuda":
            t_warm = time.perf_counter()
            if self._tp_rank == 0:
                warm_up(self)
            else:  # rank 0's warm-up requests reach this replica as rank 0's calls
                warm_up_kernels(self)
            warmup_seconds = time.perf_counter() - t_warm
        graphs = self.runner.graphs
        self.startup_times = StartupTimes(
            load=loaded.load_seconds, vision_graphs=loaded.vision_graph_seconds,
            profile=profile_seconds,
            decode_graphs=graphs.capture_time_s if graphs is not None else 0.0,
            warmup=warmup_seconds, total=time.perf_counter() - t0)
        logger.info("%s", self.startup_times.describe())

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config(), log_stats=not args.disable_log_stats,
                   async_scheduling=args.async_scheduling)

    @property
    def vllm_config(self) -> VllmConfig:
        """The engine's configuration (upstream's name for it; also ``self.config``)."""
        return self.config

    @property
    def model_config(self) -> Any:
        """``vllm_config.model_config``: the model, its dtype, ``max_model_len``, ..."""
        return self.config.model_config

    def get_model_config(self) -> Any:
        return self.config.model_config

    def get_vllm_config(self) -> VllmConfig:
        return self.config

    # ------------------------------------------------------------------ requests
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation-config defaults."""
        params = SamplingParams()
        params.update_from_generation_config(self.generation_config, self.eos_token_ids)
        return params

    def process_inputs(self, prompt: Any) -> Any:
        """The prompt's validated inputs, with its page keys under prefix caching (the
        server runs this in its input threads, so the engine loop does not hash prompts)."""
        return self.block_manager.key_prompt(self.input_processor.process(prompt))

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None, processed: Any = None,
                    grammar: Any = None, priority: int = 0) -> None:
        """Validates and queues a request; raises ValueError on bad input. A constrained
        request's grammar is compiled here unless given (``compile_grammar``, which the
        server runs in a thread before the request reaches the engine loop). ``priority``
        (``--scheduling-policy priority``): lower values are served first."""
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority'")
        params = params.clone() if params is not None else self.default_sampling_params()
        if self._ranks is not None and params.seed is None:
            # Every rank samples the request from generators of one seed (rank 0's draw).
            params.seed = random.getrandbits(62)
        sent = params.clone()
        params.update_from_generation_config(
            {"eos_token_id": self.generation_config.get("eos_token_id")}, self.eos_token_ids)
        self.check_params(params)
        if params.guided_decoding is not None and grammar is None:
            grammar = self.compile_grammar(params)
        inputs = processed if processed is not None else self.process_inputs(prompt)
        request = Request(request_id, inputs, params, priority=int(priority))
        request.grammar = grammar if params.guided_decoding is not None else None
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if self._ranks is not None:  # the same request on every rank, after it validated
            kwargs = dict(arrival_time=request.arrival_time, processed=inputs, priority=priority)
            self._ranks.send(("add", (request_id, None, sent), kwargs))
        self.scheduler.add_request(request)

    def check_params(self, params: SamplingParams) -> None:
        """Engine-level limits on sampling parameters (raises ValueError)."""
        cap = self.config.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cap:
                raise ValueError(f"Requested {name}={value} exceeds the maximum of {cap} "
                                 "(--max-logprobs).")
        vocab = self.config.model_config.spec.text.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids or []),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logit_bias", list((params.logit_bias or {}).keys()))):
            for t in ids:
                if not 0 <= int(t) < vocab:
                    raise ValueError(f"{name} contains token id {t}, outside the vocabulary "
                                     f"(0..{vocab - 1})")
        allowed = set(params.allowed_token_ids or [])
        if allowed and params.min_tokens and allowed <= set(params.all_stop_token_ids):
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens "
                             "suppresses: no token could be sampled")

    @property
    def grammar_compiler(self) -> GrammarCompilerService:
        """The engine's xgrammar compiler (built at the first constrained request)."""
        if self._grammar_compiler is None:
            with self._compiler_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = GrammarCompilerService(
                        self.tokenizer, self.config.model_config.spec.text.vocab_size,
                        self.eos_token_ids, self.config.decoding_config)
        return self._grammar_compiler

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled constraint of ``params`` (cached; thread-safe and bounded in time:
        raises ``GuidedDecodingError``, a ValueError, naming the problem)."""
        assert params.guided_decoding is not None
        return self.grammar_compiler.compile(params.guided_decoding)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self._ranks is not None:
            self._ranks.send(("abort", ids))
        for rid in ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                for s in req.seqs:
                    self.runner.release(s)
                self.output_processor.forget(req)
        if self._pending is not None and not self.scheduler.has_unfinished():
            self._collect(self._take_pending())  # only aborted sequences were in flight

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page and cross group: nothing is matched again until
        written again (pages in use stay with their owners)."""
        if self._ranks is not None:
            self._ranks.send(("reset_prefix_cache",))
        self.block_manager.pool.reset()
        return True

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do with one)."""
        if self._ranks is not None:
            self._ranks.shutdown()

    def __del__(self) -> None:
        ranks = getattr(self, "_ranks", None)
        if ranks is not None and not ranks.closed:
            # The group may be gone already (interpreter exit).
            with contextlib.suppress(Exception):
                ranks.shutdown(timeout_s=5.0)

    def reset_counters(self) -> None:
        """Zeroes the step counters (graph replays, host time, ...), the preemption count and
        the request and step statistics behind /metrics."""
        self.runner.stats = RunnerStats()
        self.stats.reset()
        self.scheduler.num_preemptions = 0
        pool = self.block_manager.pool
        pool.prefix_cache_queries = pool.prefix_cache_hits = 0
        pool.cross_cache_queries = pool.cross_cache_hits = 0
        self._tokens_since_log = [0, 0]
        self._host_at_log = (0.0, 0)
        self._last_log = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step; returns the outputs that became available.

        With async scheduling the next step is launched while the previous step's results are
        still in flight (unless a preemption needs them), and the previous step is processed
        while the new one runs; outputs lag one step.

        Raises :class:`~vllm.engine.errors.DeviceError` when the GPU failed: that is never
        pinned on a request, and no further step can run in this process.
        """
        if self._ranks is None:
            return self._checked_step()
        with self._ranks.in_call():
            self._ranks.send(("step",))
            return self._checked_step()

    def _checked_step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except DeviceError:
            raise
        except Exception as e:
            if is_device_error(e):
                raise device_error(e) from e
            if self._ranks is not None:  # a rank that died fails the step by name
                self._ranks.check(wait_s=2.0 if isinstance(e, RuntimeError) else 0.0)
            raise

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        out = None
        if self._pending is not None:
            # Decided while the previous step runs, unless it needs that step's results.
            out = self.scheduler.schedule(lookahead=True)
            if out is None:
                outputs += self._collect(self._take_pending())
        if out is None:
            out = self.scheduler.schedule()
        if out is None:
            return outputs
        self._release_preempted(out)
        if out.is_empty:
            return outputs  # everything running was preempted; the next step re-admits it
        self._mark_scheduled(out)
        try:
            handle = self.runner.launch(out)
        except Exception as e:  # attributed below, or re-raised
            if self._pending is not None:
                outputs += self._collect(self._take_pending())
            return outputs + self._isolate_failure(out, e)
        for s in handle.result.seqs:
            s.inflight += 1
        previous, self._pending = self._pending, handle
        if handle.finish is not None:
            # Constrained rows: the previous step's tokens advance their matchers, then this
            # step's masks are filled and it is sampled, while the GPU runs its forward.
            if previous is not None:
                outputs += self._collect(previous)
                previous = None
            try:
                self.runner.finish_launch(handle)
            except Exception as e:  # attributed below, or re-raised
                self._pending = None
                for s in handle.result.seqs:
                    s.inflight -= 1
                return outputs + self._isolate_failure(out, e)
        if previous is not None:
            outputs += self._collect(previous)
        if not self.async_scheduling:
            outputs += self._collect(self._take_pending())
        self._maybe_log(out, handle.result)
        return outputs

    @staticmethod
    def _mark_scheduled(out: SchedulerOutput) -> None:
        now = time.time()
        for c in out.chunks:
            if c.seq.request.first_scheduled_time is None:
                c.seq.request.first_scheduled_time = now

    def _fail_request(self, request: Request, error: Exception) -> list[RequestOutput]:
        if is_device_error(error):
            raise device_error(error) from error
        logger.error("Request %s failed in a step: %r", request.request_id, error)
        request.error = error
        output = self.output_processor.fail(request)
        self.abort_request(request.request_id)
        return [output]

    def _isolate_failure(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A step failed. Requests whose own inputs make sampling fail are failed alone;
        the requests of the step's prefill are preempted (recomputed later), its decode
        simply runs again (the same positions are recomputed). Anything that cannot be
        pinned on a request is an engine failure and is re-raised, and so is a failed
        device, whatever else a request's own sampling inputs would raise now."""
        if is_device_error(error):
            raise device_error(error) from error
        guilty = []
        for req in out.requests:
            try:
                self.runner.check_sampling(req.unfinished_seqs())
            except Exception as e:  # this request cannot be sampled alone
                guilty.append((req, e))
        if not guilty:
            raise error
        failed_ids = {id(r) for r, _ in guilty}
        prefilled = {id(c.seq.request): c.seq.request for c in out.chunks}
        for req in prefilled.values():
            if id(req) not in failed_ids and req in self.scheduler.running:
                self.scheduler.preempt(req)
                for s in req.seqs:
                    self.runner.release(s)
        results = []
        for req, e in guilty:
            results += self._fail_request(req, e)
        return results

    def _take_pending(self) -> StepHandle:
        handle, self._pending = self._pending, None
        assert handle is not None
        return handle

    def _collect(self, handle: StepHandle) -> list[RequestOutput]:
        result = self.runner.collect(handle)
        self.scheduler.cache_written(result.written, result.written_cross)
        return self.output_processor.process(result, self.scheduler, self.runner)

    def _release_preempted(self, out: SchedulerOutput) -> None:
        for req in out.preempted:
            for s in req.seqs:
                self.runner.release(s)

    def _maybe_log(self, out: SchedulerOutput, result: Any) -> None:
        self._tokens_since_log[0] += out.num_prefill_tokens
        self._tokens_since_log[1] += len(result.seqs)
        now = time.monotonic()
        if not self.log_stats or now - self._last_log < 5.0:
            return
        dt = now - self._last_log
        stats = self.runner.stats
        host_s, steps = stats.host_time_s - self._host_at_log[0], stats.steps - self._host_at_log[1]
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, preemptions: %d, "
            "host %.3f ms/step, graph replays %d, eager decode steps %d",
            self._tokens_since_log[0] / dt, self._tokens_since_log[1] / dt,
            len(self.scheduler.running), len(self.scheduler.waiting),
            100 * self.block_manager.pool.usage(), self.scheduler.num_preemptions,
            1e3 * host_s / max(steps, 1), sum(stats.graph_replays.values()),
            stats.eager_decode_steps)
        self._last_log = now
        self._tokens_since_log = [0, 0]
        self._host_at_log = (stats.host_time_s, stats.steps)

    # ------------------------------------------------------------------ introspection
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def check_integrity(self) -> None:
        """Page-pool integrity (tests call this after every run)."""
        self.scheduler.check_integrity()

    def kv_cache_usage(self) -> float:
        return self.block_manager.pool.usage()
