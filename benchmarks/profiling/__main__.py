"""Profiles of the 11B shape on a GPU, and the serving step trace with its analysis.

python -m benchmarks.profiling COMMAND [options]
"""

from __future__ import annotations

from benchmarks.common import dispatch

COMMANDS = {
    "kernels": (
        "benchmarks.profiling.kernel_tables",
        "torch.profiler kernel tables: image prefill, decode graph vs eager, "
        "kernels per decode forward",
    ),
    "host": (
        "benchmarks.profiling.host",
        "host time of bs=1 decode steps without the profiler: launch vs replay, GC, "
        "cProfile, replay with a queue",
    ),
    "chunk": (
        "benchmarks.profiling.chunk_host",
        "short prefill chunks over a cached context: rows vs eager, host time, cProfile",
    ),
    "context": (
        "benchmarks.profiling.context_attention",
        "one layer's self-attention of a step of chunks after cached prefixes: launches, "
        "GPU and host time",
    ),
    "admission": (
        "benchmarks.profiling.admission",
        "the engine thread's time admitting a cached prompt (Scheduler.schedule)",
    ),
    "handoff": (
        "benchmarks.profiling.handoff",
        "the engine thread's cost of handing outputs to the event loop, per step",
    ),
    "inputs": (
        "benchmarks.profiling.turn_inputs",
        "a chat turn's input steps on the host: JSON, template, tokenization, image lookup",
    ),
    "gaps": (
        "benchmarks.profiling.gaps",
        "GPU idle gaps of one image prefill, graph vs eager kernels, syncing calls",
    ),
    "serve": (
        "benchmarks.profiling.serve_trace",
        "vllm serve with a step trace (STEP_TRACE=FILE): steps, JIT compiles, slow calls",
    ),
    "timeline": (
        "benchmarks.profiling.serve_timeline",
        "vllm serve with a timeline of each chat request (TIMELINE=FILE): HTTP, prompt, "
        "images, engine steps",
    ),
    "analyze": (
        "benchmarks.profiling.serve_analysis",
        "line a serving result up with a step trace: ITL bursts and their steps",
    ),
}

if __name__ == "__main__":
    dispatch("python -m benchmarks.profiling", __doc__.splitlines()[0], COMMANDS)
