"""Row chunks against eager chunks over growing cached contexts, in one engine on one GPU.

For each case ``C:N`` a text prompt of C random tokens is prefilled once (its pages cached),
then prompts of those C tokens plus N fresh ones run with ``max_tokens=1``, alternately as
decode-graph rows and eagerly (``ModelRunner.row_chunk_tokens``; the rows x keys bound is
lifted, so the cases can probe where it should lie). Prints, per case, the median time of
``LLM.generate`` both ways. Usage (repository root, GPU):

    python tools/row_chunk_contexts.py --cases 1024:128,2048:128,8192:32,8192:128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from vllm import LLM, SamplingParams
from vllm.worker import model_runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo/mllama-11b")
    p.add_argument("--cases", default="1024:128,2048:128,4096:64,8192:32,8192:128")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    longest = max(c + n for c, n in cases)
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_model_len=longest + 16, enable_prefix_caching=True)
    runner = llm.llm_engine.runner
    model_runner.ROW_CHUNK_KEYS = 1 << 40
    one = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)
    vocab = llm.llm_engine.config.model_config.spec.text.vocab_size
    top = min(vocab, 100000)
    results = []
    for context, new in cases:
        base = [rng.randrange(top // 10, top) for _ in range(context)]
        llm.generate([{"prompt_token_ids": base}], one, use_tqdm=False)
        times: dict[str, list[float]] = {"rows": [], "eager": []}
        for _ in range(args.repeat):
            for mode in ("rows", "eager"):
                runner.row_chunk_tokens = 128 if mode == "rows" else 0
                ids = base + [rng.randrange(top // 10, top) for _ in range(new)]
                before = runner.stats.row_chunks
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
                times[mode].append(1e3 * (time.perf_counter() - t0))
                ran_rows = runner.stats.row_chunks > before
                if ran_rows != (mode == "rows"):
                    raise RuntimeError(f"case {context}:{new} {mode}: rows ran = {ran_rows}")
        row = {"context": context, "new": new,
               **{m: round(statistics.median(v), 2) for m, v in times.items()}}
        results.append(row)
        print(json.dumps(row), flush=True)
    print("context | new tokens | rows ms | eager ms | rows / eager")
    for r in results:
        print(f"{r['context']} | {r['new']} | {r['rows']} | {r['eager']} | "
              f"{r['rows'] / r['eager']:.2f}")


if __name__ == "__main__":
    main()
