"""Runs one scheduled step: inputs -> forward (eager or graph replay) -> sampling.

Prefill steps run eagerly over packed prompts and all their images at once. Decode steps read
their inputs from the persistent device rows (``decode_state.py``): the host sends only which
rows run (and appended pages); sampled tokens and positions are advanced on the device. Results
reach the host through ``step_results.ResultCopier`` without the launch waiting for them.

A short chunk whose tokens all see what decode tokens see (no image to encode or write: a chat's
new turn over its cached history, a short text prompt) runs as extra rows of the step's decode
graph instead (``_row_chunks``): one token per row, each attending to its sequence's pages up to
its position, so its prefill costs a graph replay instead of an eager forward whose host
launches take longer than its GPU work.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm.attention.metadata import DecodeMetadata
from vllm.config import VllmConfig
from vllm.core.scheduler_output import EncoderWork, PrefillChunk, SchedulerOutput
from vllm.core.sequence import Request, Sequence
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    compute_prompt_logprobs,
    make_generator,
)
from vllm.model_executor.layers.sampling_utils import select_row_argmax
from vllm.model_executor.models.mllama_vision import ImagesEncoding
from vllm.utils import to_device
from vllm.worker.cache_engine import CacheEngine
from vllm.worker.cuda_graph import DecodeGraphRunner, DecodeShape
from vllm.worker.decode_state import DecodeRows
from vllm.worker.grammar_rows import GrammarRows, any_constrained, grammar_of
from vllm.worker.loaded_model import LoadedModel
from vllm.worker.prefill_inputs import (
    PrefillBatch,
    PrefillItem,
    build_prefill_batch,
    prefill_row_buckets,
    step_images,
)
from vllm.worker.step_results import (
    PromptLogprobsOnDevice,
    ResultCopier,
    StepHandle,
    StepOutput,
)

logger = init_logger(__name__)

# The longest chunk run as decode-graph rows (``ModelRunner._row_chunks``); longer ones, and
# any that would not fit the largest graph beside the step's decode rows, run eagerly.
ROW_CHUNK_TOKENS = 128
# Each row reads its sequence's keys on its own (the eager kernels read them once per tile of
# queries), so a row chunk is also bounded by its rows x the self-attention keys the last one
# sees: 128 rows over 2k tokens, 32 over 8k. On the H200 (11B) rows took 0.50-0.81 of the
# eager time up to 256k and 1.02-1.09 at 512k (``tools/row_chunk_contexts.py``). The cross
# keys are bounded by the largest image group: 6,404 for 4 tiles.
ROW_CHUNK_KEYS = 256 * 1024


@dataclass
class RunnerStats:
    """Counters readable by tests, benchmarks and /metrics."""

    graph_replays: Counter = field(default_factory=Counter)  # (family, bucket) -> replays
    eager_decode_steps: int = 0
    encoder_steps: int = 0  # steps that advanced an image encoding spread over steps
    images_encoded_ahead: int = 0  # requests whose images were encoded before their prefill
    prefill_steps: int = 0  # steps with a prefill forward
    prefill_chunks: int = 0  # chunks that did not end their prompt (more steps follow)
    row_chunks: int = 0  # chunks run as rows of the decode graph (``_row_chunks``)
    host_time_s: float = 0.0  # host time spent launching steps
    steps: int = 0


def _step_invariant(seq: Sequence) -> bool:
    """Whether the sequence's sampling inputs no longer depend on its outputs."""
    p = seq.request.params
    return (
        p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and (not p.min_tokens or seq.num_output_tokens >= p.min_tokens)
    )


class ModelRunner:
    """Owns the model's KV pages, the decode rows, the sampler and the decode graphs.

    Built once, with the final configuration (after the memory profile fitted it to
    ``num_pages``), from a :class:`LoadedModel`.
    """

    def __init__(self, config: VllmConfig, loaded: LoadedModel, num_pages: int) -> None:
        self.config = config
        mc, sc = config.model_config, config.scheduler_config
        self.device = config.device_config.device
        self.model = loaded.model
        self.layout = loaded.layout
        self.vision_graphs = loaded.vision_graphs
        self.vocab_size = mc.spec.text.vocab_size
        fused = loaded.kernels.fused
        self.sampler = Sampler(select_row_argmax(fused))
        self.bucket_sizes = tuple(config.compilation_config.cuda_graph_sizes)
        self.cache_engine = CacheEngine(self.layout, num_pages, self.device)
        self.cache_engine.bind(self.model)
        self.max_pages_per_seq = self.layout.pages_for_tokens(mc.max_model_len)
        self.max_cross_pages = self.layout.cross_pages_for_tokens(mc.max_encoder_seq_len)
        # Chunks of at most this many tokens may run as decode-graph rows (0: never).
        self.row_chunk_tokens = 0 if mc.enforce_eager else ROW_CHUNK_TOKENS
        self.rows = DecodeRows(
            sc.max_num_seqs,
            self.max_pages_per_seq,
            self.max_cross_pages,
            self.layout.block_size,
            self.device,
            fused=fused,
            run_rows=0 if mc.enforce_eager else max(self.bucket_sizes),
        )
        self.stats = RunnerStats()
        self.prefix_caching = sc.enable_prefix_caching  # report what each step writes
        self.results = ResultCopier(self.device, sc.max_num_seqs)
        self.grammar_rows = GrammarRows(sc.max_num_seqs, self.vocab_size, self.device)
        # The last decode batch's sequences and sampling inputs, while they cannot change
        # from step to step (see _decode_sampling).
        self._steady_sampling: tuple[list[Sequence], SamplingMetadata] | None = None
        self.graphs: DecodeGraphRunner | None = None
        if not mc.enforce_eager:
            self.graphs = DecodeGraphRunner(
                self.decode_forward,
                self.rows,
                self.bucket_sizes,
                self.max_pages_per_seq,
                self.max_cross_pages,
                mc.max_model_len,
                mc.max_encoder_seq_len,
                self.vocab_size,
                self.sampler.argmax,
            )
            self.graphs.capture()

    def encode_images(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, num_tiles: list[int]
    ) -> torch.Tensor:
        if self.vision_graphs is not None:
            return self.vision_graphs.encode(pixel_values, aspect_ratio_ids, num_tiles)
        return self.model.encode_images(pixel_values, aspect_ratio_ids, num_tiles)

    def _advance_encoder(self, work: EncoderWork) -> None:
        """Runs a waiting request's next image-layers (``ImagesEncoding``); the projected
        vision tokens go to its prefill record once the last layer ran."""
        p = work.progress
        encoding = p.encoder
        if encoding is None:
            images = p.request.inputs.images
            assert images is not None
            pixels = to_device(images.pixel_values, images.pixel_values.dtype, self.device)
            ar_ids = to_device(images.aspect_ratio_ids, torch.int64, self.device)
            encoding = ImagesEncoding(
                self.model.vision_model, pixels, ar_ids, list(images.num_tiles)
            )
        self.stats.encoder_steps += 1
        if encoding.advance(work.layers):
            p.finish_encoding(self.model.multi_modal_projector(encoding.output()))
            self.stats.images_encoded_ahead += 1
        else:
            p.hold_encoder(encoding, encoding.remaining_layers())

    @torch.inference_mode()
    def warm_up_prefill_gemms(self) -> int:
        """Runs every distinct projection of the text layers once at each padded prefill row
        count up to the step budget (through ``Linear.forward``, on contiguous inputs as the
        model's are), so no served prefill meets a GEMM row count for the first time (see
        ``prefill_inputs.prefill_rows``). Returns the number of calls."""
        linears: dict[tuple, Linear] = {}
        for m in self.model.language_model.model.layers.modules():
            if isinstance(m, Linear):
                key = (m.out_features, m.in_features, m.compute_dtype, m.fmt.name)
                linears.setdefault(key, m)
        if not linears:
            return 0
        rows = prefill_row_buckets(self.config.scheduler_config.max_num_batched_tokens)
        widest = max(m.in_features for m in linears.values())
        dtype = next(iter(linears.values())).compute_dtype
        flat = torch.zeros(rows[-1] * widest, dtype=dtype, device=self.device)
        for m in linears.values():
            for r in rows:
                m(flat[: r * m.in_features].view(r, m.in_features))
        return len(linears) * len(rows)

    @torch.inference_mode()
    def warm_up_attention_kernels(self) -> list[int]:
        """Compiles the attention back-end's prefill kernel variants that the warm-up
        requests may not reach (the back-end's ``warm_up``, where it has one); returns what
        it ran (for the Triton back-end, the key-split counts)."""
        selfs, _ = self.model.attention_layers()
        backend = selfs[0].backend if selfs else None
        warm = getattr(backend, "warm_up", None)
        if warm is None:
            return []
        attn = selfs[0]
        return warm(
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            self.config.model_config.dtype,
            self.device,
        )

    # ------------------------------------------------------------------ steps
    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Runs a step to completion (launch, then wait for its results)."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Enqueues a step's device work (decode, encoder layers, prefill, in that order);
        results reach the host asynchronously."""
        start = time.perf_counter()
        # Sampling inputs first: what a request can make fail fails before any device work,
        # so a failed step leaves the decode rows as they were (and can run again).
        row_chunks = self._row_chunks(out)
        chunks = [c for c in out.chunks if c not in row_chunks]
        row_samplers = [s for c in row_chunks for s in c.samplers]
        samplers = [s for c in chunks for s in c.samplers]
        decode_sampling = self._decode_sampling(out.decode_seqs) if out.decode_seqs else None
        row_sampling = self._sampling_rows(row_samplers) if row_samplers else None
        prefill_sampling = self._sampling_rows(samplers) if samplers else None
        parts: list[tuple[SamplerOutput, int]] = []
        prompt_logprobs: dict[str, PromptLogprobsOnDevice] = {}
        written_cross: list[tuple[Request, list[int]]] = []
        deferred = None
        if decode_sampling is not None or row_chunks:
            decoded, from_rows = self._decode(out, decode_sampling, row_chunks, row_sampling)
            if isinstance(decoded, SamplerOutput):
                parts.append((decoded, len(out.decode_seqs)))
            elif decoded is not None:  # constrained rows: sampled by finish_launch
                deferred = decoded
            if from_rows is not None:
                parts.append((from_rows, len(row_samplers)))
        for work in out.encoder_work:
            self._advance_encoder(work)
        if chunks:
            sampled = self._prefill(chunks, prefill_sampling, prompt_logprobs, written_cross)
            if sampled is not None:
                parts.append((sampled, len(samplers)))
        self.stats.prefill_chunks += sum(1 for c in out.chunks if not c.samplers)
        self.stats.row_chunks += len(row_chunks)
        self.cache_engine.copy_pages(out.page_copies)
        result = StepOutput(
            seqs=out.decode_seqs + row_samplers + samplers,
            token_ids=[],
            num_prompt_tokens=out.num_prefill_tokens,
        )
        if self.prefix_caching:
            result.written = [(s, len(s) + s.inflight) for s in out.decode_seqs]
            result.written += [(c.seq, c.end) for c in out.chunks]
            result.written_cross = written_cross
        if deferred is None:
            handle = self.results.start(result, parts, prompt_logprobs)
        else:
            n_decode = len(out.decode_seqs)

            def finish() -> tuple[list[tuple[SamplerOutput, int]], dict]:
                return [(deferred(), n_decode), *parts], prompt_logprobs

            handle = StepHandle(result, None, None, {}, None, finish=finish)
        self.stats.host_time_s += time.perf_counter() - start
        self.stats.steps += 1
        return handle

    @torch.inference_mode()
    def finish_launch(self, handle: StepHandle) -> None:
        """Samples a launched step whose sampling was deferred (constrained rows), once the
        engine has applied the previous step's tokens; nothing to do for any other step."""
        if handle.finish is None:
            return
        start = time.perf_counter()
        finish, handle.finish = handle.finish, None
        parts, prompt_logprobs = finish()
        started = self.results.start(handle.result, parts, prompt_logprobs)
        handle.sampled, handle.logprobs, handle.prompt_logprobs, handle.event = (
            started.sampled,
            started.logprobs,
            started.prompt_logprobs,
            started.event,
        )
        self.stats.host_time_s += time.perf_counter() - start

    def collect(self, handle: StepHandle) -> StepOutput:
        """Waits for a launched step and returns its host results."""
        self.finish_launch(handle)
        return self.results.collect(handle)

    def release(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self.rows.release(seq.row)
            seq.row = -1

    def check_sampling(self, seqs: list[Sequence]) -> None:
        """Builds the sampling inputs of some sequences alone (raises what a step would)."""
        self._sampling_rows(seqs)
        for s in seqs:
            grammar_of(s)

    def _decode_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The decode step's sampling inputs. They change from step to step only through the
        outputs so far (penalties, min_tokens); without those, a batch of the same sequences
        as the last step reuses that step's (read-only) inputs instead of rebuilding them."""
        steady = self._steady_sampling
        if (
            steady is not None
            and len(steady[0]) == len(seqs)
            and all(a is b for a, b in zip(steady[0], seqs, strict=True))
        ):
            return steady[1]
        md = self._sampling_rows(seqs)
        self._steady_sampling = (list(seqs), md) if all(map(_step_invariant, seqs)) else None
        return md

    def _sampling_rows(self, seqs: list[Sequence]) -> SamplingMetadata:
        rows = []
        for s in seqs:
            p = s.request.params
            if s.generator is None and p.seed is not None:
                # One generator per sibling: same seed, same tokens, whatever the batch.
                s.generator = make_generator(p.seed + s.index, self.device)
            # A constrained sequence ends when its grammar allows nothing but a stop token:
            # min_tokens does not suppress them there.
            constrained = s.request.grammar is not None
            stop_ids = tuple(p.all_stop_token_ids) if p.min_tokens and not constrained else ()
            rows.append(
                SamplingRow(
                    p, s.request.inputs.prompt_token_ids, s.output_token_ids, s.generator, stop_ids
                )
            )
        return SamplingMetadata.build(rows, self.vocab_size, self.device)

    def _row_chunks(self, out: SchedulerOutput) -> list[PrefillChunk]:
        """The step's chunks that run as rows of its decode graph: short, sampling for one
        sequence at most, no prompt logprobs or grammar, and every token seeing what the
        sequence's decode tokens see (no image, or only the last image group, its cross K/V
        already in the pages). They take the rows the graph has beside the decode's."""
        if self.graphs is None or not self.row_chunk_tokens:
            return []
        room = self.graphs.sizes[-1] - len(out.decode_seqs)
        picked = []
        for c in out.chunks:
            req = c.seq.request
            n = c.num_tokens
            if n > min(room, self.row_chunk_tokens) or len(c.samplers) > 1:
                continue
            if n * c.end > ROW_CHUNK_KEYS:
                continue
            if req.params.prompt_logprobs is not None or req.grammar is not None:
                continue
            if req.has_images and not (req.cross_written and req.inputs.sees_last_group(c.start)):
                continue
            picked.append(c)
            room -= n
        return picked

    def _prefill(
        self,
        chunks: list[PrefillChunk],
        sampling: SamplingMetadata | None,
        prompt_logprobs: dict[str, PromptLogprobsOnDevice],
        written_cross: list[tuple[Request, list[int]]],
    ) -> SamplerOutput | None:
        """The step's prefill chunks in one forward; samples for the chunks that end their
        sequence's tokens (None if none does). Appends to ``written_cross`` the requests
        whose cross group it writes (with their cross tables)."""
        lo = self.layout
        items = [self._prefill_item(c) for c in chunks]
        written_cross += [
            (c.seq.request, list(item.cross_block_table))
            for c, item in zip(chunks, items, strict=True)
            if item.write_cross
        ]
        # The encoder first: the GPU runs it while the host builds the text inputs. With
        # vision graphs the pixels go from the (pinned) host tensors into the graph's buffer.
        graphs = self.vision_graphs
        images = step_images(items, self.device, upload=graphs is None)
        vision = None
        if images is not None and graphs is not None:
            vision = graphs.encode_host(
                images.host_pixels, images.host_aspect_ratio_ids, images.num_tiles
            )
        elif images is not None:
            vision = self.encode_images(
                images.pixel_values, images.aspect_ratio_ids, images.num_tiles
            )
        batch = build_prefill_batch(
            items,
            lo.block_size,
            lo.cross_block_size,
            self.device,
            pad_rows=True,
            max_context_tokens=self.config.model_config.max_model_len,
        )
        if batch.vision_parts:
            vision = batch.assemble_vision(vision)
        n_vision = 0 if vision is None else vision.shape[0]
        if n_vision != batch.num_vision_tokens:  # shapes are host data: no sync
            raise RuntimeError(
                f"prefill step: {n_vision} vision tokens encoded for the "
                f"{batch.num_vision_tokens} its chunks' ranges index"
            )
        for c in chunks:
            rows = batch.vision_rows.get(c.seq.request)
            held = c.progress.vision is not None
            if rows is not None and c.progress.computed and vision is not None and not held:
                # Later chunks of the request attend to the same vision tokens (a copy when
                # the step's vision holds other requests' too, so theirs can be freed).
                own = vision[rows[0] : rows[1]]
                c.progress.hold_vision(own if own.shape[0] == vision.shape[0] else own.clone())
        with set_forward_context(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions, vision)
        self._prompt_logprobs(chunks, batch, hidden, prompt_logprobs)
        self.stats.prefill_steps += 1
        if sampling is None:
            return None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        groups = [c.samplers for c in chunks if c.samplers]
        expand = [i for i, group in enumerate(groups) for _ in group]
        sample_seqs = [s for group in groups for s in group]
        if len(expand) != len(groups):
            logits = logits[to_device(expand, torch.int64, self.device)]
        if any_constrained(sample_seqs):  # nothing of theirs is in flight: masks now
            sampling.token_bitmask = self.grammar_rows.masks(sample_seqs)
        sampler_out = self.sampler(logits, sampling)
        self._start_decoding(sample_seqs, sampler_out)
        return sampler_out

    def _start_decoding(self, sample_seqs: list[Sequence], sampler_out: SamplerOutput) -> None:
        """Gives each sequence whose prefill ended a decode row holding its first token."""
        rows = []
        for s in sample_seqs:
            s.row = self.rows.acquire()
            rows.append(s.row)
            self.rows.load(
                s.row,
                s.block_table,
                s.request.cross_block_table,
                s.request.inputs.encoder_seq_len,
                len(s.token_ids),
            )
        self.rows.set_tokens(
            to_device(rows, torch.int64, self.device), sampler_out.sampled_token_ids
        )

    @staticmethod
    def _prefill_item(chunk: PrefillChunk) -> PrefillItem:
        req = chunk.seq.request
        sees = req.has_images and req.inputs.sees_images(chunk.start, chunk.end)
        write_cross = sees and not req.cross_written
        if write_cross:
            req.cross_written = True
        return PrefillItem(
            chunk.seq.token_ids[: chunk.end],
            req.inputs,
            req,
            chunk.seq.block_table,
            req.cross_block_table,
            write_cross,
            chunk.progress.vision if sees and not req.cross_cached else None,
            start=chunk.start,
            sees_images=sees,
            samples=bool(chunk.samplers),
            cross_cached=req.cross_cached,
        )

    def _prompt_logprobs(
        self,
        chunks: list[PrefillChunk],
        batch: PrefillBatch,
        hidden: torch.Tensor,
        into: dict[str, PromptLogprobsOnDevice],
    ) -> None:
        """Prompt logprobs of the requests that asked for them, left on the device (the
        result copier brings them to the host with the step's other results). A chunk's
        share is kept in its prefill record until the prompt's last chunk ran."""
        row = 0
        for c, n in zip(chunks, batch.metadata.seq_lens, strict=True):
            req, prompt_len = c.seq.request, c.seq.prompt_len
            k = req.params.prompt_logprobs
            # Token t predicts token t + 1; only prompt tokens have a prompt logprob.
            stop = min(c.end, prompt_len - 1)
            if k is not None and req.prompt_logprobs is None and c.seq.index == 0:
                if stop > c.start:
                    logits = self.model.compute_logits(hidden[row : row + stop - c.start])
                    # Image tokens (id >= vocab) cannot be sampled: no logprob there.
                    raw = c.seq.token_ids[c.start + 1 : stop + 1]
                    targets = to_device(
                        [t if t < self.vocab_size else 0 for t in raw], torch.int64, self.device
                    )
                    vals, ids, ranks = compute_prompt_logprobs(logits, targets, k)
                    c.progress.add_prompt_logprobs(
                        PromptLogprobsOnDevice(
                            vals, ids, ranks, [t >= self.vocab_size for t in raw]
                        )
                    )
                if c.samplers and c.progress.prompt_logprobs:
                    into[req.request_id] = PromptLogprobsOnDevice.concat(c.progress.prompt_logprobs)
                    c.progress.prompt_logprobs = []
            row += n

    def _decode(
        self,
        out: SchedulerOutput,
        sampling: SamplingMetadata | None,
        row_chunks: list[PrefillChunk],
        row_sampling: SamplingMetadata | None,
    ) -> tuple[SamplerOutput | Callable[[], SamplerOutput] | None, SamplerOutput | None]:
        """Replays (or runs) the forward of the decode rows and the row chunks' rows; samples
        the decode rows (with constrained rows, returns that sampling to run later instead:
        ``finish_launch``) and the row chunks that end their prompt."""
        seqs = out.decode_seqs
        self.rows.set_pages([(s.row, len(s.block_table) - 1, p) for s, p in out.new_pages])
        max_enc = max((s.request.inputs.encoder_seq_len for s in seqs), default=0)
        row_ids = [s.row for s in seqs]
        last_rows = []  # the row of each sampling row chunk's last token
        for c in row_chunks:
            req = c.seq.request
            enc = req.inputs.encoder_seq_len
            first = self.rows.run_start + len(row_ids) - len(seqs)
            self.rows.load_run(
                first,
                c.seq.block_table,
                req.cross_block_table,
                enc,
                c.seq.token_ids[c.start : c.end],
                c.start,
            )
            row_ids += range(first, first + c.num_tokens)
            if c.samplers:
                last_rows.append(len(row_ids) - 1)
            max_enc = max(max_enc, enc)
        n = len(seqs)
        greedy = None
        if self.graphs is not None:
            replay = self.graphs.run(row_ids, cross=max_enc > 0)
            logits, rows_t, greedy = replay.logits, replay.rows, replay.greedy
            self.stats.graph_replays[replay.key] += 1
            if row_chunks:
                logits, rows_t, greedy = logits[:n], rows_t[:n], greedy[:n]
        else:
            rows_t = to_device(row_ids, torch.int64, self.device)
            logits = self._eager_decode(seqs, rows_t, max_enc)
            self.stats.eager_decode_steps += 1
        from_rows = None
        if row_sampling is not None:
            assert self.graphs is not None
            idx = to_device(last_rows, torch.int64, self.device)
            from_rows = self.sampler(
                replay.logits[idx], row_sampling, greedy_ids=replay.greedy[idx]
            )
            self._start_decoding([s for c in row_chunks for s in c.samplers], from_rows)
        if sampling is None:
            return None, from_rows
        if not any_constrained(seqs):
            sampling.token_bitmask = None
            return self._sample_decode(logits, sampling, rows_t, greedy), from_rows

        def finish() -> SamplerOutput:
            # The graph's in-graph argmax is of unmasked logits: never used here.
            sampling.token_bitmask = self.grammar_rows.masks(seqs)
            return self._sample_decode(logits, sampling, rows_t, greedy)

        return finish, from_rows

    def _sample_decode(
        self,
        logits: torch.Tensor,
        sampling: SamplingMetadata,
        rows_t: torch.Tensor,
        greedy: torch.Tensor | None,
    ) -> SamplerOutput:
        sampler_out = self.sampler(logits, sampling, greedy_ids=greedy)
        if greedy is None:
            self.rows.advance(rows_t, sampler_out.sampled_token_ids)
        elif sampler_out.sampled_token_ids is not greedy:
            # The graph advanced the rows with its greedy tokens; these were sampled instead.
            self.rows.set_tokens(rows_t, sampler_out.sampled_token_ids)
        return sampler_out

    def _eager_decode(
        self, seqs: list[Sequence], rows_t: torch.Tensor, max_enc: int
    ) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        cross_width = max(max(len(s.request.cross_block_table) for s in seqs), 1)
        bucket = bisect.bisect_left(self.bucket_sizes, len(seqs))
        shape = DecodeShape(bucket, width, cross_width, max(len(s) for s in seqs), max_enc)
        return self.decode_forward(rows_t, shape)

    def decode_forward(
        self, rows: torch.Tensor, shape: DecodeShape, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decode forward on a row index tensor: gather inputs, run, logits [B, V]
        (float32, into ``logits_out`` when given). Exactly what a decode graph captures (with
        its static shape); the linear layers run the kernels of ``shape.bucket``."""
        inputs = self.rows.gather(rows, shape.width, shape.cross_width)
        md = DecodeMetadata(
            slot_mapping=inputs.slot_mapping,
            seq_lens_tensor=inputs.seq_lens,
            block_tables=inputs.block_tables,
            encoder_seq_lens_tensor=inputs.encoder_seq_lens,
            cross_block_tables=inputs.cross_block_tables,
            kv_ids=inputs.kv_ids,
            max_seq_len=shape.max_seq_len,
            max_encoder_seq_len=shape.max_encoder_seq_len,
        )
        with set_forward_context(md, row_bucket=shape.bucket):
            hidden = self.model(inputs.input_ids, inputs.positions, None)
            return self.model.compute_logits(hidden, out=logits_out)
