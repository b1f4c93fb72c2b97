"""The decoder behind layerstream's backward for AI-Toolkit's int8-matmul ConvRot layers (convrot8, convrotint2..8,
convrotbitnet, convrotcomfyw4a4; include/layerstream/ostris_decode.h, "int rows"): the weight their training
backward multiplies the gradient by, code8 * scale per row, from int8, bitfield or base-3 codes with optional
group ratios. Checked bit for bit against torch operations written here from the header's formulas, with codes
packed here by the layouts it describes, on the corners: every code of each width, ratios whose products land
exactly on rounding ties or past the int8 clamp, row scales that round to zero, to denormals or overflow in the
output type. The host reference runs in CI, the CUDA kernel on a GPU (the `cuda` cases); test_ostris_backends.py
checks both against AI-Toolkit's own backends (AI_TOOLKIT_DIR)."""

from __future__ import annotations

import pytest
import torch

from layerstream import manager_modules as mm
from test_nvfp4_kernels import DEVICES, same_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def pack_bitfield(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Eight codes along a row per `bits` bytes: one little-endian word, code j at bit j * bits, plus qmax."""
    rows, cols = codes.shape
    fields = (codes.long() + (1 << (bits - 1)) - 1).view(rows, cols // 8, 8)
    word = torch.zeros(rows, cols // 8, dtype=torch.long)
    for j in range(8):
        word |= fields[..., j] << (bits * j)
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(bits)], dim=-1)
    return out.to(torch.uint8).reshape(rows, cols // 8 * bits)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Five codes in {-1, 0, 1} per byte, base 3 (digit j = code + 1, weight 3^j); rows padded to whole bytes."""
    rows, cols = codes.shape
    per = -(-cols // 5)
    digits = torch.zeros(rows, per * 5, dtype=torch.long)
    digits[:, :cols] = codes.long() + 1
    return (digits.view(rows, per, 5) * torch.tensor([1, 3, 9, 27, 81])).sum(-1).to(torch.uint8)


def reference(codes: torch.Tensor, ratio: torch.Tensor | None, scale: torch.Tensor, dtype) -> torch.Tensor:
    c = codes.float()
    if ratio is not None:
        group = codes.shape[1] // ratio.shape[1]
        # (through int8, as the backends hold these codes: a product that rounds to -0 is the integer 0)
        c = torch.round(c * ratio.repeat_interleave(group, dim=1)).clamp(-127, 127).to(torch.int8).float()
    return c.to(dtype) * scale.to(dtype).unsqueeze(1)


def corner_scales(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Row scales: ordinary ones, and ones that in float16 round to zero, to denormals, or overflow times 127."""
    s = torch.rand(rows, generator=gen) * 0.02 + 1e-4
    corners = torch.tensor([1e-9, 3e-7, 6.1e-5, 1.0, 600.0, 6e4, 0.0, 2.0 ** -20])
    s[: len(corners)] = corners
    return s


def corner_ratios(rows: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    """Group ratios: ordinary ones in (0, 1], and ones whose products with small codes are exact halves (ties
    of the rounding to even), inexact thirds, zero, and large enough to clamp at +-127."""
    r = torch.rand(rows, groups, generator=gen) * 0.9 + 0.1
    corners = torch.tensor([0.5, 1.5, 2.5, 0.25, 1.0 / 3.0, 0.0, 200.0, 63.5])
    r.view(-1)[: len(corners)] = corners
    return r


CASES = [("int8", 8, False), ("bitfield", 2, True), ("bitfield", 3, True), ("bitfield", 4, True),
         ("bitfield", 5, True), ("bitfield", 6, True), ("bitfield", 7, True), ("bitfield", 4, False),
         ("bitfield", 8, False), ("ternary", 2, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: NAMES[d])
@pytest.mark.parametrize("codes_kind,bits,grouped", CASES, ids=lambda c: str(c))
def test_weight_is_the_formulas_bit_for_bit(device, dtype, codes_kind, bits, grouped):
    gen = torch.Generator().manual_seed(bits * 7 + grouped)
    rows, cols, group = 24, 160, 32  # (160: ternary rows of 32 whole bytes; 168 below pads)
    qmax = 127 if codes_kind == "int8" else (1 << (bits - 1)) - 1
    codes = torch.randint(-qmax, qmax + 1, (rows, cols), generator=gen, dtype=torch.int8)
    codes[0, : 2 * qmax + 1] = torch.arange(-qmax, qmax + 1, dtype=torch.int8)[:cols]  # every code
    packed = {"int8": lambda: codes.view(torch.uint8), "bitfield": lambda: pack_bitfield(codes, bits),
              "ternary": lambda: pack_ternary(codes)}[codes_kind]()
    ratio = corner_ratios(rows, cols // group, gen) if grouped else None
    scale = corner_scales(rows, gen)
    want = reference(codes, ratio, scale, dtype)
    got = mm._testing.int_rows_decode(packed.to(device), None if ratio is None else ratio.to(device),
                                      scale.to(device), rows, cols, codes_kind, bits, NAMES[dtype])
    assert same_bits(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_ternary_rows_that_pad_to_whole_bytes(device):
    gen = torch.Generator().manual_seed(3)
    rows, cols = 8, 168  # 34 bytes a row, the last holding three codes
    codes = torch.randint(-1, 2, (rows, cols), generator=gen, dtype=torch.int8)
    ratio, scale = corner_ratios(rows, cols // 8, gen), corner_scales(rows, gen)
    got = mm._testing.int_rows_decode(pack_ternary(codes).to(device), ratio.to(device), scale.to(device), rows, cols,
                                      "ternary", 2, "bfloat16")
    assert same_bits(got.cpu(), reference(codes, ratio, scale, torch.bfloat16))


def test_bad_input_is_refused_with_what_to_fix():
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    scale = torch.ones(4)
    with pytest.raises(ValueError, match="'int8', 'bitfield' or 'ternary'"):
        mm._testing.int_rows_decode(codes, None, scale, 4, 16, "nibbles", 4)
    with pytest.raises(ValueError, match="9 bits"):
        mm._testing.int_rows_decode(codes, None, scale, 4, 16, "bitfield", 9)
    with pytest.raises(ValueError, match="multiple of 8"):
        mm._testing.int_rows_decode(codes, None, scale, 4, 12, "bitfield", 4)
    with pytest.raises(ValueError, match="wrong size"):
        mm._testing.int_rows_decode(codes, None, scale, 4, 16, "bitfield", 4)  # 32 bytes of codes, not 64
    with pytest.raises(ValueError, match="12 float32 ratios do not make whole groups of the 4 x 16 rows"):
        mm._testing.int_rows_decode(codes, torch.ones(4, 3), scale, 4, 16, "int8")  # 3 ratios a row
    with pytest.raises(ValueError, match="128 float32 ratios do not make whole groups"):
        mm._testing.int_rows_decode(codes, torch.ones(4, 32), scale, 4, 16, "int8")  # more ratios than values
    with pytest.raises(ValueError, match="wrong size"):
        mm._testing.int_rows_decode(codes, torch.ones(4, 2), torch.ones(3), 4, 16, "int8")  # 3 row scales
