"""The nvfp4 kernels behind AI-Toolkit's nvfp4 and convrot4 layers (include/layerstream/ostris_decode.h): the weight
decode, and convrot4's straight-through activation (quantized to nvfp4 with per-16 amax scales and back). Each is
checked bit for bit against torch operations written here from the formulas in that header, on inputs chosen for
the corners: every magnitude from denormal block scales up, values that land exactly on the e2m1 edges, zeros of
both signs, whole blocks of zeros. The host references run in CI; the CUDA kernels on a GPU (the `cuda` cases).
test_ostris_backends.py checks both against AI-Toolkit's own backends (AI_TOOLKIT_DIR)."""

from __future__ import annotations

import pytest
import torch

from layerstream import manager_modules as mm

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
EDGES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def reference_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pts, x_dq - x) by the header's formulas, in torch operations."""
    rows, cols = x.shape
    xf = x.float()
    pts = xf.abs().amax() / 2688.0
    pts = torch.where(pts > 0, pts, torch.ones_like(pts))
    blocks = xf.view(rows, cols // 16, 16)
    scale = (blocks.abs().amax(-1) / (6.0 * pts)).to(torch.float8_e4m3fn)
    q = (scale.float() * pts).unsqueeze(-1)
    safe = torch.where(q > 0, q, torch.ones_like(q))
    z = (blocks / safe).clamp(-6.0, 6.0)
    idx = torch.bucketize(z.abs(), torch.tensor(EDGES, device=x.device))
    v = torch.tensor(E2M1, device=x.device)[idx] * torch.where(z < 0, -1.0, 1.0)
    x_dq = (v * q).view(rows, cols).to(x.dtype)
    return pts, x_dq - x


def reference_weight(packed, scales, pts, rows, cols, dtype, plus_zero=False):
    """The header's formula; code 8 is -0 (AI-Toolkit's torch path), or +0 with plus_zero (its Triton kernel)."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(rows, cols).long()
    v = torch.tensor(E2M1, device=packed.device)[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    if plus_zero:
        v = torch.where(codes == 8, torch.zeros_like(v), v)
    sp = scales.view(torch.float8_e4m3fn).float() * pts.view(torch.float32)
    return (v.view(rows, cols // 16, 16) * sp.unsqueeze(-1)).view(rows, cols).to(dtype)


def corner_activations(dtype, seed: int, top: float | None) -> torch.Tensor:
    """[96, 128]: each block of 16 at a magnitude of its own (2^-40 .. 2^12, or 2^8 under `top`; from 2^-24 in float16), three
    significant bits, a sign each, some zeros and some blocks all zero; `top` is the largest magnitude."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 96, 128
    blocks = rows * cols // 16
    lo = -24 if dtype == torch.float16 else -40
    exp = torch.randint(lo, 9 if top is not None else 13, (blocks, 1), generator=g).expand(blocks, 16)
    mant = 1.0 + torch.randint(0, 8, (blocks, 16), generator=g).float() / 8.0
    x = torch.ldexp(mant, exp.float())
    x = torch.where(torch.rand(blocks, 16, generator=g) < 0.5, -x, x)
    x[torch.rand(blocks, 16, generator=g) < 0.1] = 0.0
    x[torch.rand(blocks, generator=g) < 0.05] = 0.0
    x[3, 5] = -0.0
    if top is not None:
        x[0, 0] = top
    return x.view(rows, cols).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", ["randn", "corners", "corners-2688", "corners-937", "zeros", "one-value"])
def test_activation_is_the_formulas_bit_for_bit(device, dtype, case):
    g = torch.Generator().manual_seed(7)
    if case == "randn":
        x = (torch.randn(64, 256, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)).to(dtype)
    elif case.startswith("corners"):
        top = None if case == "corners" else float(case.split("-")[1])
        x = corner_activations(dtype, {"corners": 1, "corners-2688": 2, "corners-937": 3}[case], top)
    elif case == "zeros":
        x = torch.zeros(4, 32, dtype=dtype)
    else:
        x = torch.zeros(2, 16, dtype=dtype)
        x[1, 7] = -3.25
    x = x.to(device)
    pts, delta = mm._testing.nvfp4_fake_quantize(x)
    want_pts, want_delta = reference_activation(x)
    assert same_bits(pts, want_pts.reshape(()))
    assert same_bits(delta, want_delta)
    assert delta.device == x.device
    # The straight-through activation the layer computes, x + delta, is the quantized value itself.
    assert torch.equal(x + delta, reference_activation(x)[1] + x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("plus_zero", [False, True], ids=["minus-zero", "plus-zero"])
def test_weight_is_the_formulas_bit_for_bit(device, dtype, plus_zero):
    g = torch.Generator().manual_seed(11)
    rows, cols = 40, 96
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7f, (rows, cols // 16), generator=g, dtype=torch.uint8)  # positive, no NaN
    scales[0, :3] = torch.tensor([0, 1, 7], dtype=torch.uint8)  # a zero scale and two denormal ones
    pts = torch.tensor([0.00123], dtype=torch.float32).view(torch.uint8)
    packed, scales, pts = packed.to(device), scales.to(device), pts.to(device)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    packed[1, :4] = torch.tensor([0x08, 0x80, 0x88, 0x98], dtype=torch.uint8)  # code 8 (a signed zero) in both nibbles
    w = mm._testing.nvfp4_decode(packed, scales, pts, rows, cols, name, plus_zero=plus_zero)
    assert w.device == packed.device
    want = reference_weight(packed, scales, pts, rows, cols, dtype, plus_zero)
    assert same_bits(w, want)
    assert torch.signbit(w[1, :7]).tolist() == [not plus_zero, False, False, not plus_zero, not plus_zero,
                                                not plus_zero, not plus_zero]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="cols a multiple of 16"):
        mm._testing.nvfp4_fake_quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="not nvfp4's"):
        mm._testing.nvfp4_decode(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8),
                                 torch.zeros(4, dtype=torch.uint8), 4, 32)
