"""Loading a bf16 checkpoint with quantization at load: wall time and peak GPU memory.

Writes (once, with ``--write``) a bf16 checkpoint of the 11B (or 90B) shape with random weights
into ``--folder``, then builds the model on the GPU with ``--quantization`` (default ``fp8``)
from it, as ``load_model`` does, and reports the load time, the peak of allocated GPU memory
during the load, the quantized model's bytes and the largest tensor of the checkpoint in bf16:
quantization as the tensors stream must keep the peak at most the model plus that tensor.

    python -m benchmarks.engine load --folder /tmp/mllama-11b-bf16 --write
        [--model demo/mllama-11b] [--quantization fp8|bitsandbytes|none] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from vllm.model_executor.model_loader.loader import get_model
from vllm.transformers_utils.config import load_mllama_config
from vllm.transformers_utils.demo_checkpoints import build_demo_config, weight_shapes

SHARD_BYTES = 5 << 30


def write_bf16_folder(model: str, folder: Path) -> None:
    """config.json and sharded bf16 safetensors of random weights (N(0, 1/fan-in) matrices,
    ones for the norms), drawn on the GPU."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = build_demo_config(model)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, index = {}, 0, index + 1

    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            t = (t / math.sqrt(math.prod(shape[1:]))).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))


def largest_tensor_bytes(folder: Path) -> tuple[str, int]:
    from safetensors import safe_open

    best = ("", 0)
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = h.get_slice(name).get_shape()
                nbytes = math.prod(shape) * 2
                if nbytes > best[1]:
                    best = (name, nbytes)
    return best


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--model", default="demo/mllama-11b", help="the shape to write")
    ap.add_argument("--write", action="store_true", help="write the folder if it is missing")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the load benchmark needs a CUDA device")
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        if not args.write:
            raise SystemExit(f"{folder} has no checkpoint; pass --write to create one")
        t0 = time.perf_counter()
        write_bf16_folder(args.model, folder)
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    quantization = None if args.quantization == "none" else args.quantization
    spec = load_mllama_config(folder)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = get_model(
        spec, folder, "auto", torch.bfloat16, torch.device("cuda"), 4096,
        quantization=quantization,
    )  # fmt: skip
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    name, largest = largest_tensor_bytes(folder)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "folder": str(folder),
        "quantization": quantization,
        "load_s": round(seconds, 1),
        "peak_gib": round(peak / 2**30, 3),
        "model_gib": round(stored / 2**30, 3),
        "largest_tensor": name,
        "largest_tensor_gib": round(largest / 2**30, 3),
        "peak_within_model_plus_largest": peak <= stored + largest,
    }
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
