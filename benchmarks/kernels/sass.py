"""The instruction mix of a weight-only decode GEMM's K loop in its sm_90 SASS, built on the host
(no GPU needed): Triton compiles the kernel for the named target with its bundled ptxas, and
its bundled cuobjdump disassembles the cubin. The K loop is the body of the kernel's largest
backward branch; the report counts its instructions by opcode and per weight value a thread
handles in one iteration, the figure the decode GEMMs' conversion work shows up in (the GPU's
issue rate bounds it, see ``fp8_gemm._E4M3X4_PTX``). Pointer arguments and strides are
compiled as 16-byte aligned, as Triton specializes them at run time.

    python -m benchmarks.kernels sass fp8 [--config 16,32,256,2] [--swap] [--silu] [--stages 3]
    python -m benchmarks.kernels sass nf4 [--config 16,64,2,4] [--pairs | --mma] [--silu]

fp8 ``--config``: block_m, block_n, block_k, split_k (``Fp8Config``); nf4: block_m, block_n,
blocks_per_iter, split_k of the table kernel (``Nf4Config(table=True)``) or with ``--pairs``
of the pair kernel (``Nf4Config(pairs=True)``), with ``--mma`` of the mma kernel (8 rows, or
16 where the config says more than 8, 4 blocks an iteration and 16 weight rows a warp whatever
the config says), blocksize 64, nested scales. The K is the 11B hidden size (4096).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

K = 4096
_SIZES = {"M": "i32", "N": "i32", "x_stride": "i32", "y_stride": "i32"}
_ALIGNED_INTS = ("N", "x_stride", "y_stride")  # Triton specializes these (multiples of 16)


def tool(name: str) -> Path:
    """One of the CUDA binaries bundled with Triton's NVIDIA backend."""
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def tools_present() -> bool:
    return tool("ptxas").exists() and tool("cuobjdump").exists()


def compile_sass(
    fn, types: dict[str, str], constexprs: dict[str, object], num_warps: int, num_stages: int
) -> str:
    """The SASS of ``fn`` compiled for sm_90 with these argument types and constants (every
    argument is one or the other)."""
    return compile_both(fn, types, constexprs, num_warps, num_stages)[0]


def compile_both(
    fn, types: dict[str, str], constexprs: dict[str, object], num_warps: int, num_stages: int
) -> tuple[str, str]:
    """(SASS, TTGIR) of ``fn`` compiled for sm_90."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, ty) in enumerate(signature.items())
        if ty.startswith("*") or name in _ALIGNED_INTS
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        done = subprocess.run(
            [str(tool("cuobjdump")), "-sass", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stdout, kernel.asm["ttgir"]


_LAYOUT = re.compile(r"^(#[\w]+) = (.*)$", re.M)
_OPERAND_TYPES = re.compile(r"tensor<[^>]*, (#\w+)>")


def asm_operand_layouts(ttgir: str, marker: str) -> set[str]:
    """The layouts (their definitions) of every operand and result of the inline-asm ops whose
    text contains ``marker``."""
    defs = dict(_LAYOUT.findall(ttgir))
    found: set[str] = set()
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" in line and marker in line:
            found |= {defs.get(a, a) for a in _OPERAND_TYPES.findall(line.split("}", 1)[-1])}
    return found


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")


@dataclass
class LoopMix:
    instructions: int
    opcodes: Counter

    def per_value(self, values: int) -> float:
        return self.instructions / values


def k_loop(sass: str) -> LoopMix:
    """The opcodes of the largest backward-branch body (predicates and modifiers dropped)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    best: tuple[int, int] | None = None
    for i, (addr, text) in enumerate(ins):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            start = index[int(m.group(1), 16)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    if best is None:
        raise ValueError("no loop in this kernel's SASS")
    body = [text for _, text in ins[best[0] : best[1] + 1]]
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return LoopMix(len(body), ops)


def fp8_loop(
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    swap: bool = False,
    silu: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
) -> tuple[LoopMix, int]:
    """The FP8 GEMM's K loop for bf16 activations, and the weight values a thread converts
    per iteration."""
    from vllm.model_executor.layers import fp8_gemm

    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    types.update(p_ptr="*fp32", c_ptr="*i32", **_SIZES)
    consts: dict[str, object] = dict(
        K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, DOT_F32=False
    )
    consts.update(SILU_MUL=silu, PTX=True)
    if swap:
        fn = fp8_gemm._fp8_swap_kernel
    else:
        fn = fp8_gemm._fp8_gemm_kernel
        consts["CUDA_CORES"] = block_m <= fp8_gemm.MAX_CUDA_CORE_ROWS
    mix = k_loop(compile_sass(fn, types, consts, num_warps, num_stages))
    return mix, block_n * block_k * (2 if silu else 1) // (32 * num_warps)


def nf4_loop(
    block_m: int,
    block_n: int,
    blocks_per_iter: int,
    split_k: int,
    silu: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
    pairs: bool = False,
    mma: bool = False,
    layouts: list[str] | None = None,
) -> tuple[LoopMix, int]:
    """The NF4 table kernel's (or with ``pairs`` the pair kernel's) K loop for bf16
    activations (blocksize 64, nested scales, a three-shard weight), and the weight values a
    thread looks up per iteration."""
    from vllm.model_executor.layers import nf4_gemm

    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "code_ptr": "*fp32"}
    types.update(n2_ptr="*fp32", nc_ptr="*fp32", sh_ptr="*i32", off_ptr="*fp32")
    types.update(y_ptr="*bf16", p_ptr="*fp32", **_SIZES)
    consts: dict[str, object] = dict(
        K=K, BLOCKSIZE=64, NESTED=True, NUM_SHARDS=3, BLOCK_M=block_m, BLOCK_N=block_n
    )
    consts.update(BLOCKS_PER_ITER=blocks_per_iter, SPLIT_K=split_k)
    consts.update(EXACT_BF16=False, EXACT_MUL=True, SILU_MUL=silu, PTX=True)
    if mma:  # 8 or 16 rows, 4 blocks an iteration, 16 weight rows a warp
        fn = nf4_gemm._nf4_mma_kernel
        for name in ("BLOCKSIZE", "BLOCK_M", "BLOCK_N", "BLOCKS_PER_ITER"):
            del consts[name]
        consts.update(WARPS=num_warps, SETS=2 if block_m > 8 else 1)
        block_n, blocks_per_iter = 16 * num_warps, 4
    elif pairs:
        fn = nf4_gemm._nf4_pair_kernel
    else:
        fn = nf4_gemm._nf4_table_kernel
        consts["DOT_F32"] = False
    sass, ttgir = compile_both(fn, types, consts, num_warps, num_stages)
    if layouts is not None:  # where the inline tensor-core products read their fragments
        layouts += sorted(asm_operand_layouts(ttgir, "mma.sync"))
    values = block_n * blocks_per_iter * 64 * (2 if silu else 1) // (32 * num_warps)
    return k_loop(sass), values


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("fp8", "nf4"))
    ap.add_argument("--config", default=None, help="four integers, comma-separated")
    ap.add_argument("--swap", action="store_true", help="fp8: the swapped kernel")
    ap.add_argument("--pairs", action="store_true", help="nf4: the pair kernel")
    ap.add_argument("--mma", action="store_true", help="nf4: the mma kernel (--warps, split)")
    ap.add_argument("--silu", action="store_true", help="gate|up with the SiLU epilogue")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels do not compile")
    if not tools_present():
        raise SystemExit(f"ptxas / cuobjdump not found next to Triton ({tool('ptxas').parent})")
    default = "16,32,256,2" if args.kernel == "fp8" else "16,64,2,4"
    a, b, c, d = (int(v) for v in (args.config or default).split(","))
    if args.kernel == "fp8":
        mix, values = fp8_loop(a, b, c, d, args.swap, args.silu, args.warps, args.stages)
    else:
        layouts: list[str] = []
        mix, values = nf4_loop(
            a,
            b,
            c,
            d,
            args.silu,
            args.warps,
            args.stages,
            args.pairs,
            args.mma,
            layouts,
        )
    if args.json:
        extra = {"mma_layouts": layouts} if args.kernel == "nf4" and args.mma else {}
        print(
            json.dumps({"instructions": mix.instructions, "values": values, **mix.opcodes, **extra})
        )
        return
    print(
        f"{args.kernel} K loop: {mix.instructions} instructions for {values} weight values a "
        f"thread, {mix.per_value(values):.2f} per value"
    )
    for op, n in mix.opcodes.most_common():
        print(f"  {op:10s} {n:5d}  ({n / values:.2f} per value)")


if __name__ == "__main__":
    main()
