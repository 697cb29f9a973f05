"""The engine thread's time admitting a cached prompt: ``Scheduler.schedule`` at admission.

    python -m benchmarks.profiling admission [--tokens 1000,6000] [--repeat 20]

With prefix caching, a prompt of ``--tokens`` tokens and one image (the tiny demo checkpoint
on CPU, the 11B shape with dummy weights on CUDA) is served once, then again ``--repeat``
times with one output token; reported per length: the median time of the ``schedule`` call
that admits it (its cached prefix looked up, its pages allocated). It uses only ``LLM`` and
``Scheduler.schedule``, so it runs on the trees before and after a change to admission.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import make_prompt, tiny_llm
from vllm import LLM, SamplingParams
from vllm.core import scheduler


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1000,6000")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    longest = max(lengths) + 64
    if torch.cuda.is_available():
        llm = LLM(model="demo/mllama-11b", load_format="dummy", dtype="bfloat16",
                  max_model_len=longest, max_num_seqs=8, gpu_memory_utilization=0.5,
                  enable_prefix_caching=True)
    else:
        llm = tiny_llm(max_model_len=longest, max_num_seqs=8, enable_prefix_caching=True)
    schedule = scheduler.Scheduler.schedule
    calls: list[float] = []

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        out = schedule(self, *a, **k)
        calls.append(time.perf_counter() - t0)
        return out

    one = SamplingParams(temperature=0, max_tokens=1)
    scheduler.Scheduler.schedule = timed
    try:
        for n in lengths:
            prompt = make_prompt(llm, True, n, 1)
            llm.generate([prompt], one, use_tqdm=False)
            firsts = []
            for _ in range(args.repeat):
                calls.clear()
                llm.generate([prompt], one, use_tqdm=False)
                firsts.append(calls[0])
            print(f"{n:6d} tokens: admitting schedule() {1e3 * statistics.median(firsts):.3f} ms"
                  " (median)")
    finally:
        scheduler.Scheduler.schedule = schedule


if __name__ == "__main__":
    main()
