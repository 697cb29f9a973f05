"""Decode step time with every row under a JSON-schema constraint vs unconstrained, in one run.

For each batch size, ``bs`` requests decode ``--output-len`` tokens twice: free
(``ignore_eos``), then each constrained by an array of at least ``--min-items`` of the suite's
nested object (``guided_schemas.NESTED``), so that no row's grammar completes before
``--output-len`` tokens. The step time is the median interval between consecutive decode
launches at the full batch (the engine pipelines steps, so the interval is what a step
costs). It also reports the host time of filling the masks and sampling
(``ModelRunner.finish_launch``, overlapped with the forward), the fraction of decode steps
replayed from graphs, and the cold compile time of every constraint of the suite.

    python -m benchmarks.engine guided --load-format dummy --dtype bfloat16 --out g.json
    python -m benchmarks.engine guided --smoke          # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.common import EngineView, make_prompt
from benchmarks.engine.guided_schemas import CASES, NESTED
from vllm import LLM, SamplingParams
from vllm.model_executor.guided_decoding.compiler import GrammarCompilerService
from vllm.sampling_params import GuidedDecodingParams


def parse_args(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo/mllama-11b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=320)
    ap.add_argument("--min-items", type=int, default=12)
    ap.add_argument("--compact", action="store_true", help="JSON without optional whitespace")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, small run (CPU)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.max_model_len, args.batch_sizes = "demo/mllama-tiny", 512, [1, 4]
        args.input_len, args.output_len, args.min_items = 16, 32, 2
    return args


def long_schema(min_items: int) -> dict[str, Any]:
    """The suite's nested object, repeated: its outputs cannot end early."""
    return {"type": "array", "items": NESTED, "minItems": min_items}


class StepTrace:
    """Times each decode launch and each deferred sampling (``finish_launch``)."""

    def __init__(self, view: EngineView) -> None:
        self.launches: list[tuple[float, int]] = []  # (time, sequences) of decode steps
        self.finish_ms: list[float] = []
        runner = view.runner
        launch, finish = runner.launch, runner.finish_launch

        def traced_launch(out: Any) -> Any:
            if out.decode_seqs and not out.chunks:
                self.launches.append((time.perf_counter(), len(out.decode_seqs)))
            return launch(out)

        def traced_finish(handle: Any) -> None:
            if handle.finish is None:
                return finish(handle)
            t0 = time.perf_counter()
            finish(handle)
            self.finish_ms.append((time.perf_counter() - t0) * 1e3)
            return None

        runner.launch, runner.finish_launch = traced_launch, traced_finish

    def clear(self) -> None:
        self.launches.clear()
        self.finish_ms.clear()

    def step_ms(self, bs: int) -> float:
        """Median interval between consecutive decode launches that both ran ``bs`` rows."""
        gaps = [
            (t1 - t0) * 1e3
            for (t0, n0), (t1, n1) in zip(self.launches, self.launches[1:], strict=False)
            if n0 == n1 == bs
        ]
        return statistics.median(gaps) if gaps else float("nan")


def run_batch(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[Any]:
    return llm.generate(prompts, [params] * len(prompts), use_tqdm=False)


def measure(llm: LLM, view: EngineView, trace: StepTrace, args: argparse.Namespace) -> list:
    guided = GuidedDecodingParams(
        json=long_schema(args.min_items), disable_any_whitespace=args.compact
    )
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, guided_decoding=guided
    )
    rows = []
    for bs in args.batch_sizes:
        prompts = [make_prompt(llm, False, args.input_len, seed) for seed in range(bs)]
        run_batch(llm, prompts[:1], constrained)  # warm-up (compiles the schema)
        record: dict[str, Any] = {"bs": bs}
        for name, params in (("free", free), ("constrained", constrained)):
            trace.clear()
            stats = view.stats
            replayed0, eager0 = sum(stats.graph_replays.values()), stats.eager_decode_steps
            outs = run_batch(llm, prompts, params)
            replayed = sum(stats.graph_replays.values()) - replayed0
            eager = stats.eager_decode_steps - eager0
            record[name] = {
                "step_ms": trace.step_ms(bs),
                "replay_fraction": replayed / max(1, replayed + eager),
                "min_output_tokens": min(len(o.outputs[0].token_ids) for o in outs),
                "finish_ms": statistics.median(trace.finish_ms) if trace.finish_ms else None,
            }
        record["ratio"] = record["constrained"]["step_ms"] / record["free"]["step_ms"]
        rows.append(record)
    return rows


def compile_times(llm: LLM) -> dict[str, float]:
    """Cold compile seconds of each constraint of the suite (a fresh compiler each)."""
    engine = llm.llm_engine
    vocab = engine.config.model_config.spec.text.vocab_size
    times = {}
    for case in CASES:
        svc = GrammarCompilerService(
            engine.tokenizer, vocab, engine.eos_token_ids, engine.config.decoding_config
        )
        t0 = time.perf_counter()
        svc.compile(GuidedDecodingParams(**{case.kind: case.spec}))
        times[case.name] = time.perf_counter() - t0
        svc.shutdown()
    return times


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    args = parse_args(argv, prog)
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
    )
    view = EngineView(llm)
    trace = StepTrace(view)
    rows = measure(llm, view, trace, args)
    compiles = compile_times(llm)
    print(f"{'bs':>4} {'free ms':>9} {'guided ms':>10} {'ratio':>6} {'fill ms':>8} {'replay':>7}")
    for r in rows:
        c, f = r["constrained"], r["free"]
        print(
            f"{r['bs']:>4} {f['step_ms']:>9.3f} {c['step_ms']:>10.3f} {r['ratio']:>6.3f} "
            f"{c['finish_ms']:>8.3f} {c['replay_fraction']:>7.1%}"
        )
    print(
        f"suite compile: {sum(compiles.values()):.3f} s in total, "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in compiles.items())
    )
    record = {"model": args.model, "rows": rows, "compile_s": compiles, "args": vars(args)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
