"""The vision layer's row-wise work, all rows at once against row chunks (CUDA).

Between two attention calls a vision layer's work is row-wise: o_proj, add + LayerNorm, fc1,
GELU, fc2, the next layer's add + LayerNorm and QKV projection. Over one 4-tile image (6,432
rows) fc1's output is 66 MB, more than the H200's L2, so the GELU pass and fc2 read it from
memory. Run in row chunks, each chunk's intermediate can stay in L2, at the price of more,
smaller GEMMs and more launches (inside a CUDA graph, as the vision encoder runs).

Times are per layer inside one CUDA graph that chains the layer tail over four layers' weights
(median of replays); every chunked variant is compared with the unchunked one.

    python benchmarks/kernels/benchmark_vision_chunks.py [--rows 6432] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from benchmark_attention import time_graph_us

from vllm.model_executor.layers.fused_kernels import _layer_norm_row, add_layer_norm

D, INTER, EPS, LAYERS = 1280, 5120, 1e-5, 4


def make_layers(device: str) -> list[dict[str, torch.Tensor]]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * shape[-1] ** -0.5).bfloat16()

    def ones(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, device=device).bfloat16()

    return [dict(wo=w(D, D), bo=w(D) * 0.1, ln2w=ones(D), ln2b=w(D) * 0.1, w1=w(INTER, D),
                 b1=w(INTER) * 0.1, w2=w(D, INTER), b2=w(D) * 0.1, ln1w=ones(D),
                 ln1b=w(D) * 0.1, wqkv=w(3 * D, D)) for _ in range(LAYERS)]


@triton.jit
def _gelu_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    y = x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=m)


def triton_gelu_(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU in place, float32 math rounded once, like torch's."""
    n = x.numel()
    _gelu_kernel[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096, num_warps=8)
    return x


def gelu(m: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "torch":
        return F.gelu(m)
    if kind == "torch_":
        return torch._C._nn.gelu_(m)
    return triton_gelu_(m)


@triton.jit
def _ln_shift_kernel(x_ptr, w_ptr, b_ptr, shift_ptr, y_ptr, u_ptr, n_cols, eps,
                     HAS_SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    # y = layer_norm(x); u = x + shift (the next GEMM's residual input, bias folded in).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
    xf = x.to(tl.float32)
    y = _layer_norm_row(xf, m, n_cols, w_ptr, b_ptr, cols, eps)
    tl.store(y_ptr + row * n_cols + cols, y.to(x.dtype), mask=m)
    if HAS_SHIFT:
        sh = tl.load(shift_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(u_ptr + row * n_cols + cols, (xf + sh).to(x.dtype), mask=m)


def ln_shift(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
             shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    y = torch.empty_like(x)
    u = torch.empty_like(x) if shift is not None else None
    _ln_shift_kernel[(x.shape[0],)](x, w, b, shift if shift is not None else x, y,
                                    u if u is not None else y, x.shape[1], EPS,
                                    HAS_SHIFT=shift is not None, BLOCK=2048, num_warps=8)
    return y, u


def tail_epilogue(p: dict[str, torch.Tensor], attn: torch.Tensor, x: torch.Tensor,
                  qkv: torch.Tensor) -> torch.Tensor:
    """The same layer tail with both residual adds in the GEMM epilogues (beta = 1): o_proj
    adds into x; the norm writes x + fc2's bias, into which fc2 accumulates."""
    t = torch.addmm(x, attn, p["wo"].t())
    y2, u = ln_shift(t, p["ln2w"], p["ln2b"], p["b2"])
    m = torch._C._nn.gelu_(F.linear(y2, p["w1"], p["b1"]))
    x_next = torch.addmm(u, m, p["w2"].t())
    y, _ = ln_shift(x_next, p["ln1w"], p["ln1b"], None)
    torch.matmul(y, p["wqkv"].t(), out=qkv)
    return x_next


def tail_unbiased_o(p: dict[str, torch.Tensor], attn: torch.Tensor, x: torch.Tensor,
                    qkv: torch.Tensor) -> torch.Tensor:
    """The encoder's current layer tail (o_proj has no bias in the model)."""
    h = F.linear(attn, p["wo"])
    s, y2 = add_layer_norm(x, p["ln2w"], p["ln2b"], EPS, h)
    m = torch._C._nn.gelu_(F.linear(y2, p["w1"], p["b1"]))
    f = F.linear(m, p["w2"], p["b2"])
    s2, y = add_layer_norm(s, p["ln1w"], p["ln1b"], EPS, f)
    torch.matmul(y, p["wqkv"].t(), out=qkv)
    return s2


def mlp(p: dict[str, torch.Tensor], y: torch.Tensor, f: torch.Tensor, chunks: int,
        kind: str) -> None:
    """f = fc2(gelu(fc1(y))) in ``chunks`` row blocks."""
    rows = y.shape[0]
    step = -(-rows // chunks)
    for a in range(0, rows, step):
        b = min(a + step, rows)
        m = gelu(F.linear(y[a:b], p["w1"], p["b1"]), kind)
        torch.addmm(p["b2"], m, p["w2"].t(), out=f[a:b])


def tail(p: dict[str, torch.Tensor], attn: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
         qkv: torch.Tensor, f: torch.Tensor, chunks: int, kind: str, scope: str) -> None:
    """x (residual, updated in place) += o_proj(attn); MLP on its norm; x += MLP; qkv = next
    layer's QKV of norm(x). scope "tail": all of it in ``chunks`` row blocks; "mlp": only the
    MLP chunked."""
    if scope == "mlp":
        h = F.linear(attn, p["wo"], p["bo"])
        add_layer_norm(x, p["ln2w"], p["ln2b"], EPS, h, sum_out=x, norm_out=y)
        mlp(p, y, f, chunks, kind)
        add_layer_norm(x, p["ln1w"], p["ln1b"], EPS, f, sum_out=x, norm_out=y)
        torch.matmul(y, p["wqkv"].t(), out=qkv)
        return
    rows = x.shape[0]
    step = -(-rows // chunks)
    for a in range(0, rows, step):
        b = min(a + step, rows)
        h = F.linear(attn[a:b], p["wo"], p["bo"])
        add_layer_norm(x[a:b], p["ln2w"], p["ln2b"], EPS, h, sum_out=x[a:b], norm_out=y[a:b])
        m = gelu(F.linear(y[a:b], p["w1"], p["b1"]), kind)
        torch.addmm(p["b2"], m, p["w2"].t(), out=f[a:b])
        add_layer_norm(x[a:b], p["ln1w"], p["ln1b"], EPS, f[a:b], sum_out=x[a:b],
                       norm_out=y[a:b])
        torch.matmul(y[a:b], p["wqkv"].t(), out=qkv[a:b])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6432)
    parser.add_argument("--json", default=None)
    parser.add_argument("--residual-only", action="store_true",
                        help="only the residual-in-epilogue comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, dev = args.rows, "cuda"
    layers = make_layers(dev)
    attn = torch.randn(rows, D, device=dev).bfloat16()
    x0 = torch.randn(rows, D, device=dev).bfloat16()
    x, y = x0.clone(), torch.empty_like(x0)
    qkv = torch.empty(rows, 3 * D, device=dev, dtype=torch.bfloat16)
    results: dict[str, float] = {}

    # Residual adds in the GEMM epilogues against the current tail (chained over the layers).
    chain = {"current": tail_unbiased_o, "epilogue": tail_epilogue}
    outs = {}
    for name, fn in chain.items():
        outs[name] = fn(layers[0], attn, x0, qkv), qkv.clone()

        def run(fn=fn) -> None:
            h = x0
            for p in layers * 2:
                h = fn(p, attn, h, qkv)

        us = time_graph_us([run], replays=10) / (2 * LAYERS)
        results[f"residual/{name}"] = us
        print(f"residual/{name:10s} {us:8.1f} us per layer", flush=True)
    for i, what in enumerate(("residual out", "qkv")):
        a, b = outs["current"][i].float(), outs["epilogue"][i].float()
        print(f"epilogue vs current, {what}: bitwise {(a == b).float().mean().item():.4f}, "
              f"max |diff| {(a - b).abs().max().item():.3g}, max |ref| "
              f"{a.abs().max().item():.3g}")
    if args.residual_only:
        write_json(args.json, rows, results)
        return

    # The pieces alone, all rows (each chained over the four layers' weights).
    y.copy_(x0)
    m = torch.empty(rows, INTER, device=dev, dtype=torch.bfloat16).normal_()
    pieces = {
        "o_proj": lambda p: F.linear(attn, p["wo"], p["bo"]),
        "add_layer_norm": lambda p: add_layer_norm(x, p["ln2w"], p["ln2b"], EPS, attn),
        "fc1": lambda p: F.linear(y, p["w1"], p["b1"]),
        "gelu": lambda p: F.gelu(m),
        "gelu_inplace": lambda p: torch._C._nn.gelu_(m),
        "fc2": lambda p: F.linear(m, p["w2"], p["b2"]),
        "qkv": lambda p: torch.matmul(y, p["wqkv"].t(), out=qkv),
    }
    for name, fn in pieces.items():
        us = time_graph_us([lambda p=p, fn=fn: fn(p) for p in layers * 2], replays=10)
        results[f"piece/{name}"] = us
        print(f"{name:16s} {us:8.1f} us", flush=True)

    # The GELU three ways must agree bitwise (all round float32 erf math once).
    ref_gelu = F.gelu(m)
    for kind in ("torch_", "triton"):
        g = gelu(m.clone(), kind)
        results[f"gelu_equal/{kind}"] = (g == ref_gelu).float().mean().item()
        print(f"gelu {kind} bitwise equal to F.gelu: {results[f'gelu_equal/{kind}']:.6f}")
    us = time_graph_us([lambda: triton_gelu_(m)] * 8, replays=10)
    results["piece/gelu_triton"] = us
    print(f"{'gelu_triton':16s} {us:8.1f} us", flush=True)

    f = torch.empty_like(x0)
    ref = None
    variants = [("tail", 1, "torch")]
    variants += [(scope, c, k) for scope in ("mlp", "tail") for c in (1, 2, 4, 8)
                 for k in ("torch_", "triton")]
    for scope, chunks, kind in variants:
        x.copy_(x0)
        tail(layers[0], attn, x, y, qkv, f, chunks, kind, scope)
        out = qkv.clone()
        if ref is None:
            ref = out
        same = (out == ref).float().mean().item()
        err = (out.float() - ref.float()).abs().max().item()
        calls = [lambda p=p, s=scope, c=chunks, k=kind: tail(p, attn, x, y, qkv, f, c, k, s)
                 for p in layers * 2]
        us = time_graph_us(calls, replays=10)
        name = f"{scope}/chunks={chunks}/{kind}"
        results[name] = us
        print(f"{name:24s} {us:8.1f} us per layer; qkv bitwise equal to unchunked: "
              f"{same:.4f}, max |diff| {err:.3g}", flush=True)
    write_json(args.json, rows, results)


def write_json(path: str | None, rows: int, results: dict[str, float]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
