"""One layer's self-attention of a prefill step whose chunks continue cached prefixes.

    python -m benchmarks.profiling context [--chunks 1,4,8,16] [--context 32] [--new 256]

Many chat requests share their first tokens (the template's system header): with prefix
caching each of them finds those pages cached and is prefilled as a chunk after context,
which reads its earlier keys from the pages. Per ``--chunks`` k, a step of k such chunks
(``--context`` cached tokens and ``--new`` new ones each, the 11B attention shape: 32 query
heads, 8 KV heads of 128) goes through ``build_prefill_batch`` and the TRITON back-end's
``prefill_self``, as the runner calls them. Reported per k: the device operations one call
launches (aten operations that are not views or allocations, plus Triton kernels), on any
device; on CUDA also the call's GPU time (CUDA events) and host time, median of
``--repeat``. The same script runs on a tree before and after a change to the context path
(it uses only ``build_prefill_batch`` and ``prefill_self``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vllm.attention.backends.triton_attn import TritonBackend
from vllm.attention.ops import triton_prefill
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ProcessedInputs
from vllm.worker.prefill_inputs import PrefillItem, build_prefill_batch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# Operations that launch nothing on a GPU: views, allocations, metadata.
_NO_LAUNCH = {
    "view", "_unsafe_view", "permute", "slice", "select", "transpose", "t", "unsqueeze",
    "squeeze", "expand", "as_strided", "alias", "detach", "empty", "empty_like",
    "empty_strided", "lift_fresh", "split", "unbind",
}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _step(k: int, context: int, new: int, device: torch.device, dtype: torch.dtype):
    """k chunks of ``new`` tokens after ``context`` cached ones, their pages apart; the
    step's q/k/v and a cache holding every position."""
    n = context + new
    per_seq = -(-n // PAGE)
    items = []
    for i in range(k):
        ids = [1 + (t % 1000) for t in range(n)]
        inputs = ProcessedInputs(ids, None, image_runs(ids, -1), last_group(ids, -1),
                                 tokens_per_tile=1)
        table = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        items.append(PrefillItem(ids, inputs, i, block_table=table, start=context))
    kwargs = {}
    if "max_context_tokens" in inspect.signature(build_prefill_batch).parameters:
        kwargs["max_context_tokens"] = 131072
    batch = build_prefill_batch(items, PAGE, 64, device, **kwargs)
    gen = torch.Generator().manual_seed(0)
    pages = 1 + k * per_seq
    cache = [torch.randn(pages, KV_HEADS, PAGE, HEAD_DIM, generator=gen).to(device, dtype)
             for _ in range(2)]
    t = k * new
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    kv = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return batch.metadata, q, kv, (cache[0], cache[1])


def _launches(backend: TritonBackend, md, q, kv, cache) -> tuple[int, Counter[str]]:
    kernels = Counter()
    original = triton_prefill.ranged_cross_attention

    def counted(*args, num_splits: int = 1, **kw):
        kernels["ranged kernel"] += 1
        kernels["split merge"] += num_splits > 1
        with _disable_current_modes():  # the kernel's own operations (its allocations, the
            return original(*args, num_splits=num_splits, **kw)  # interpreter's copies)

    import vllm.attention.backends.triton_attn as triton_attn

    triton_attn.ranged_cross_attention = counted
    try:
        with _CountOps() as mode:
            backend.prefill_self(q, kv, kv, md, 0.088, cache)
    finally:
        triton_attn.ranged_cross_attention = original
    ops = mode.ops + kernels
    return sum(ops.values()), ops


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="1,4,8,16")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = TritonBackend()
    rows = []
    for k in [int(x) for x in args.chunks.split(",")]:
        md, q, kv, cache = _step(k, args.context, args.new, device, dtype)
        total, ops = _launches(backend, md, q, kv, cache)
        row = {"chunks": k, "context": args.context, "new": args.new, "launches": total,
               "ops": dict(ops)}
        if cuda:
            gpu, host = [], []
            for _ in range(args.repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                start.record()
                backend.prefill_self(q, kv, kv, md, 0.088, cache)
                end.record()
                host.append(1e3 * (time.perf_counter() - t0))
                torch.cuda.synchronize()
                gpu.append(start.elapsed_time(end))
            row["gpu_ms"] = statistics.median(gpu[1:])
            row["host_ms"] = statistics.median(host[1:])
        rows.append(row)
        timing = (f"  gpu {row['gpu_ms']:.3f} ms  host {row['host_ms']:.3f} ms"
                  if cuda else "")
        print(f"chunks {k:3d}: {total:4d} launches ({total / k:.1f} a chunk){timing}  "
              + ", ".join(f"{name} {n}" for name, n in sorted(ops.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
