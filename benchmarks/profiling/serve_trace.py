"""``vllm serve`` with a step trace, for finding where serving latency spikes come from.

Usage: ``STEP_TRACE=trace.json python -m benchmarks.profiling serve MODEL [server args]``.
Every ``LLMEngine.step()`` call is recorded as ``[start, end, running, waiting, encoder job
before, spread prefill before, spread prefill after, outputs, launch s, collect s, prompt
tokens admitted, cudaMallocs, cudaFrees, allocator retries]`` (launch / collect: host time
inside ``ModelRunner.launch`` (enqueueing work) and ``ModelRunner.collect`` (mostly waiting for
the GPU) during the call; ``time.perf_counter()`` seconds: CLOCK_MONOTONIC on Linux, the clock
of the serving benchmark's ``send_times``), every Triton JIT compile as ``["jit", start, end,
kernel]`` and every SDPA or linear call over 1 ms of host time as ``["slow", start, end,
call]`` (hooks of ``triton.knobs`` where the installed Triton has them). The trace is written
when the server exits (SIGTERM, Ctrl-C) or on SIGUSR1; ``python -m benchmarks.profiling
analyze`` lines it up with a benchmark result.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import time

from benchmarks.common import engine_classes, engine_state, scheduled_prompt_tokens

rows: list[list[float]] = []
events: list[list] = []
SLOW_CALL_S = 0.001


def dump() -> None:
    """Writes the trace to ``$STEP_TRACE``."""
    with open(os.environ["STEP_TRACE"], "w") as f:
        json.dump({"steps": rows, "events": events}, f)


def install_jit_hooks() -> None:
    """Records each Triton JIT compile (where ``triton.knobs`` exists)."""
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU installs) or one without knobs
        return
    started: dict[str, float] = {}

    def before(**kw) -> bool:
        started[str(kw.get("key"))] = time.perf_counter()
        return False  # never skip the compile

    def after(**kw) -> bool:
        end = time.perf_counter()
        start = started.pop(str(kw.get("key")), end)
        events.append(["jit", start, end, str(kw.get("repr"))[:3000]])
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


def _timed(fn, done):
    """``fn`` wrapped to call ``done(start, end, args)`` after each call, raised or not."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            done(t0, time.perf_counter(), args)

    return wrapper


def install_call_timers() -> None:
    """Host time of every SDPA and linear call; calls over ``SLOW_CALL_S`` are recorded as
    ``["slow", start, end, "name shapes strides"]`` (a library planning a new shape, or a
    heuristic miss, shows up here; decode steps replay graphs and make no such calls)."""
    import torch.nn.functional as F

    def recorder(name):
        def done(t0, t1, args):
            if t1 - t0 > SLOW_CALL_S:
                desc = " ".join(
                    f"{tuple(a.shape)}/{a.stride()}" for a in args if hasattr(a, "shape")
                )
                events.append(["slow", t0, t1, f"{name} {desc}"[:300]])

        return done

    for name in ("scaled_dot_product_attention", "linear"):
        setattr(F, name, _timed(getattr(F, name), recorder(name)))


class _AllocatorDeltas:
    """cudaMalloc / cudaFree calls and allocation retries (a retry frees the cache, which
    synchronises the device) of the caching allocator since the last call."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.last = {"alloc": 0, "free": 0, "retry": 0}
        self()

    def __call__(self) -> list[int]:
        if not self.torch.cuda.is_available():
            return [0, 0, 0]
        st = self.torch.cuda.memory_stats()
        now = {
            "alloc": st.get("num_device_alloc", 0),
            "free": st.get("num_device_free", 0),
            "retry": st.get("num_alloc_retries", 0),
        }
        out = [now[k] - self.last[k] for k in ("alloc", "free", "retry")]
        self.last.update(now)
        return out


def install_step_trace() -> None:
    """Patches the engine's classes so every step appends one row to :data:`rows`."""
    engine_cls, runner_cls, scheduler_cls = engine_classes()
    spent = {"launch": 0.0, "collect": 0.0}
    admitted = {"tokens": 0, "decode": 0, "encoder": 0, "chunks": 0}

    def adder(name):
        def done(t0, t1, args):
            spent[name] += t1 - t0

        return done

    runner_cls.launch = _timed(runner_cls.launch, adder("launch"))
    runner_cls.collect = _timed(runner_cls.collect, adder("collect"))
    step, schedule = engine_cls.step, scheduler_cls.schedule

    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        admitted["tokens"] += scheduled_prompt_tokens(out)
        if out is not None:
            admitted["decode"] += len(out.decode_seqs)
            admitted["encoder"] += sum(w.layers for w in out.encoder_work)
            admitted["chunks"] += len(out.chunks)
        return out

    scheduler_cls.schedule = counted
    allocator_deltas = _AllocatorDeltas()

    def traced(self):
        _, _, enc, job = engine_state(self)
        spent["launch"] = spent["collect"] = 0.0
        admitted.update(tokens=0, decode=0, encoder=0, chunks=0)
        t0 = time.perf_counter()
        out = step(self)
        running, waiting, _, job_after = engine_state(self)
        rows.append(
            [
                t0,
                time.perf_counter(),
                running,
                waiting,
                int(enc),
                int(job),
                int(job_after),
                len(out),
                spent["launch"],
                spent["collect"],
                admitted["tokens"],
                *allocator_deltas(),
                admitted["decode"],
                admitted["encoder"],
                admitted["chunks"],
            ]
        )
        return out

    engine_cls.step = traced


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Installs the hooks, then runs ``vllm serve`` with the remaining arguments."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if "STEP_TRACE" not in os.environ:
        raise SystemExit(
            f"usage: STEP_TRACE=FILE {prog or 'serve_trace'} MODEL [server args]"
            "\n\nset STEP_TRACE to the trace file to write"
        )
    install_jit_hooks()
    install_call_timers()
    install_step_trace()
    atexit.register(dump)

    def on_usr1(*_) -> None:
        dump()
        os._exit(0)

    signal.signal(signal.SIGUSR1, on_usr1)
    events.append(["start", time.perf_counter(), 0, ""])
    from vllm.entrypoints.cli.main import main as cli

    cli(["serve", *(argv or [])])
