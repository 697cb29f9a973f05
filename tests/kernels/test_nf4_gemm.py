"""The 4-bit Triton kernels against bitsandbytes (Triton's interpreter on CPU, compiled on CUDA).

Weights are quantized by ``bitsandbytes.functional.quantize_4bit`` and loaded into a 4-bit
layer through its checkpoint loader; the dequantized tile must equal ``dequantize_4bit``
bitwise, and the GEMM ``x @ dequantize_4bit(W)^T`` to float32-accumulation rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("bitsandbytes")  # the reference; a test dependency, not the engine's
from helpers.bnb_checkpoints import DEVICE, bnb_layer
from helpers.compare import assert_epilogue_matches

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers import nf4_gemm
from vllm.model_executor.layers.fused_kernels import silu_and_mul
from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.model_executor.layers.nf4_gemm import Nf4Config
from vllm.model_executor.layers.quantization.bitsandbytes import Bnb4bitFormat

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, but for the sign of zeros: bitsandbytes' own CPU dequantization gives
    FP4's negative-zero pattern (index 8) as -0.0 on some machines (an AMD EPYC with AVX2)
    and +0.0 on others, so no fixed choice matches it everywhere (``bnb_codec.device_code``
    follows its CUDA kernel on CUDA). Adding +0.0 turns -0.0 into +0.0 and nothing else."""
    return a.dtype == b.dtype and torch.equal(
        (a + 0.0).view(_BITS[a.dtype]), (b + 0.0).view(_BITS[b.dtype])
    )


CASES = [
    # q|k|v shards whose second-level scale groups straddle the shard boundaries.
    ([80, 48, 48], 512, "nf4", 64, True, torch.bfloat16),
    ([64], 256, "fp4", 64, False, torch.float16),
    ([40], 512, "nf4", 256, True, torch.float32),  # a block wider than the tile
    ([48, 48], 128, "fp4", 32, True, torch.bfloat16),
    ([96], 384, "nf4", 128, False, torch.bfloat16),
]


@pytest.mark.parametrize(("shards", "k", "qt", "bs", "nested", "dtype"), CASES)
def test_dequantized_tile_is_bitwise_dequantize_4bit(shards, k, qt, bs, nested, dtype) -> None:
    layer, ref = bnb_layer(shards, k, qt, bs, nested, dtype)
    fmt = layer.fmt
    assert isinstance(fmt, Bnb4bitFormat)
    out = torch.full_like(ref, float("nan"))
    nf4_gemm.dequantize(fmt.quantized_weight(layer), out)
    assert same_bits(out, ref)
    assert same_bits(fmt.dequantize(layer, dtype), ref)  # the torch path, the same values


@pytest.mark.parametrize(("shards", "k", "qt", "bs", "nested", "dtype"), CASES)
@pytest.mark.parametrize(
    "kernel",
    ["split", "whole", "table", "table-split", "pairs", "pairs-split", "mma", "mma-split", "mma16"],
)
def test_gemm_tile_is_bitwise_dequantize_4bit(shards, k, qt, bs, nested, dtype, kernel) -> None:
    """The GEMM's own dequantized weights, seen through one-hot inputs (each output is then
    one exact product, 1 x w): ``dequantize_4bit``'s values bitwise, for every format and
    both kernels (the table kernel's lookups included)."""
    layer, ref = bnb_layer(shards, k, qt, bs, nested, dtype)
    qw = layer.fmt.quantized_weight(layer)
    cols = torch.tensor([0, 1, bs - 1, bs, k // 2 + 1, k - 1])
    x = torch.zeros(len(cols), k, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    halved = (k // bs) % 2 == 0
    if kernel.startswith(("table", "pairs", "mma")) and dtype == torch.float32:
        pytest.skip("the table, pair and mma kernels take 16-bit inputs")
    if kernel.startswith("mma") and (bs != 64 or (k // bs) % (8 if kernel == "mma-split" else 4)):
        pytest.skip("the mma kernel runs blocks of 64, four an iteration")
    if kernel.startswith("table"):
        cfg = Nf4Config(16, 16, table=True)
        if kernel == "table-split" and halved:
            cfg = Nf4Config(16, 32, split_k=2, table=True)
    elif kernel.startswith("mma"):
        # 64 weight rows a program (rows past N clamped), 8 x rows (rows past M clamped).
        # mma16: two sets of 8 x rows (the second all past M), K split where it divides.
        split = 2 if kernel == "mma-split" or (kernel == "mma16" and (k // bs) % 8 == 0) else 1
        cfg = Nf4Config(16 if kernel == "mma16" else 8, 64, 4, split_k=split, mma=True)
    elif kernel.startswith("pairs"):
        cfg = Nf4Config(4, 256, pairs=True)  # weight rows past N clamped
        if kernel == "pairs-split" and halved:
            cfg = Nf4Config(2, 128, split_k=2, pairs=True)
    else:
        cfg = Nf4Config(4, 32, split_k=2) if kernel == "split" and halved else Nf4Config(8, 16)
    y = nf4_gemm.nf4_gemm(x.to(DEVICE), qw, cfg)
    # A sum that starts at +0 cannot end at -0: FP4's negative-zero code (-0.0 on CUDA, as
    # bitsandbytes' kernel gives it) shows as +0 through the products; every other bit holds.
    assert same_bits(y, ref[:, cols].T.contiguous() + 0.0)


GEMM_CONFIGS = [
    Nf4Config(1, 32, num_stages=2),  # one block per iteration
    Nf4Config(2, 64, blocks_per_iter=2, num_stages=2),
    Nf4Config(4, 32, split_k=2, num_stages=2),  # K split, partial sums reduced
    Nf4Config(8, 16, blocks_per_iter=2, split_k=2, num_stages=2),
    Nf4Config(16, 32, table=True),  # the tensor-core table kernel
    Nf4Config(16, 16, blocks_per_iter=2, split_k=2, table=True),
    # The tile shapes the H200 table runs (16 x 64 up to 16 rows, 64 x 64 above).
    Nf4Config(16, 64, blocks_per_iter=2, split_k=2, table=True),
    Nf4Config(64, 64, split_k=4, table=True),
    # The CUDA-core pair kernel: ``PAIR_CASES`` (the interpreter pays per program and
    # operation, so a few row counts on wide tiles).
]
PAIR_CASES = [
    (1, Nf4Config(1, 256, pairs=True)),  # weight rows past N (176) clamped
    (3, Nf4Config(2, 128, blocks_per_iter=2, split_k=2, pairs=True)),  # x rows past M clamped
    (21, Nf4Config(4, 128, split_k=2, pairs=True)),
    # The tensor-core mma kernel: 8 x rows a program (past M clamped), 16 weight rows a warp.
    (3, Nf4Config(8, 64, 4, mma=True)),
    (17, Nf4Config(8, 128, 4, num_warps=8, mma=True)),  # three row programs, 48 rows past N
    (21, Nf4Config(16, 64, 4, mma=True)),  # two sets of 8 x rows a program, rows past M
    # The table kernel's 128-row tile (the sweep's candidate above 64 rows): two row tiles.
    (130, Nf4Config(128, 32, split_k=2, num_warps=8, table=True)),
]


@pytest.mark.parametrize(
    ("m", "cfg"), [(m, c) for m in (1, 3, 16, 21) for c in GEMM_CONFIGS] + PAIR_CASES, ids=str
)
def test_gemm_matches_dequantize_and_matmul(m: int, cfg: Nf4Config) -> None:
    """Rows below, at and above the row block; N (176) not a multiple of the column block;
    with and without a K split."""
    layer, ref = bnb_layer([80, 48, 48], 256, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    y = nf4_gemm.nf4_gemm(x, layer.fmt.quantized_weight(layer), cfg)
    expected = x.float() @ ref.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, 176)
    # Exact products, float32 sums in another order, then one bf16 rounding (2 ulps).
    torch.testing.assert_close(y.float(), expected, rtol=2**-7, atol=1e-3)


def test_fp16_gemm_and_float32_out() -> None:
    """fp16 activations; an fp32 ``out`` gets the kernel's rounded result widened."""
    layer, ref = bnb_layer([96], 384, "fp4", 128, False, torch.float16)
    qw = layer.fmt.quantized_weight(layer)
    x = torch.randn(5, 384).to(DEVICE, torch.float16)
    for cfg in (Nf4Config(4, 32, num_stages=2), Nf4Config(2, 128, pairs=True)):
        out = torch.full((5, 96), float("nan"), device=DEVICE)
        nf4_gemm.nf4_gemm(x, qw, cfg, out=out)
        assert torch.equal(out, nf4_gemm.nf4_gemm(x, qw, cfg).float())
        torch.testing.assert_close(out, x.float() @ ref.float().T, rtol=2**-9, atol=1e-3)
    layer, ref = bnb_layer([96], 256, "nf4", 64, True, torch.float16)  # the mma kernel's blocks
    x = torch.randn(5, 256).to(DEVICE, torch.float16)
    cfg = Nf4Config(8, 32, 4, num_warps=2, mma=True)
    y = nf4_gemm.nf4_gemm(x, layer.fmt.quantized_weight(layer), cfg)
    torch.testing.assert_close(y.float(), x.float() @ ref.float().T, rtol=2**-9, atol=1e-3)


@pytest.mark.parametrize(
    ("m", "cfg"),
    [
        (1, Nf4Config(1, 32, num_stages=2)),
        (17, Nf4Config(8, 32, split_k=2, num_stages=2)),
        (3, Nf4Config(4, 32, blocks_per_iter=2, split_k=2, num_stages=2)),
        (17, Nf4Config(16, 32, split_k=2, table=True)),
        (3, Nf4Config(16, 64, blocks_per_iter=2, split_k=2, table=True)),
        (1, Nf4Config(1, 128, pairs=True)),
        (3, Nf4Config(4, 128, blocks_per_iter=2, split_k=2, pairs=True)),
        (3, Nf4Config(8, 64, 4, mma=True)),
        (17, Nf4Config(16, 64, 4, mma=True)),
    ],
)
def test_silu_epilogue_equals_gemm_then_silu_and_mul(m: int, cfg: Nf4Config) -> None:
    """gate|up with SiLU-and-multiply in the epilogue (in the split reduction with a K split):
    the GEMM (same config) then ``silu_and_mul``, bitwise on CUDA (``assert_epilogue_matches``);
    close to the torch reference."""
    layer, ref = bnb_layer([80, 80], 256, seed=m + 3)
    qw = layer.fmt.quantized_weight(layer)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    y = nf4_gemm.nf4_gemm_silu(x, qw, cfg)
    assert y.shape == (m, 80)
    assert_epilogue_matches(y, silu_and_mul(nf4_gemm.nf4_gemm(x, qw, cfg)))
    w = ref.to(torch.bfloat16)
    expected = F.silu(F.linear(x, w[:80]).float()) * F.linear(x, w[80:]).float()
    torch.testing.assert_close(y.float(), expected, rtol=2**-5, atol=2**-7)


def _kinds(table: list) -> list[str]:
    names = {
        "linear_kernel": "nf4",
        "silu_kernel": "nf4",
        "_scratch_kernel": "scratch",
        "torch_kernel": "torch",
    }
    return ["none" if k is None else names[k.__qualname__.split(".")[-3]] for k in table]


BUCKETS = (1, 4, 24)


def test_kernel_tables_and_their_results() -> None:
    """16-bit layers run the 4-bit GEMM (untuned shapes: the mma kernel up to 8 rows, the
    table kernel above) at every decode bucket, and any other row count dequantizes into the shared
    scratch and runs F.linear (bitwise the torch path); biased layers (the vision tower's, the
    projector: they see prefill-sized inputs only) take the scratch path everywhere; float32
    layers the CUDA-core GEMM up to 4 rows; torch targets the torch path. gate|up gets the
    SiLU epilogue where the GEMM runs."""
    layer, _ = bnb_layer([80, 80], 256)
    fused = KernelTarget(torch.device(DEVICE), fused=True, row_buckets=BUCKETS)
    layer.select_kernels(fused)
    assert _kinds(layer._kernels) == ["nf4"] * 3 + ["scratch"]
    assert _kinds(layer._silu_kernels) == ["nf4"] * 3 + ["none"]
    torch_path = layer.fmt.torch_kernel(layer)
    for bucket, rows in enumerate(BUCKETS):
        x = torch.randn(rows, 256).to(DEVICE, torch.bfloat16)
        with set_forward_context(None, row_bucket=bucket):
            torch.testing.assert_close(layer(x), torch_path(x, None), rtol=2**-7, atol=1e-3)
    x = torch.randn(2, 7, 256).to(DEVICE, torch.bfloat16)  # vision-shaped input
    assert torch.equal(layer(x), torch_path(x, None))
    layer.select_kernels(KernelTarget(torch.device(DEVICE), fused=False, row_buckets=BUCKETS))
    assert _kinds(layer._kernels) == ["torch"] * 4
    biased, _ = bnb_layer([64], 128, bias=True)
    biased.select_kernels(fused)
    assert _kinds(biased._kernels) == ["scratch"] * 4
    x = torch.randn(3, 128).to(DEVICE, torch.bfloat16)
    with set_forward_context(None, row_bucket=0):
        assert torch.equal(biased(x), biased.fmt.torch_kernel(biased)(x, None))
    fp32, _ = bnb_layer([64], 128, dtype=torch.float32)
    fp32.select_kernels(fused)
    assert _kinds(fp32._kernels) == ["nf4"] * 2 + ["scratch"] * 2
    x = torch.randn(8, 128, device=DEVICE)
    with set_forward_context(None, row_bucket=1):
        torch.testing.assert_close(fp32(x), fp32.fmt.torch_kernel(fp32)(x, None))


def test_prefill_rows_take_the_gemm_up_to_the_tuned_row_counts(monkeypatch, tmp_path) -> None:
    """Row counts outside the decode buckets (prefill chunks) run the GEMM of the first tuned
    entry with at least as many rows, and the scratch path (bitwise the torch path) at a
    "scratch" entry, above the last entry and for inputs that are not [M, K] rows; gate|up's
    SiLU kernel likewise, with the separate activation on the scratch path."""
    from vllm.model_executor.layers.quantization import bitsandbytes as bnb_format
    from vllm.model_executor.layers.tuned_configs import TunedTables

    layer, _ = bnb_layer([80, 80], 256)
    qw = layer.fmt.quantized_weight(layer)
    mma, table = Nf4Config(8, 64, 4, 1, mma=True), Nf4Config(16, 64, 1, 2, table=True)
    tuned = TunedTables(tmp_path, Nf4Config)
    key, silu_key = nf4_gemm.table_key(160, 256, 64, False), nf4_gemm.table_key(80, 256, 64, True)
    tuned.merge(
        "Test GPU",
        [
            (key, 8, vars(mma)),
            (key, 32, vars(table)),
            (key, 64, "scratch"),
            (silu_key, 32, vars(table)),
        ],
    )
    monkeypatch.setattr(nf4_gemm, "TUNED", tuned)
    monkeypatch.setattr(bnb_format, "_device_name", lambda target: "Test GPU")
    layer.select_kernels(KernelTarget(torch.device(DEVICE), fused=True, row_buckets=(1,)))
    torch_path = layer.fmt.torch_kernel(layer)
    with set_forward_context(None, row_bucket=1):  # the any-rows entry
        silu = layer.silu_kernel()
        assert silu is not None
        for m, cfg, silu_cfg in [
            (3, mma, table),
            (8, mma, table),
            (9, table, table),
            (32, table, table),
            (33, None, None),
            (64, None, None),
            (65, None, None),
        ]:
            x = torch.randn(m, 256).to(DEVICE, torch.bfloat16)
            plain = torch_path(x, None)
            want = plain if cfg is None else nf4_gemm.nf4_gemm(x, qw, cfg)
            assert torch.equal(layer(x), want), m
            if cfg is not None:  # the GEMM, not the scratch path
                torch.testing.assert_close(want, plain, rtol=2**-7, atol=1e-3)
            want = (
                silu_and_mul(plain) if silu_cfg is None else nf4_gemm.nf4_gemm_silu(x, qw, silu_cfg)
            )
            assert torch.equal(silu(x), want), m
        x = torch.randn(2, 3, 256).to(DEVICE, torch.bfloat16)  # not rows: the scratch path
        assert torch.equal(layer(x), torch_path(x, None))
    monkeypatch.setattr(bnb_format, "_device_name", lambda target: "Untuned GPU")
    layer.select_kernels(KernelTarget(torch.device(DEVICE), fused=True, row_buckets=(1,)))
    assert _kinds(layer._kernels)[-1] == "scratch" and layer._silu_kernels[-1] is None


@pytest.mark.gpu
def test_graph_replay_equals_eager() -> None:
    """Same bucket, same kernel: a captured 4-bit GEMM replays bitwise what eager computes."""
    layer, _ = bnb_layer([4096, 1024, 1024], 4096)
    layer.select_kernels(KernelTarget(torch.device("cuda"), fused=True, row_buckets=(1, 16)))
    for bucket, rows in enumerate((1, 16)):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), set_forward_context(None, row_bucket=bucket):
            eager = layer(x)
            graph, static_x = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                static_y = layer(static_x)
            graph.replay()
        assert torch.equal(static_y, eager)


def test_table_pair_and_mma_kernels_refuse_what_they_cannot_run() -> None:
    layer, _ = bnb_layer([64], 256)
    qw = layer.fmt.quantized_weight(layer)
    with pytest.raises(ValueError, match="16-bit inputs"):
        nf4_gemm.nf4_gemm(torch.randn(2, 256).to(DEVICE), qw, Nf4Config(16, 16, table=True))
    with pytest.raises(ValueError, match="16 wide"):
        x = torch.randn(2, 256).to(DEVICE, torch.bfloat16)
        nf4_gemm.nf4_gemm(x, qw, Nf4Config(8, 16, table=True))
    x = torch.randn(2, 256).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit inputs"):
        nf4_gemm.nf4_gemm(x.float(), qw, Nf4Config(1, 32, pairs=True))
    with pytest.raises(ValueError, match="1, 2 or 4 rows"):
        nf4_gemm.nf4_gemm(x, qw, Nf4Config(8, 32, pairs=True))
    wide = torch.randn(2, 258).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="32-bit pairs"):  # rows start 2 bytes off
        nf4_gemm.nf4_gemm(wide[:, 1:257], qw, Nf4Config(1, 32, pairs=True))
    with pytest.raises(ValueError, match="32-bit pairs"):
        nf4_gemm.nf4_gemm(wide[:, 1:257], qw, Nf4Config(8, 64, 4, mma=True))
    with pytest.raises(ValueError, match="16-bit inputs"):
        nf4_gemm.nf4_gemm(x.float(), qw, Nf4Config(8, 64, 4, mma=True))
    with pytest.raises(ValueError, match="16 weight rows a warp"):
        nf4_gemm.nf4_gemm(x, qw, Nf4Config(8, 128, 4, mma=True))  # 4 warps hold 64 rows
    with pytest.raises(ValueError, match="8 or 16 rows and 4 blocks"):
        nf4_gemm.nf4_gemm(x, qw, Nf4Config(8, 64, 2, mma=True))
    with pytest.raises(ValueError, match="8 or 16 rows and 4 blocks"):
        nf4_gemm.nf4_gemm(x, qw, Nf4Config(32, 64, 4, mma=True))
    wide_blocks, _ = bnb_layer([64], 512, "nf4", 128, True)  # four blocks of 128
    with pytest.raises(ValueError, match="blocks of 64"):
        qw = wide_blocks.fmt.quantized_weight(wide_blocks)
        nf4_gemm.nf4_gemm(
            torch.randn(2, 512).to(DEVICE, torch.bfloat16), qw, Nf4Config(8, 64, 4, mma=True)
        )


def test_heuristic_configs() -> None:
    """Untuned shapes: 16-bit inputs in blocks of 64 get the mma kernel up to 8 rows (64
    weight rows a program, the K split up to 384 programs where it divides K), other blocks
    the pair kernel at one row (512 weight rows a program, the split up to 128 programs),
    and the table kernel at every other decode size (tiles that divide K, the split larger
    where column tiles are few); float32 the CUDA-core kernel up to 4 rows, the scratch path
    above."""
    for m in (1, 4, 8, 16, 17, 64, 256):
        for n, k, bs in ((6144, 4096, 64), (4096, 14336, 64), (4096, 4096, 64), (96, 384, 128)):
            cfg = nf4_gemm.heuristic_config(m, n, k, bs)
            assert cfg is not None and cfg.fits(k, bs) and cfg.serves(m)
            if m <= 8 and bs == 64:
                assert cfg.mma and (cfg.block_m, cfg.block_n, cfg.blocks_per_iter) == (8, 64, 4)
            elif m == 1:
                assert cfg.pairs and cfg.block_m == 1 and cfg.block_n == 512
            else:
                assert cfg.table and cfg.block_m == (16 if m <= 16 else 64)
    assert nf4_gemm.heuristic_config(1, 4096, 4096).split_k == 8  # 64 column tiles
    assert nf4_gemm.heuristic_config(8, 6144, 4096).split_k == 4  # 96
    assert nf4_gemm.heuristic_config(1, 28672, 4096).split_k == 1  # 448
    assert nf4_gemm.heuristic_config(1, 96, 384, 128).split_k == 1  # 3 blocks: no split fits
    assert nf4_gemm.heuristic_config(4, 4096, 4096).split_k == 8
    assert nf4_gemm.heuristic_config(4, 6144, 4096).split_k == 4
    f32 = nf4_gemm.heuristic_config(4, 4096, 4096, dtype=torch.float32)
    assert f32 is not None and not f32.table and f32.block_m == 4
    assert nf4_gemm.heuristic_config(5, 4096, 4096, dtype=torch.float32) is None
    assert nf4_gemm.decode_config(
        1, 96, 384, 128, dtype=torch.float32
    ) == nf4_gemm.heuristic_config(1, 96, 384, 128, dtype=torch.float32)
