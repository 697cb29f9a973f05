"""Where the time of a short prefill chunk over a cached context goes (11B shape, CUDA).

    python -m benchmarks.profiling chunk --out /tmp/chunk [--repeat 5]

A chat turn over its cached history prefills a few new tokens whose keys include the whole
history. Per case (text or one 4-tile image; ``--context`` cached tokens, N new), the prompt's
prefix is cached first, then prompts of that prefix plus N fresh tokens run with
``max_tokens=1``, as decode-graph rows and eagerly (``ModelRunner.row_chunk_tokens``), in
alternation. Reported per case and mode: the median ``LLM.generate`` time and the runner's
host time in ``launch`` (``RunnerStats.host_time_s``). A cProfile of the eager image case,
by own time, goes to ``chunk_cprofile.txt`` under --out; ``chunk_host.json`` holds the table.
``--smoke`` runs the tiny demo checkpoint (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import EngineView, dummy_11b, noise_image, sync, tiny_llm
from vllm import SamplingParams
from vllm.worker import model_runner


def _prompt(view: EngineView, ids: list[int], image: object | None) -> dict:
    if image is None:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new", default="64,128,192,256")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="the tiny demo checkpoint (CPU check)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        llm = tiny_llm(
            max_model_len=args.context + 512,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=True,
        )
    else:
        llm = dummy_11b(
            max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.85, enable_prefix_caching=True
        )
    view = EngineView(llm)
    runner = view.runner
    model_runner.ROW_CHUNK_KEYS = 1 << 40
    one = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)
    spec = view.spec
    bos = llm.get_tokenizer().bos_token_id
    span = (spec.text.vocab_size // 10, min(100000, spec.text.vocab_size))
    rows = []
    image_eager_ids = None
    for kind in ("text", "image"):
        image = noise_image(2 * spec.vision.image_size, 7) if kind == "image" else None
        head = [bos] + ([spec.image_token_id] if image is not None else [])
        base = head + [rng.randrange(*span) for _ in range(args.context - len(head))]
        llm.generate([_prompt(view, base, image)], one, use_tqdm=False)
        for new in [int(n) for n in args.new.split(",")]:
            res: dict[str, dict[str, list[float]]] = {
                m: {"wall": [], "host": []} for m in ("rows", "eager")
            }
            for _ in range(args.repeat):
                for mode in ("rows", "eager"):
                    runner.row_chunk_tokens = (1 << 20) if mode == "rows" else 0
                    ids = base + [rng.randrange(*span) for _ in range(new)]
                    if mode == "eager" and kind == "image" and new == 128:
                        image_eager_ids = ids
                    host0, rc0 = runner.stats.host_time_s, runner.stats.row_chunks
                    sync()
                    t0 = time.perf_counter()
                    llm.generate([_prompt(view, ids, image)], one, use_tqdm=False)
                    sync()
                    res[mode]["wall"].append(1e3 * (time.perf_counter() - t0))
                    res[mode]["host"].append(1e3 * (runner.stats.host_time_s - host0))
                    ran_rows = runner.stats.row_chunks > rc0
                    if ran_rows != (mode == "rows"):
                        res[mode]["wall"][-1] = float("nan")
            row = {"kind": kind, "context": args.context, "new": new}
            for mode, r in res.items():
                for what, xs in r.items():
                    if xs:
                        row[f"{mode}_{what}_ms"] = round(statistics.median(xs), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if kind == "image" and image_eager_ids is not None:
            runner.row_chunk_tokens = 0
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                ids = image_eager_ids[:-1] + [rng.randrange(*span)]
                llm.generate([_prompt(view, ids, image)], one, use_tqdm=False)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
            s.write("\n\nby cumulative time\n")
            pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(60)
            (out / "chunk_cprofile.txt").write_text(s.getvalue())
    (out / "chunk_host.json").write_text(json.dumps(rows, indent=1))
    print("kind | context | new | rows wall / host ms | eager wall / host ms")
    for r in rows:
        print(
            f"{r['kind']} | {r['context']} | {r['new']} | {r.get('rows_wall_ms')} / "
            f"{r.get('rows_host_ms')} | {r.get('eager_wall_ms')} / {r.get('eager_host_ms')}"
        )


if __name__ == "__main__":
    main()
