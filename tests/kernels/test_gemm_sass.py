"""The FP8 GEMM's K loop converts its weights on the integer and half-precision units: no
conversion-unit instruction in its sm_90 SASS, which Triton's bundled ptxas builds on the host
without a GPU (``benchmarks/kernels/sass.py``, run in a process of its own: this suite's
kernels are interpreted). The generic cast would put 1.5 of them a value there, whose issue
rate bounds the decode GEMM (``fp8_gemm._E4M3X4_PTX``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.kernels import sass

pytestmark = pytest.mark.skipif(not sass.tools_present(), reason="Triton without ptxas")
CONVERSIONS = ("F2F", "F2FP", "I2F", "F2I")


def loop_mix(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "sass", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args",
    [
        ("--config", "16,32,256,2"),
        ("--config", "16,64,128,4", "--swap", "--stages", "4"),
        ("--config", "1,64,128,8"),
    ],
    ids=["tensor-cores", "swapped", "cuda-cores"],
)
def test_fp8_k_loop_has_no_conversion_unit_instructions(args) -> None:
    mix = loop_mix("fp8", *args)
    products = mix.get("HMMA", 0) + mix.get("HGMMA", 0) + mix.get("FFMA", 0)
    assert mix["values"] > 0 and products > 0  # the K loop itself, found
    assert {op: mix[op] for op in CONVERSIONS if op in mix} == {}


def test_k_loop_is_the_largest_backward_branch() -> None:
    text = "\n".join(
        f"        /*{a:04x}*/                   {op} ;"
        for a, op in [
            (0x00, "MOV R1, R2"),
            (0x10, "IADD3 R1, R1, 0x1, RZ"),
            (0x20, "@P0 BRA 0x10"),  # a two-instruction loop
            (0x30, "LOP3.LUT R3, R1, 0xff, RZ, 0xc0, !PT"),
            (0x40, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
            (0x50, "@!P1 BRA 0x30"),  # the three-instruction one
            (0x60, "EXIT"),
        ]
    )
    mix = sass.k_loop(text)
    assert mix.instructions == 3 and mix.opcodes == {"LOP3": 1, "HMMA": 1, "BRA": 1}
    with pytest.raises(ValueError, match="no loop"):
        sass.k_loop(text.replace("BRA 0x10", "BRA 0x60").replace("BRA 0x30", "BRA 0x60"))


@pytest.mark.parametrize(
    "args", [("--config", "1,256,1,4"), ("--config", "4,256,1,4", "--silu")], ids=["1", "4-silu"]
)
def test_nf4_pair_kernel_moves_nothing_between_threads(args) -> None:
    """The NF4 pair kernel loads every operand in the layout it is used in (a thread's
    weight row, its table, the matching x): its K loop has no shared-memory traffic, barrier
    or spill, which in the table kernel's loop were a third of its instructions."""
    mix = loop_mix("nf4", "--pairs", *args)
    assert mix["values"] > 0 and mix.get("FFMA", 0) > 0 and mix.get("PRMT", 0) > 0
    moves = ("BAR", "LDS", "STS", "LDSM", "STL", "LDL")
    assert {op: mix[op] for op in moves if op in mix} == {}


@pytest.mark.parametrize(
    "args",
    [
        ("--config", "8,64,4,4"),
        ("--config", "8,128,4,2", "--warps", "8", "--silu"),
        ("--config", "16,64,4,4", "--silu"),
    ],
    ids=["4-warps", "8-warps-silu", "16-rows-silu"],
)
def test_nf4_mma_kernel_hands_each_lane_its_fragments(args) -> None:
    """The NF4 mma kernel's inline m16n8k16 steps take a lane's four consecutive registers of
    each [LANES, 4] operand as its share of the fragments: right only where every operand of
    that asm has one row a lane (32 lanes a warp, warps one after another) and its four
    columns in one thread, the layout a 16-byte load along the columns gives. Its K loop
    runs on the tensor cores and moves nothing between threads."""
    mix = loop_mix("nf4", "--mma", *args)
    warps = args[args.index("--warps") + 1] if "--warps" in args else "4"
    assert mix["mma_layouts"] == [
        "#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [32, 1], "
        f"warpsPerCTA = [{warps}, 1], order = [1, 0]}}>"
    ]
    assert mix["values"] > 0 and mix.get("HMMA", 0) > 0 and mix.get("PRMT", 0) > 0
    assert "FFMA" not in mix
    moves = ("BAR", "LDS", "STS", "LDSM", "STL", "LDL")
    assert {op: mix[op] for op in moves if op in mix} == {}
