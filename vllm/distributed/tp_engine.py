"""The engine over tensor-parallel ranks: one process per rank, started by rank 0's engine.

Every rank runs a replica of the engine (scheduler, block manager, model runner on its slice of
the model, its KV heads' pages of one shared page layout). Rank 0's engine is the one callers
hold; each call that changes engine state (``add_request`` with rank 0's processed inputs and
arrival time and, for an unseeded request, a sampling seed it draws; ``abort_request``;
``step``; ``reset_prefix_cache``) is sent to the other ranks over a gloo group before rank 0
runs it, and they run the same call. The replicas therefore schedule the same steps, and the
model's collectives (``parallel_state``) meet: every rank computes the same logits after the
vocabulary gather, samples the same tokens from generators of the same seeds, and advances the
same decode rows. Rank 0 decides for all: its calls, in its order, are the only input the
others get. The ranks run on CPU (gloo); GPU ranks need NCCL inside the decode graphs, which
are not built (``EngineArgs`` refuses them).

A rank that exits is found before the next call is sent (``TensorParallelError`` naming it);
one that dies inside a step fails that step's collective on the others (gloo raises at once on
a closed peer, else after the group's timeout) instead of hanging them.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from vllm.logger import init_logger

logger = init_logger(__name__)

_CONTROL: Any = None  # the gloo group calls are sent over (every rank has it)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or exited; the engine cannot run on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(size: int, rank: int, init_method: str, timeout_s: float) -> None:
    global _CONTROL
    init_tensor_parallel(size, rank, init_method, backend="gloo", timeout_s=timeout_s)
    _CONTROL = dist.new_group(backend="gloo")


def agree_min(value: int) -> int:
    """The smallest of every rank's ``value`` (each rank's memory profile may differ)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL)
    return int(t.item())


class Ranks:
    """Rank 0's handle on the other ranks: their processes and the channel to them."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.closed = False
        # Stopping runs once: a second caller (another thread stopping the engine, or the
        # engine's finalizer) waits for the first, and never sends its own stop beside it.
        self._stop_lock = threading.Lock()

    def check(self, wait_s: float = 0.0) -> None:
        """Raises if a rank has exited (giving each up to ``wait_s`` to be seen exiting: a
        collective fails as soon as its peer's connection closes)."""
        for rank, p in enumerate(self.procs, start=1):
            if wait_s:
                p.join(wait_s)
            if not p.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited (code {p.exitcode}); "
                    "the engine cannot run on"
                )

    def send(self, call: tuple) -> None:
        """Sends one engine call to every other rank (they run it in this order)."""
        if self.closed:
            raise TensorParallelError("the tensor-parallel ranks were shut down")
        self.check()
        try:
            dist.broadcast_object_list([call], src=0, group=_CONTROL)
        except Exception:
            self.check(wait_s=2.0)  # a rank that died: say which
            raise

    def terminate(self) -> None:
        """Ends the other ranks at once (rank 0 failed while they wait in a collective)."""
        with self._stop_lock:
            self.closed = True
            for p in self.procs:
                p.terminate()
                p.join(10)
            destroy_tensor_parallel()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tells the other ranks to stop and waits for them (terminating any that outlast
        ``timeout_s``). Runs once; safe to call from several threads."""
        with self._stop_lock:
            if self.closed:
                return
            try:
                if all(p.is_alive() for p in self.procs):
                    dist.broadcast_object_list([("stop",)], src=0, group=_CONTROL)
            finally:
                self.closed = True
                for p in self.procs:
                    p.join(timeout_s)
                    if p.is_alive():
                        p.terminate()
                destroy_tensor_parallel()


def start_ranks(config: Any, engine_cls: type, timeout_s: float = 300.0) -> Ranks:
    """Starts ranks 1 .. N-1 (each builds its replica, ``engine_cls(config, ...)``) and joins
    the group as rank 0. Called by rank 0's engine before it loads its slice of the model."""
    size = config.parallel_config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, size, init_method, config, engine_cls, timeout_s),
            name=f"vllm-tp-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for p in procs:
        p.start()
    _join(size, 0, init_method, timeout_s)
    return Ranks(procs)


def _rank_main(
    rank: int, size: int, init_method: str, config: Any, engine_cls: type, timeout_s: float
) -> None:
    """A rank other than 0: its engine replica runs the calls rank 0 sends until told to
    stop."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    _join(size, rank, init_method, timeout_s)
    try:
        engine = engine_cls(config, log_stats=False, tp_rank=rank)
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=_CONTROL)
            call = box[0]
            if call[0] == "stop":
                break
            try:
                _run(engine, call)
            except TensorParallelError:
                raise
            except Exception as e:  # rank 0 raised the same to its caller, who goes on
                logger.debug("rank %d: %s raised %s: %s", rank, call[0], type(e).__name__, e)
    finally:
        destroy_tensor_parallel()


def _run(engine: Any, call: tuple) -> None:
    if call[0] == "add":
        _, args, kwargs = call
        engine.add_request(*args, **kwargs)
    elif call[0] == "abort":
        engine.abort_request(call[1])
    elif call[0] == "step":
        engine.step()
    elif call[0] == "reset_prefix_cache":
        engine.reset_prefix_cache()
    else:
        raise TensorParallelError(f"unknown engine call {call[0]!r}")
