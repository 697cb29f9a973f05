"""``vllm collect-env``: what a bug report needs to know about this machine.

The package (version, location), Python and the OS, the CPU, torch with its CUDA and cuDNN
builds and the GPUs it sees (with the driver, when ``nvidia-smi`` is there), the versions of
the libraries the engine and the server run on, and the environment variables that change
their behaviour (secrets shown as ``***``). Nothing is sent anywhere; it prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pillow",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "httpx",
    "prometheus-client",
    "jinja2",
    "openai",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "collect-env",
        help="Print the environment (versions, GPUs, variables) for a bug report.",
        description="Print the package, Python, OS, torch, CUDA, GPU and library versions and "
        "the relevant environment variables.",
    )
    parser.set_defaults(dispatch=cmd)


def cmd(args: argparse.Namespace) -> None:
    print(format_report(collect()))


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _driver() -> str:
    """The NVIDIA driver, from ``nvidia-smi`` (bounded to a few seconds), if it is there."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "N/A (no nvidia-smi)"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi failed)"
    return ", ".join(sorted(set(out.stdout.split()))) or "unknown"


def _torch() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    info = {
        "torch": torch.__version__,
        "CUDA (torch build)": str(torch.version.cuda),
        "cuDNN": str(torch.backends.cudnn.version())
        if torch.backends.cudnn.is_available()
        else "N/A",
        "CUDA available": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
        info["GPUs"] = "; ".join(gpus)
        info["NVIDIA driver"] = _driver()
    return info


def collect() -> dict[str, dict[str, str]]:
    """The report's sections, each a mapping of names to values."""
    from vllm import envs
    from vllm.version import __version__

    system = {
        "vllm (this package)": f"{__version__} at {Path(__file__).resolve().parents[2]}",
        "Python": f"{platform.python_version()} ({sys.executable})",
        "OS": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "libc": " ".join(platform.libc_ver()) or "unknown",
        "CPU": f"{_cpu_model()}, {os.cpu_count()} logical cores",
    }
    return {
        "System": system,
        "Torch and GPUs": _torch(),
        "Libraries": {name: _version(name) for name in PACKAGES},
        "Environment variables": dict(envs.report()) or {"(none set)": ""},
    }


def format_report(sections: dict[str, dict[str, str]]) -> str:
    lines = []
    for title, values in sections.items():
        lines += [title, "-" * len(title)]
        width = max((len(k) for k in values), default=0)
        lines += [f"{k.ljust(width)} : {v}" if v else k for k, v in values.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
