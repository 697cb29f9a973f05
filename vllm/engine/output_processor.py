"""Turns sampled tokens into request state and ``RequestOutput``s.

Per sampled token: append it, record logprobs, detokenize incrementally, then check the stop
conditions in vLLM's order (EOS unless ignore_eos, stop_token_ids, stop strings, max_tokens,
max_model_len), all subject to min_tokens; a constrained sequence's grammar matcher accepts
the token first, and the sequence stops once the grammar has accepted a stop token. A request
with ``max_tokens=0`` ends when its
prefill's results arrive, without the token that prefill sampled (its prompt logprobs are the
output).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.config import VllmConfig
from vllm.core.scheduler import Scheduler
from vllm.core.sequence import Request, Sequence, SequenceStatus
from vllm.engine.stats import EngineStats, FinishedRequest
from vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.sequence import Logprob
from vllm.transformers_utils.detokenizer import IncrementalDetokenizer

_MONO_TO_WALL = time.time() - time.monotonic()


def _complete(seq: Sequence) -> bool:
    """The sequence already holds ``max_tokens`` output tokens before this one: only with
    ``max_tokens=0`` (any other sequence finishes when its last token is appended)."""
    max_tokens = seq.request.params.max_tokens
    return max_tokens is not None and seq.num_output_tokens >= max_tokens


class _StepTiming:
    """One collected step's token count and latencies, per request: the time to its first
    output, or the time since its previous tokens (siblings of one request count once)."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.generated = 0
        self.first_tokens: list[float] = []
        self.inter_token: list[float] = []
        self._seen: set[str] = set()

    def observe(self, req: Request) -> None:
        if req.request_id not in self._seen:
            self._seen.add(req.request_id)
            if req.first_token_time is None:
                self.first_tokens.append(self.now - (req.arrival_time + _MONO_TO_WALL))
                req.first_token_time = self.now
            elif req.last_token_time is not None:
                self.inter_token.append(self.now - req.last_token_time)
        req.last_token_time = self.now


class OutputProcessor:
    """Applies a step's results to its sequences and builds the outputs."""

    def __init__(self, tokenizer: Any, config: VllmConfig,
                 stats: EngineStats | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self._sent: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens, chars) already sent
        self.stats = stats or EngineStats(
            self.max_model_len, config.scheduler_config.max_num_batched_tokens)

    def forget(self, request: Request) -> None:
        for s in request.seqs:
            self._sent.pop(s.seq_id, None)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detokenizer is None:
            p = seq.request.params
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.inputs.prompt_token_ids, p.skip_special_tokens,
                p.spaces_between_special_tokens, p.stop or [], p.include_stop_str_in_output)
        return seq.detokenizer

    def process(self, result: Any, scheduler: Scheduler, runner: Any) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        failed: list[tuple[Request, Exception]] = []
        timing = _StepTiming(now)
        for rid, (vals, ids, ranks) in result.prompt_logprobs.items():
            req = scheduler.requests.get(rid)
            if req is not None:
                req.prompt_logprobs = self._prompt_logprobs(req, vals, ids, ranks)
        for i, seq in enumerate(result.seqs):
            req = seq.request
            seq.inflight -= 1
            if seq.status.finished:
                continue  # finished while this step was in flight: the token is discarded
            touched[req.request_id] = req
            timing.observe(req)
            if _complete(seq):
                # max_tokens=0: the prefill's sampled token is not output (the request was
                # for its prompt logprobs); it ends here, like any request at max_tokens.
                scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH_CAPPED)
                runner.release(seq)
                continue
            seq.token_ids.append(result.token_ids[i])
            timing.generated += 1
            try:
                if seq.grammar is not None:  # its matcher follows the tokens as they arrive
                    seq.grammar.sync(seq.token_ids, seq.prompt_len)
                if result.logprobs is not None and req.params.logprobs is not None:
                    self._append_logprobs(seq, result, i)
                status = self._check_stop(seq)
            except Exception as e:  # fail this request, not the engine
                failed.append((req, e))
                continue
            if status is not None:
                scheduler.finish_seq(seq, status)
                runner.release(seq)
        for req, e in failed:
            req.error = e
            for s in req.seqs:
                if not s.status.finished:
                    scheduler.finish_seq(s, SequenceStatus.FINISHED_ABORTED)
                    runner.release(s)
        for req in scheduler.release_finished():
            req.finished_time = now
            self._record_finished(req)
        self.stats.record_step(
            result.num_prompt_tokens, timing.generated, timing.first_tokens, timing.inter_token)
        return [o for req in touched.values() if (o := self._output(req)) is not None]

    def _record_finished(self, req: Request) -> None:
        """A request that ended normally (an aborted or failed one is not counted)."""
        reasons = [s.status.finish_reason for s in req.seqs
                   if s.status != SequenceStatus.FINISHED_ABORTED]
        if not reasons or req.error is not None or req.finished_time is None:
            return
        self.stats.record_finished(FinishedRequest(
            arrival=req.arrival_time + _MONO_TO_WALL, scheduled=req.first_scheduled_time,
            first_token=req.first_token_time, finished=req.finished_time,
            prompt_tokens=len(req.inputs.prompt_token_ids),
            generated=[s.num_output_tokens for s in req.seqs],
            finish_reasons=[r for r in reasons if r is not None], n=req.params.n,
            max_tokens=req.params.max_tokens))

    def fail(self, request: Request) -> RequestOutput:
        """The final output of a request that failed inside the engine."""
        for s in request.seqs:
            if not s.status.finished:
                s.status = SequenceStatus.FINISHED_ABORTED
        out = self._output(request, force=True)
        assert out is not None
        return out

    def _append_logprobs(self, seq: Sequence, result: Any, i: int) -> None:
        k = seq.request.params.logprobs
        vals, ids, rank = result.logprobs[i], result.logprob_ids[i], result.ranks[i]
        entry = {ids[0]: Logprob(vals[0], rank, self._decode_one(ids[0]))}
        for j in range(1, 1 + k):
            if ids[j] not in entry:
                entry[ids[j]] = Logprob(vals[j], j, self._decode_one(ids[j]))
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(entry)
        seq.cumulative_logprob += vals[0]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_logprobs(self, req: Request, vals, ids, ranks) -> list:
        k = req.params.prompt_logprobs
        out: list = [None]
        for t in range(len(vals)):
            if ranks[t] == 0:  # an image token: not in the vocabulary, no logprob
                out.append(None)
                continue
            entry = {ids[t][0]: Logprob(vals[t][0], ranks[t], self._decode_one(ids[t][0]))}
            for j in range(1, 1 + k):
                if ids[t][j] not in entry:
                    entry[ids[t][j]] = Logprob(vals[t][j], j, self._decode_one(ids[t][j]))
            out.append(entry)
        return out

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        p = seq.request.params
        token = seq.token_ids[-1]
        n_out = seq.num_output_tokens
        detok = self._detokenizer(seq)
        min_reached = n_out >= p.min_tokens
        result = detok.add_tokens([token], check_stop=min_reached)
        if min_reached:
            if not p.ignore_eos and token in p.eos_token_ids:
                detok.flush()
                return SequenceStatus.FINISHED_STOPPED
            if token in (p.stop_token_ids or ()):
                seq.stop_reason = token
                detok.flush()
                return SequenceStatus.FINISHED_STOPPED
            if result.stop_string is not None:
                seq.stop_reason = result.stop_string
                return SequenceStatus.FINISHED_STOPPED
        if seq.grammar is not None and seq.grammar.terminated:
            # The constraint accepted a stop token (also with ignore_eos or min_tokens unmet:
            # the grammar allows nothing after it).
            detok.flush()
            return SequenceStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= self.max_model_len:
            detok.flush()
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _completion(self, seq: Sequence, delta: bool) -> CompletionOutput:
        text = seq.detokenizer.output_text if seq.detokenizer is not None else ""
        tokens = seq.output_token_ids
        logprobs = seq.logprobs
        if delta:
            sent_tok, sent_chr = self._sent.get(seq.seq_id, (0, 0))
            self._sent[seq.seq_id] = (len(tokens), len(text))
            tokens, text = tokens[sent_tok:], text[sent_chr:]
            logprobs = logprobs[sent_tok:] if logprobs is not None else None
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(tokens),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=logprobs, finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason)

    def _output(self, req: Request, force: bool = False) -> RequestOutput | None:
        kind = req.params.output_kind
        finished = req.finished or force
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        seqs = sorted(req.seqs, key=lambda s: s.index)
        out = RequestOutput(
            request_id=req.request_id, prompt=req.inputs.prompt,
            prompt_token_ids=list(req.inputs.prompt_token_ids),
            prompt_logprobs=req.prompt_logprobs,
            outputs=[self._completion(s, kind == RequestOutputKind.DELTA) for s in seqs],
            finished=finished, metrics=self._metrics(req), num_images=req.inputs.num_images,
            encoder_prompt=req.inputs.encoder_prompt,
            encoder_prompt_token_ids=req.inputs.encoder_prompt_token_ids, error=req.error)
        if finished:
            self.forget(req)
        return out

    @staticmethod
    def _metrics(req: Request) -> RequestMetrics:
        arrival = req.arrival_time + _MONO_TO_WALL
        scheduled = req.first_scheduled_time
        return RequestMetrics(
            arrival_time=arrival,
            first_scheduled_time=scheduled, first_token_time=req.first_token_time,
            last_token_time=req.last_token_time, finished_time=req.finished_time,
            time_in_queue=None if scheduled is None else max(0.0, scheduled - arrival),
            num_preemptions=req.num_preemptions)
