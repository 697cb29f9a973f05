"""The bitsandbytes 4-bit format in torch: code tables, quantization and dequantization.

A matrix W [N, K] is flattened row-major and cut into blocks of ``blocksize`` elements. Each
block b has a scale a_b = max |w| over the block; each element is stored as the 4-bit index of
the code-table value nearest to w / a_b, two per byte, the even element in the high nibble.
With double quantization (``nested``) the scales themselves are stored as 8-bit indices into
the signed "dynamic" table: a_b = table[u_b] * s_g + offset, with offset the mean of all
scales and s_g the max |a - offset| over groups of 256 consecutive blocks.

Everything here computes exactly what bitsandbytes 0.50 computes on the CPU (the tests check
bitwise equality with ``bitsandbytes.functional``), so a matrix quantized at load equals the
one a pre-quantized checkpoint would hold. The engine never imports bitsandbytes.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace

import torch

QUANT_TYPES = ("nf4", "fp4")
NESTED_BLOCKSIZE = 256
BLOCKSIZES = tuple(2**i for i in range(5, 13))  # 32 ... 4096, as bitsandbytes allows

# NF4: quantiles of a standard normal, normalised to [-1, 1] (QLoRA), in index order.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# FP4 (1 sign, 2 exponent, 1 mantissa bits, exponent bias 2) in bit-pattern order, the sign bit
# last; the table is these divided by their largest magnitude (12) in float32. Index 8 (the
# negative zero pattern) holds +0.0 as bitsandbytes' table and CPU path do; its CUDA kernel
# multiplies the magnitude by the sign and so yields -0.0 there (``device_code``).
_FP4_VALUES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
# The 8-bit quantizer of the nested scales looks values up on a uniform grid of this many points
# over [-1, 1] (bitsandbytes' CPU quantizer does; the index arithmetic below follows it).
_GRID_POINTS = 65536


def code_table(quant_type: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 float32 values a 4-bit index stands for."""
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    if quant_type == "fp4":
        values = _FP4_VALUES + (0.0,) + tuple(-v for v in _FP4_VALUES[1:])
        table = torch.tensor(values, dtype=torch.float32, device=device)
        return table / table.abs().max()
    raise ValueError(f"unknown 4-bit quant_type {quant_type!r} (nf4 or fp4)")


def device_code(code: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The 16 values as bitsandbytes dequantizes them on ``code``'s device: on CUDA the FP4
    negative-zero pattern gives -0.0 (equal values, other bits), elsewhere the table as is."""
    if quant_type != "fp4" or code.device.type != "cuda":
        return code
    out = code.clone()
    out[8] = -0.0
    return out


def dynamic_map(device: torch.device | str | None = None) -> torch.Tensor:
    """The signed 8-bit "dynamic" table of the nested scales (256 sorted float32 values).

    For each exponent e = 0..6 the table holds the midpoints of 2^e equal steps over [0.1, 1],
    scaled by 10^(e-6), with both signs; then 0 and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (e - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class QuantState4bit:
    """The non-tensor description of one quantized matrix (its ``quant_state`` JSON)."""

    quant_type: str
    blocksize: int
    shape: tuple[int, int]
    dtype: str
    nested: bool
    nested_blocksize: int = NESTED_BLOCKSIZE
    offset: float | None = None  # the nested offset, as a checkpoint's JSON carries it

    @property
    def num_blocks(self) -> int:
        return -(-math.prod(self.shape) // self.blocksize)

    @property
    def num_groups(self) -> int:
        """Second-level scales (0 without double quantization)."""
        return -(-self.num_blocks // self.nested_blocksize) if self.nested else 0


@dataclass
class Packed4bit:
    """One quantized matrix as bitsandbytes stores it (tensors on any device)."""

    state: QuantState4bit
    packed: torch.Tensor  # uint8, N*K/2 bytes
    absmax: torch.Tensor  # per block: uint8 indices (nested) or float32 scales
    nested_absmax: torch.Tensor | None = None  # float32 [num_groups]
    nested_code: torch.Tensor | None = None  # float32 [256]
    nested_offset: torch.Tensor | None = None  # float32, 0-dim


def parse_quant_state(payload: bytes, quant_type: str) -> QuantState4bit:
    """Reads a ``quant_state.bitsandbytes__{quant_type}`` entry (UTF-8 JSON); raises ValueError
    naming the field that is missing or unsupported."""
    try:
        d = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"quant_state is not JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError("quant_state is not a JSON object")
    if d.get("quant_type", quant_type) != quant_type or quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type {d.get('quant_type')!r} (supported: nf4, fp4)")
    blocksize = d.get("blocksize")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize {blocksize!r} (supported: 32 ... 4096, powers of two)")
    shape = d.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) for s in shape)):
        raise ValueError(f"shape {shape!r} is not [out, in]")
    offset = d.get("nested_offset")
    nested = offset is not None
    if nested and not isinstance(offset, (int, float)):
        raise ValueError(f"nested_offset {offset!r} is not a number")
    nested_blocksize = d.get("nested_blocksize", NESTED_BLOCKSIZE)
    if nested and nested_blocksize != NESTED_BLOCKSIZE:
        raise ValueError(f"nested_blocksize {nested_blocksize!r} (supported: 256)")
    dtype = str(d.get("dtype"))
    return QuantState4bit(quant_type, blocksize, (shape[0], shape[1]), dtype, nested, offset=offset)


@functools.cache
def _grid_index_table(device: torch.device) -> torch.Tensor:
    """For each point of the uniform grid over [-1, 1], the index of the nearest value of the
    dynamic table (ties to the lower index)."""
    table = dynamic_map(device)
    mids = (table[:-1] + table[1:]) * 0.5
    i = torch.arange(_GRID_POINTS, dtype=torch.float32, device=device)
    grid = -1.0 + (2.0 * i) / float(_GRID_POINTS - 1)
    return torch.searchsorted(mids, grid, right=False).to(torch.uint8)


def quantize_8bit(
    x: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit quantization of a float32 vector with the dynamic table: returns
    (uint8 indices, float32 absmax per block). A value's index is read off a uniform grid:
    v = x / absmax (as x * (1 / absmax)), grid point ((v + 1) * 0.5) * 65535 + 0.5 truncated,
    every step rounded in float32."""
    n = x.numel()
    blocks = -(-n // blocksize)
    padded = torch.zeros(blocks * blocksize, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    grid = padded.view(blocks, blocksize)
    absmax = grid.abs().amax(dim=1)
    inv = 1.0 / absmax
    v = (grid * inv[:, None]).clamp(-1.0, 1.0)
    point = (((v + 1.0) * 0.5) * float(_GRID_POINTS - 1) + 0.5).to(torch.int64)
    codes = _grid_index_table(x.device)[point]
    codes = torch.where(absmax[:, None] == 0, torch.zeros_like(codes), codes)  # an all-zero block
    return codes.reshape(-1)[:n], absmax


@functools.cache
def _bucket_bounds(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoints between the sorted code values, sorted position -> code index)."""
    table = code_table(quant_type, device)
    order = torch.argsort(table, stable=True)
    return (table[order[:-1]] + table[order[1:]]) / 2, order


def _quantize_blocks(blocks: torch.Tensor, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, blocksize] float32 -> (packed uint8 [B * blocksize / 2], absmax [B])."""
    bounds, order = _bucket_bounds(quant_type, blocks.device)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1.0, 1.0)
    q = torch.bucketize(scaled.reshape(-1), bounds, out_int32=True)
    if quant_type != "nf4":  # the FP4 table is not sorted: sorted position -> its index
        q = order[q]
    q8 = q.to(torch.uint8)
    return (q8[0::2] << 4) | q8[1::2], absmax


def quantize_4bit(
    weight: torch.Tensor,
    quant_type: str = "nf4",
    blocksize: int = 64,
    nested: bool = True,
    chunk_blocks: int = 1 << 18,
) -> Packed4bit:
    """Quantizes a matrix [N, K] (on its device) as ``bitsandbytes.functional.quantize_4bit``
    does with ``compress_statistics=nested``. Blocks are processed ``chunk_blocks`` at a time
    (a block's result depends on that block only), so temporaries stay a few times one chunk
    however large the matrix."""
    if weight.dim() != 2 or weight.numel() % blocksize or blocksize not in BLOCKSIZES:
        raise ValueError(f"cannot quantize {tuple(weight.shape)} in blocks of {blocksize}")
    blocks = weight.reshape(-1, blocksize)
    packed, absmax = [], []
    for start in range(0, blocks.shape[0], chunk_blocks):
        p, a = _quantize_blocks(blocks[start : start + chunk_blocks].float(), quant_type)
        packed.append(p)
        absmax.append(a)
    dtype = str(weight.dtype).removeprefix("torch.")
    shape = (weight.shape[0], weight.shape[1])
    state = QuantState4bit(quant_type, blocksize, shape, dtype, nested)
    scales = torch.cat(absmax)
    if not nested:
        return Packed4bit(state, torch.cat(packed), scales)
    offset = scales.mean()
    codes, second = quantize_8bit(scales - offset)
    table = dynamic_map(weight.device)
    return Packed4bit(state, torch.cat(packed), codes, second, table, offset)


def nested_scales(
    codes: torch.Tensor,
    nested_absmax: torch.Tensor,
    nested_code: torch.Tensor,
    offset: torch.Tensor,
    group_base: int = 0,
) -> torch.Tensor:
    """float32 block scales of one matrix from its 8-bit indices: the product
    table[u_b] * s_(base + b // 256) is rounded before the offset is added, as bitsandbytes
    rounds it."""
    u = codes.reshape(-1).long()
    groups = torch.arange(u.numel(), device=u.device) // NESTED_BLOCKSIZE + group_base
    return nested_code[u] * nested_absmax[groups] + offset


def block_scales(p: Packed4bit) -> torch.Tensor:
    """The float32 scale of each block of ``p`` (decoded from its 8-bit indices if nested)."""
    if not p.state.nested:
        return p.absmax.float()
    assert p.nested_absmax is not None and p.nested_code is not None
    assert p.nested_offset is not None
    return nested_scales(p.absmax, p.nested_absmax, p.nested_code, p.nested_offset)


def slice_4bit(p: Packed4bit, dim: int, start: int, count: int) -> Packed4bit:
    """Rows (``dim`` 0) or columns (1) [start, start + count) of a quantized matrix, its block
    scales as float32: the values the whole matrix dequantizes with (a double-quantized
    matrix's slice is no longer a whole number of its 256-block groups). The blocks must lie
    within rows, and a column slice must cut between blocks."""
    s = p.state
    (n, k), bs = s.shape, s.blocksize
    if k % bs or (dim == 1 and (start % bs or count % bs)):
        raise ValueError(
            f"cannot cut {list(s.shape)} in blocks of {bs} at {'column' if dim else 'row'} "
            f"{start} ({count} a part)"
        )
    scales = block_scales(p).reshape(n, k // bs)
    packed = p.packed.reshape(n, k // 2)
    if dim == 0:
        packed, scales, shape = (
            packed[start : start + count],
            scales[start : start + count],
            (count, k),
        )
    else:
        packed = packed[:, start // 2 : (start + count) // 2]
        scales = scales[:, start // bs : (start + count) // bs]
        shape = (n, count)
    state = replace(s, shape=shape, nested=False, offset=None)
    return Packed4bit(state, packed.contiguous().reshape(-1), scales.contiguous().reshape(-1))


def dequantize_codes(
    packed: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    blocksize: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """[N, K] in ``dtype``: table[index] * scale computed in float32, then rounded once."""
    b = packed.reshape(-1)
    idx = torch.stack((b >> 4, b & 15), dim=-1).reshape(-1).long()
    values = table[idx].view(-1, blocksize) * scales.reshape(-1, 1)
    return values.reshape(shape).to(dtype)


def dequantize_4bit(p: Packed4bit, dtype: torch.dtype) -> torch.Tensor:
    """The matrix [N, K] of a :class:`Packed4bit` in ``dtype``."""
    s = p.state
    scales = block_scales(p)
    table = code_table(s.quant_type, p.packed.device)
    return dequantize_codes(p.packed, scales, table, s.blocksize, s.shape, dtype)
