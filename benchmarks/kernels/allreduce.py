"""The collectives of one tensor-parallel decode step, timed as the decode graphs run them: N
processes (one GPU each, NCCL), each capturing one CUDA graph of a step's collectives on
``bs`` rows of the model's width: the embedding's all-reduce, two all-reduces a text layer
(attention and MLP outputs; a text-only step skips the cross layers) and the LM head's
vocabulary gather (float32 logits). The slowest rank's median replay time is the
all-reduce term of the tensor-parallel floor (issue's formula: per-GPU weight bytes / read
bandwidth + the one-GPU step's non-linear time / N + this). Every collective's result is
checked against the expected sum first.

    python -m benchmarks.kernels allreduce --tp 2 --model 11b --batches 1,8,64 --json out.json
    python -m benchmarks.kernels allreduce --tp 2 --smoke   # CPU, gloo, eager: the script runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.common import time_graph_us
from vllm.distributed.tp_engine import MULTICAST_OFF

# (hidden, self layers, cross layers, vocabulary) of the text decoders.
SHAPES = {"11b": (4096, 32, 8, 128256), "90b": (8192, 80, 20, 128256), "tiny": (64, 4, 1, 512)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_collectives(hidden: int, layers: int, vocab: int, bs: int, tp: int, device, dtype):
    """The step's collectives as closures over preallocated tensors, and a check of each."""
    x = torch.ones(bs, hidden, device=device, dtype=dtype)
    logits = torch.ones(bs, vocab // tp, device=device, dtype=torch.float32)
    parts = [torch.empty_like(logits) for _ in range(tp)]

    def reduce() -> None:
        dist.all_reduce(x)

    def gather() -> None:
        dist.all_gather(parts, logits)

    calls = [reduce] * (1 + 2 * layers) + [gather]
    return calls, x, parts


def _time_cuda(calls: list, replays: int) -> float:
    """Median microseconds of one replay of a graph of ``calls``, the ranks lined up first."""
    return time_graph_us(calls, replays, before_replay=dist.barrier) * len(calls)


def _time_eager(calls: list, replays: int) -> float:
    samples = []
    for _ in range(replays):
        dist.barrier()
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _rank(rank: int, tp: int, init: str, args: dict, queue) -> None:
    cuda = not args["smoke"]
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl",
            init_method=init,
            world_size=tp,
            rank=rank,
            timeout=timedelta(seconds=120),
            device_id=device,
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group(
            "gloo", init_method=init, world_size=tp, rank=rank, timeout=timedelta(seconds=120)
        )
    hidden, selfs, crosses, vocab = SHAPES[args["model"]]
    rows = []
    for bs in args["batches"]:
        for family, layers in (("text", selfs), ("image", selfs + crosses)):
            calls, x, parts = step_collectives(
                hidden, layers, vocab, bs, tp, device, torch.bfloat16 if cuda else torch.float32
            )
            calls[0]()  # one all-reduce of ones: every element is tp
            calls[-1]()
            ok = bool((x == tp).all()) and all(bool((p == 1).all()) for p in parts)
            if not ok:
                raise SystemExit(f"rank {rank}: wrong collective result at bs={bs}")
            timer = _time_cuda if cuda else _time_eager
            us = timer(calls, args["replays"])
            worst = torch.tensor([us], dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "bs": bs,
                    "family": family,
                    "collectives": len(calls),
                    "step_us": float(worst.item()),
                    "per_all_reduce_us": float(worst.item()) / len(calls),
                }
            )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", choices=sorted(SHAPES), default="11b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, eager, tiny shapes")
    a = ap.parse_args(argv)
    args = {
        "model": "tiny" if a.smoke else a.model,
        "smoke": a.smoke,
        "replays": a.replays,
        "batches": [int(b) for b in a.batches.split(",")],
    }
    if not a.smoke and torch.cuda.device_count() < a.tp:
        raise SystemExit(f"--tp {a.tp} needs {a.tp} GPUs; {torch.cuda.device_count()} visible")
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_port()}"
    procs = [ctx.Process(target=_rank, args=(r, a.tp, init, args, queue)) for r in range(a.tp)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print(f"model {args['model']}, tp {a.tp} ({'CPU gloo, eager' if a.smoke else 'NCCL, graphs'})")
    print("  bs  family  collectives  step us  us each")
    for r in rows:
        print(
            f"{r['bs']:4d}  {r['family']:6s}  {r['collectives']:11d}  {r['step_us']:7.1f}  "
            f"{r['per_all_reduce_us']:7.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tp": a.tp, "model": args["model"], "rows": rows}, f, indent=1)
