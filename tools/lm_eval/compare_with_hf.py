"""Checks an lm-evaluation-harness run against HF transformers: every loglikelihood the harness
received from ``vllm serve`` (its ``--log_samples`` file of a multiple-choice task) is
recomputed with HF's log-softmax on the demo checkpoint (with the Meta-parity shim of the
tests), from the tokens the harness sent, and compared.

Run from the repository root, with the project's environment::

    PYTHONPATH=tests:. python tools/lm_eval/compare_with_hf.py SAMPLES.jsonl [--tol 1e-4]

The harness tokenizes a context and its continuation as ``_encode_pair`` does (trailing spaces
of the context move to the continuation; no BOS) and scores the continuation's tokens: the sum
of their logprobs, and whether each is the argmax. Exit status 1 when any differs by more than
``--tol`` per token (the model tests' tolerance).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from helpers.hf_runner import demo_path, hf_prefill_logits, load_hf_model
from transformers import AutoTokenizer


def encode_pair(tok: object, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def hf_score(model: object, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    logprobs = hf_prefill_logits(model, {"input_ids": ids})[:-1].log_softmax(-1)
    rows = logprobs[len(ctx) - 1 :]
    targets = torch.tensor(cont)
    total = rows.gather(1, targets[:, None]).sum().item()
    return total, bool((rows.argmax(-1) == targets).all())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", type=Path, help="samples_<task>_<date>.jsonl of the run")
    parser.add_argument("--tol", type=float, default=1e-4, help="Per token (default 1e-4).")
    args = parser.parse_args()
    path = demo_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_model(str(path))
    worst, count, bad = 0.0, 0, 0
    for line in args.samples.read_text().splitlines():
        sample = json.loads(line)
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), (score, greedy) in zip(
            pairs, sample["filtered_resps"], strict=True
        ):
            ctx, cont = encode_pair(tok, context, continuation)
            want, want_greedy = hf_score(model, ctx, cont)
            diff = abs(float(score) - want)
            worst, count = max(worst, diff), count + 1
            ok = diff <= args.tol * len(cont) and (greedy == "True") == want_greedy
            bad += not ok
            print(
                f"doc {sample['doc_id']} {continuation!r:>10}: served {float(score):.6f} "
                f"HF {want:.6f} diff {diff:.1e} greedy {greedy}/{want_greedy}"
                + ("" if ok else "  MISMATCH")
            )
    print(f"{count} loglikelihoods, largest difference {worst:.2e}, {bad} mismatches")
    return 1 if bad or not count else 0


if __name__ == "__main__":
    sys.exit(main())
