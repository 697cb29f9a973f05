"""The 4-bit format's math in torch (``bnb_codec``) against bitsandbytes itself, bitwise: the
code tables, quantization (the load-time quantizer) and dequantization."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.bnb_codec import (
    code_table,
    dequantize_4bit,
    dynamic_map,
    parse_quant_state,
    quantize_4bit,
    slice_4bit,
)

bnbf = pytest.importorskip("bitsandbytes.functional")  # the reference; a test dependency

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype])


def test_code_tables_are_bitsandbytes_tables() -> None:
    for quant_type in ("nf4", "fp4"):
        ref = bnbf.get_4bit_type(quant_type, device="cpu")
        assert torch.equal(_bits(code_table(quant_type)), _bits(ref))
    assert torch.equal(_bits(dynamic_map()), _bits(bnbf.create_dynamic_map()))


SHAPES = [
    ((384, 640), 64, torch.bfloat16),  # several second-level groups, the last one partial
    ((1000, 128), 128, torch.float16),
    ((96, 1280), 32, torch.float32),
    ((70, 64), 64, torch.bfloat16),  # fewer blocks than one second-level group
]


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(("shape", "blocksize", "dtype"), SHAPES)
def test_quantize_4bit_is_bitwise_bitsandbytes(shape, blocksize, dtype, quant_type, nested) -> None:
    g = torch.Generator().manual_seed(blocksize + shape[0])
    w = (0.05 * torch.randn(shape, generator=g)).to(dtype)
    w[3] = 0  # an all-zero block
    w[5, :8] = 1.0  # ties: equal maxima in a block
    q, st = bnbf.quantize_4bit(
        w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
    )
    # Chunks of 97 blocks: the chunking never lines up with the 256-block groups.
    p = quantize_4bit(w, quant_type, blocksize, nested, chunk_blocks=97)
    assert torch.equal(p.packed, q.view(-1))
    assert p.absmax.dtype == st.absmax.dtype and torch.equal(p.absmax, st.absmax)
    if nested:
        assert torch.equal(p.nested_absmax, st.state2.absmax)
        assert torch.equal(p.nested_offset, st.offset)
        assert torch.equal(_bits(p.nested_code), _bits(st.state2.code))
    else:
        assert p.nested_absmax is None
    # Zero signs aside: bitsandbytes' CPU dequantization gives FP4's negative-zero pattern as
    # -0.0 on some machines and +0.0 on others (tests/kernels/test_nf4_gemm.py, ``same_bits``);
    # adding +0.0 turns -0.0 into +0.0 and changes no other value.
    ours, ref = dequantize_4bit(p, dtype) + 0.0, bnbf.dequantize_4bit(q, st) + 0.0
    assert torch.equal(_bits(ours), _bits(ref))


def test_quant_state_json_errors_name_the_field() -> None:
    good = b'{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64]}'
    state = parse_quant_state(good, "nf4")
    assert (state.blocksize, state.shape, state.nested) == (64, (8, 64), False)
    nested = parse_quant_state(
        good[:-1] + b', "nested_blocksize": 256, "nested_offset": 0.5}', "nf4"
    )
    assert nested.nested and nested.offset == 0.5
    for payload, match in [
        (b"{", "not JSON"),
        (good.replace(b"64,", b"48,"), "blocksize 48"),
        (good.replace(b"[8, 64]", b"[512]"), "shape"),
        (good[:-1] + b', "nested_offset": 0.5, "nested_blocksize": 128}', "nested_blocksize"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_quant_state(payload, "nf4")
    with pytest.raises(ValueError, match="quant_type"):
        parse_quant_state(good, "fp4")


@pytest.mark.parametrize("nested", [True, False])
def test_a_slice_dequantizes_to_the_slice_of_the_whole(nested: bool) -> None:
    """A tensor-parallel rank's rows or whole blocks of columns of a quantized matrix, its
    block scales decoded to float32, dequantize bitwise to the same part of the whole."""
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p = quantize_4bit(w, "nf4", 64, nested)
    whole = dequantize_4bit(p, torch.bfloat16)
    rows = slice_4bit(p, 0, 32, 48)
    assert rows.state.shape == (48, 512) and not rows.state.nested
    assert rows.absmax.dtype == torch.float32
    assert torch.equal(dequantize_4bit(rows, torch.bfloat16), whole[32:80])
    cols = slice_4bit(p, 1, 256, 128)
    assert cols.state.shape == (96, 128)
    assert torch.equal(dequantize_4bit(cols, torch.bfloat16), whole[:, 256:384])
    with pytest.raises(ValueError, match="cannot cut"):
        slice_4bit(p, 1, 32, 128)  # through a block
