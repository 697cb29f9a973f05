"""``python -m benchmarks.profiling context`` (on CUDA where there is one, else on CPU): a
step's chunks after cached prefixes cost the TRITON back-end's self-attention a fixed number
of launches a layer, whatever their number (one gather of K and of V, the queries' rows, one
kernel call, the rows back)."""

from __future__ import annotations

import torch

from benchmarks.profiling import context_attention as bench
from vllm.attention.backends.triton_attn import TritonBackend

# The TRITON back-end runs on CUDA, or on CPU under the interpreter (the suite's CPU default).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def test_launches_do_not_grow_with_the_chunks() -> None:
    backend = TritonBackend()
    counts = {}
    for k in (1, 2, 6):
        md, q, kv, cache = bench._step(k, 20, 5, DEVICE, DTYPE)
        total, ops = bench._launches(backend, md, q, kv, cache)
        assert ops["ranged kernel"] == 1 and ops["index_select"] == 2 + (k > 1)
        counts[k] = total
    assert counts[2] == counts[6] <= counts[1] + 2, counts
