"""End-to-end benchmarks with the engine in-process (11B shape on a GPU, or --smoke on CPU).

python -m benchmarks.engine COMMAND [options]
"""

from __future__ import annotations

from benchmarks.common import dispatch

COMMANDS = {
    "report": (
        "benchmarks.engine.report",
        "the H200 report: decode ms/step, TTFT and its floors, host time, start-up",
    ),
    "ttft-tiles": (
        "benchmarks.engine.ttft_tiles",
        "TTFT of one image of 1, 2, 3 or 4 tiles + 128 tokens",
    ),
    "quant": (
        "benchmarks.engine.quant",
        "quantized weights (bitsandbytes, FP8) against bf16: decode, linears, TTFT, memory",
    ),
    "load": (
        "benchmarks.engine.load",
        "load time and peak GPU memory of a bf16 folder quantized at load (--quantization fp8)",
    ),
    "guided": (
        "benchmarks.engine.guided",
        "decode step time with every row under a JSON schema vs free rows, compile times",
    ),
    "long-context": (
        "benchmarks.engine.long_context",
        "the whole 128k context: no-flag start-up split, TTFT at 8k-128k, decode at long context",
    ),
    "serving-loop": (
        "benchmarks.engine.serving_loop",
        "closed-loop TTFT and inter-token latency with image arrivals, per-step trace",
    ),
}

if __name__ == "__main__":
    dispatch("python -m benchmarks.engine", __doc__.splitlines()[0], COMMANDS)
