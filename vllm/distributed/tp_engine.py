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
others get.

On CPU the model's collectives run over gloo. On GPUs rank r runs on GPU r and the model's
collectives over NCCL (its communicator created when the rank joins, before any graph is
captured), so each rank's decode graphs hold that step's all-reduces and its vocabulary
gather; every rank captures the same buckets in the same order, and one stream a rank keeps
the collectives in one order. The calls still travel over a gloo group (Python objects on the
host). NVLink multicast (NVLS) stays off unless the environment sets the variables of
``MULTICAST_OFF`` itself: an all-reduce of one decode step's activations gains nothing from it,
and a multicast object a crashed process leaves behind can keep a host's GPUs from working.

A rank that exits is found before the next call is sent (``TensorParallelError`` naming it);
one that dies inside a step fails that step's collective on the others (gloo raises at once on
a closed peer, else after the group's timeout) instead of hanging them. An NCCL collective
replayed from a graph cannot fail that way: it waits on the GPU for a peer that is gone. So a
watcher thread on rank 0 (``Ranks.watch``) waits for any rank to exit; if one does while a
call is in flight and that call has not ended ``grace_s`` later, it logs the rank, stops the
others and ends the process (exit code 70) rather than leave a server that never answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from vllm.logger import init_logger

logger = init_logger(__name__)

_CONTROL: Any = None  # the gloo group calls are sent over (every rank has it)

# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM (module docstring).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
EXIT_RANK_LOST = 70  # the process's exit code when a rank died inside a call (EX_SOFTWARE)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or exited; the engine cannot run on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(size: int, rank: int, init_method: str, timeout_s: float, device_type: str) -> None:
    """Joins the model's group (NCCL on GPU ``rank``, else gloo) and the calls' gloo group."""
    global _CONTROL
    device = None
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    backend = "nccl" if device is not None else "gloo"
    init_tensor_parallel(size, rank, init_method, backend, timeout_s, device)
    _CONTROL = dist.new_group(backend="gloo")


def rank_device(config: Any, rank: int) -> Any:
    """``config`` with rank ``rank``'s device: GPU ``rank`` on CUDA, unchanged on CPU."""
    device = config.device_config.device
    if device.type != "cuda":
        return config
    gpu = dataclasses.replace(config.device_config, device=torch.device("cuda", rank))
    return dataclasses.replace(config, device_config=gpu)


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
        self._calls = 0  # calls in flight on rank 0 (``in_call``)
        self._call_seq = 0  # calls begun so far

    @contextlib.contextmanager
    def in_call(self) -> Iterator[None]:
        """Marks an engine call (a step) in flight on rank 0, for ``watch``."""
        self._calls += 1
        self._call_seq += 1
        try:
            yield
        finally:
            self._calls -= 1

    def watch(
        self,
        grace_s: float = 10.0,
        end: Callable[[int], None] = os._exit,
    ) -> threading.Thread:
        """Starts the watcher thread (module docstring). Once a rank exits while the group
        is open: if a call is in flight and the same call is still in flight ``grace_s``
        later, the other ranks are stopped and the process ends through ``end`` (with
        ``EXIT_RANK_LOST``). With no call in flight, the next call fails (``check``), as on
        CPU."""

        def run() -> None:
            multiprocessing.connection.wait([p.sentinel for p in self.procs])
            if self.closed or self._calls == 0:
                return
            call = self._call_seq
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if self.closed or self._calls == 0 or self._call_seq != call:
                    return  # the call ended: it raised, and later calls raise at ``check``
                time.sleep(0.05)
            dead = [
                f"{r} (code {p.exitcode})" for r, p in enumerate(self.procs, 1) if not p.is_alive()
            ]
            logger.error(
                "tensor-parallel rank %s exited while a step was running; its collectives "
                "cannot complete on the GPUs, so the engine's process ends now",
                ", ".join(dead),
            )
            self.closed = True
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            end(EXIT_RANK_LOST)

        t = threading.Thread(target=run, name="vllm-tp-watch", daemon=True)
        t.start()
        return t

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


def start_ranks(
    config: Any, engine_cls: type, engine_kwargs: dict | None = None, timeout_s: float = 300.0
) -> Ranks:
    """Starts ranks 1 .. N-1 (each builds its replica, ``engine_cls(config, **engine_kwargs,
    ...)`` on its device) and joins the group as rank 0. Called by rank 0's engine before it
    loads its slice of the model."""
    size = config.parallel_config.tensor_parallel_size
    device_type = config.device_config.device.type
    if device_type == "cuda":
        for name, value in MULTICAST_OFF.items():
            os.environ.setdefault(name, value)  # before the ranks start: they inherit it
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, size, init_method, config, engine_cls, engine_kwargs or {}, timeout_s),
            name=f"vllm-tp-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for p in procs:
        p.start()
    ranks = Ranks(procs)
    try:
        _join(size, 0, init_method, timeout_s, device_type)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    if device_type == "cuda":
        ranks.watch()
    return ranks


def _rank_main(
    rank: int,
    size: int,
    init_method: str,
    config: Any,
    engine_cls: type,
    engine_kwargs: dict,
    timeout_s: float,
) -> None:
    """A rank other than 0: its engine replica runs the calls rank 0 sends until told to
    stop."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    _join(size, rank, init_method, timeout_s, config.device_config.device.type)
    try:
        engine = engine_cls(
            rank_device(config, rank), log_stats=False, tp_rank=rank, **engine_kwargs
        )
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
