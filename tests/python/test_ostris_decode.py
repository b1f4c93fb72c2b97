"""OstrisLinear weights layerstream decodes itself (src/torch/ostris_fast.h): AI-Toolkit's uintx and orbit formats,
here in stand-ins written from the formats' description (include/layerstream/ostris_decode.h) in modules named as
AI-Toolkit's are (toolkit/util/uintx_quant.py, orbit_quant.py). The managed layer's output and input gradient
are bitwise those of the backend's own forward, each call's weight is decoded by layerstream (stats()
`ostris_decoded`), and a backend whose own dequantization differs from the decoder's, or one layerstream does
not know, runs its own forward and says so once. test_ostris_backends.py runs AI-Toolkit's real backends
(AI_TOOLKIT_DIR)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from layerstream import manager_modules as mm


def pack_uintx(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Shards of 8, 4, 2, 1 bits (those in `bits`), lowest bits first; a k-bit shard holds code i in byte
    i % nbytes at bit (i // nbytes) * k."""
    flat, out, offset = codes.flatten().to(torch.int32), [], 0
    n = flat.numel()
    for k in (8, 4, 2, 1):
        if bits & k:
            per = 8 // k
            nbytes = -(-n // per)
            part = torch.zeros(per * nbytes, dtype=torch.int32)
            part[:n] = (flat >> offset) & ((1 << k) - 1)
            shard = torch.zeros(nbytes, dtype=torch.int32)
            for j in range(per):
                shard |= part[j * nbytes:(j + 1) * nbytes] << (j * k)
            out.append(shard.to(torch.uint8))
            offset += k
    return torch.cat(out)


def unpack_uintx(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    code, pos, offset = torch.zeros(n, dtype=torch.int32, device=packed.device), 0, 0
    for k in (8, 4, 2, 1):
        if bits & k:
            per = 8 // k
            nbytes = -(-n // per)
            shard = packed[pos:pos + nbytes].to(torch.int32)
            vals = torch.cat([(shard >> (j * k)) & ((1 << k) - 1) for j in range(per)])[:n]
            code |= vals << offset
            pos += nbytes
            offset += k
    return code


def pack_stream(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices of `bits` bits, most significant bit first, padded to a multiple of 8 indices."""
    flat = idx.flatten().to(torch.int64)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)])
    bit = (flat.unsqueeze(1) >> torch.arange(bits - 1, -1, -1)) & 1
    return (bit.view(-1, 8) << torch.arange(7, -1, -1)).sum(1).to(torch.uint8)


def unpack_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    shifts = torch.arange(7, -1, -1, device=packed.device)
    bit = ((packed.to(torch.int64).unsqueeze(1) >> shifts) & 1).view(-1, bits)
    return (bit << torch.arange(bits - 1, -1, -1, device=packed.device)).sum(1)[:n]


class UIntXQuantizer:
    """uintx: per group of `group_size` columns a scale (bytes of the original dtype) and a uint8 zero point."""

    def __init__(self, nbits: int, group_size: int = 64, zero_skew: int = 0):
        self.nbits, self.group_size, self.zero_skew = nbits, group_size, zero_skew

    def quantize_(self, module, weight):
        out_f, in_f = weight.shape
        groups = in_f // self.group_size
        g = torch.Generator().manual_seed(out_f * 7 + in_f)
        q = torch.randint(0, 1 << self.nbits, (out_f, in_f), generator=g)
        zero = torch.randint(0, 1 << self.nbits, (out_f, groups), generator=g)
        scale = (torch.rand(out_f, groups, generator=g) * 0.05 + 1e-3).to(weight.dtype)
        module.register_buffer("uintx_packed", pack_uintx(q, self.nbits), persistent=False)
        module.register_buffer("uintx_scale", scale.contiguous().view(torch.uint8), persistent=False)
        module.register_buffer("uintx_zero_point", zero.to(torch.uint8), persistent=False)

    def _dequantize_native(self, module):
        out_f, in_f = module.out_features, module.in_features
        groups = in_f // self.group_size
        scale = module.uintx_scale.view(module.ostris_orig_dtype)
        q = unpack_uintx(module.uintx_packed, self.nbits, out_f * in_f)
        dq = q.view(out_f, groups, self.group_size).to(scale.dtype)
        dq -= (module.uintx_zero_point.to(torch.int32) + self.zero_skew).to(scale.dtype).view(out_f, groups, 1)
        dq *= scale.view(out_f, groups, 1)
        return dq.view(out_f, in_f)

    def forward(self, module, x):
        with torch.no_grad():
            w = self._dequantize_native(module)
            if w.dtype != x.dtype:
                w = w.to(x.dtype)
        return F.linear(x, w, module.bias)


def rpbh_forward(x, perm, signs, h):
    """The stand-in's rotation of the activations (a signed permutation: the glue calls the backend's own)."""
    return torch.index_select(x, -1, perm) * signs.to(x.dtype)


class OrbitQuantizer:
    """orbit: `bits`-bit indices into a float32 codebook (kept as bytes), one norm per row."""

    def __init__(self, bits: int):
        self.bits = bits

    def quantize_(self, module, weight):
        out_f, in_f = weight.shape
        g = torch.Generator().manual_seed(out_f * 5 + in_f)
        codes = torch.randint(0, 1 << self.bits, (out_f * in_f,), generator=g)
        codebook = torch.randn(1 << self.bits, generator=g) * in_f ** -0.5
        module.register_buffer("orbit_packed", pack_stream(codes, self.bits), persistent=False)
        module.register_buffer("orbit_row_norms", (torch.rand(out_f, generator=g) + 0.5).to(weight.dtype),
                               persistent=False)
        module.register_buffer("orbit_codebook", codebook.view(torch.uint8), persistent=False)
        module.register_buffer("orbit_perm", torch.randperm(in_f, generator=g).to(torch.int32), persistent=False)
        module.register_buffer("orbit_signs", (torch.randint(0, 2, (in_f,), generator=g) * 2 - 1).to(torch.int8),
                               persistent=False)
        module.orbit_bits, module.orbit_block = self.bits, in_f & -in_f

    def _dequantize_rotated(self, module, dtype):
        codes = unpack_stream(module.orbit_packed, module.orbit_bits, module.out_features * module.in_features)
        w = torch.index_select(module.orbit_codebook.view(torch.float32).to(dtype), 0, codes)
        return w.view(module.out_features, module.in_features) * module.orbit_row_norms.to(dtype).unsqueeze(1)

    def forward(self, module, x):
        with torch.no_grad():
            w = self._dequantize_rotated(module, x.dtype)
        return F.linear(rpbh_forward(x, module.orbit_perm, module.orbit_signs, module.orbit_block), w, module.bias)


class OtherQuantizer(UIntXQuantizer):
    """A backend layerstream does not know (another class name), with uintx's buffers."""


# Named as AI-Toolkit's backends are (their helpers, rpbh_forward here, are their forward's globals).
UIntXQuantizer.__module__ = OtherQuantizer.__module__ = "fake_aitk.util.uintx_quant"
OrbitQuantizer.__module__ = "fake_aitk.util.orbit_quant"


class OstrisLinear(torch.nn.Linear):
    """AI-Toolkit's layer as its contract has it: the backend's buffers in _buffers, its forward the backend's."""

    is_ostris_quantized = True

    @property
    def weight(self):  # (AI-Toolkit's dequantizes; nothing here reads it)
        return None

    def forward(self, x):
        return self.ostris_quantizer.forward(self, x)


def quantized(quantizer, in_f=128, out_f=48, bias=True) -> OstrisLinear:
    torch.manual_seed(1)
    lin = torch.nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16).requires_grad_(False)
    quantizer.quantize_(lin, lin.weight)
    del lin._parameters["weight"]
    lin.__class__ = OstrisLinear
    lin.ostris_quantizer, lin.ostris_orig_dtype = quantizer, torch.bfloat16
    return lin


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def _streamed(engine):
    if engine == "cpu":
        pytest.skip("the CPU process device keeps no engine: the layer's own forward runs on its host buffers")


def managed_and_reference(quantizer, device, **kw):
    reference = quantized(quantizer, **kw).to(device)
    layer = quantized(quantizer, **kw)
    mm.OstrisLinearLayerMemoryManager.attach(layer, Manager(device))
    assert layer._layer_memory_manager.path == "ostris"
    return layer, reference


def call_and_grad(layer, x):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("backend", [UIntXQuantizer(3), UIntXQuantizer(4), UIntXQuantizer(8, group_size=32),
                                     OrbitQuantizer(3), OrbitQuantizer(4)],
                         ids=["uint3", "uint4", "uint8", "orbit3", "orbit4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_weight_is_decoded_here_and_the_call_is_the_backends_own(engine, device, backend, dtype):
    _streamed(engine)
    # (a bfloat16 bias beside float32 inputs is refused by F.linear, the backend's call as much as this one)
    layer, reference = managed_and_reference(backend, device, bias=dtype == torch.bfloat16)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    before = mm.stats()["ostris_decoded"]
    for _ in range(2):  # the first call proves the decoder against the backend's own dequantization
        got, got_grad = call_and_grad(layer, x)
        want, want_grad = call_and_grad(reference, x)
        assert got.dtype == dtype and torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert mm.stats()["ostris_decoded"] - before == 2
    assert all(b.device.type == "cpu" for b in layer._buffers.values())  # the host copies are back


def test_a_layer_without_a_bias_and_a_merge_requantized_into_it(engine, device):
    _streamed(engine)
    backend = UIntXQuantizer(4)
    layer, reference = managed_and_reference(backend, device, bias=False)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))
        # A requantize_ replaces the buffers on the host: the next call decodes the new ones.
        for lin in (layer, reference):
            lin.register_buffer("uintx_zero_point", (lin.uintx_zero_point.cpu() + 1).clamp(max=15).to(lin.uintx_zero_point.device),
                                persistent=False)
        before = mm.stats()["ostris_decoded"]
        assert torch.equal(layer(x), reference(x))
        assert mm.stats()["ostris_decoded"] - before == 1


def _info_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "layerstream" and "run their own forward" in r.getMessage()]


def _refused(backend, device, caplog, seed: int) -> list[str]:
    """Two training calls of a managed layer of `backend` are bitwise its own, none decoded here; the INFO
    lines."""
    mm._testing.reset_log_once()
    caplog.set_level(logging.INFO, logger="layerstream")
    layer, reference = managed_and_reference(backend, device)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)
    before = mm.stats()["ostris_decoded"]
    for _ in range(2):
        got, got_grad = call_and_grad(layer, x)
        want, want_grad = call_and_grad(reference, x)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert mm.stats()["ostris_decoded"] == before
    return _info_lines(caplog)


def test_a_backend_whose_dequantization_differs_runs_its_own_forward(engine, device, caplog):
    _streamed(engine)
    # (zero_skew: its codes mean something else than the format says)
    assert _refused(UIntXQuantizer(4, zero_skew=1), device, caplog, 4) == [
        "layerstream: AI-Toolkit's UIntXQuantizer layers run their own forward (its weight decoded by layerstream "
        "differed from its own dequantization); their buffers still stream as stored"]


def _own_forward_only(backend, device, caplog) -> list[str]:
    """A managed layer of `backend` computes as its own forward does, with no call decoded here; the INFO lines."""
    mm._testing.reset_log_once()
    caplog.set_level(logging.INFO, logger="layerstream")
    layer, reference = managed_and_reference(backend, device)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    before = mm.stats()["ostris_decoded"]
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))
    assert mm.stats()["ostris_decoded"] == before
    return _info_lines(caplog)


def test_a_backend_layerstream_does_not_know_runs_its_own_forward(engine, device, caplog):
    _streamed(engine)
    assert _own_forward_only(OtherQuantizer(4), device, caplog) == [
        "layerstream: AI-Toolkit's OtherQuantizer layers run their own forward (a backend layerstream does not "
        "decode); their buffers still stream as stored"]


class WritesItsBuffersQuantizer(UIntXQuantizer):
    """A backend layerstream does not know whose forward writes one of its buffers in place after using it."""

    def forward(self, module, x):
        out = super().forward(module, x)
        module.uintx_zero_point.add_(1)
        return out


WritesItsBuffersQuantizer.__module__ = "fake_aitk.util.uintx_quant"


def test_a_buffer_the_forward_writes_in_place_is_fetched_again(engine, device):
    """A forward that writes its staged buffers changes the device copy only (as under stock, whose copy of each
    call is fresh): the next call computes with the host bytes again, fetched anew, not the written copy left in
    the ring; a forward that writes nothing is served from the ring the second time."""
    _streamed(engine)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(device)
    for backend, writes in ((UIntXQuantizer(4), False), (WritesItsBuffersQuantizer(4), True)):
        layer, _ = managed_and_reference(backend, device)
        host = layer.uintx_zero_point.clone()
        moved, outs = [], []
        with torch.no_grad():
            for _ in range(2):
                before = mm.stats()["bytes_h2d"]
                outs.append(layer(x))
                moved.append(mm.stats()["bytes_h2d"] - before)
        assert torch.equal(outs[0], outs[1]) and torch.equal(layer.uintx_zero_point, host)
        assert moved == [layer._layer_memory_manager.packed_bytes] * 2 if writes else moved[1] == 0


def test_the_switch_turns_the_decoder_off(engine, device, caplog):
    _streamed(engine)
    mm.configure(ostris_decode="0")
    try:
        lines = _own_forward_only(UIntXQuantizer(4), device, caplog)
    finally:
        mm.configure(ostris_decode=None)
    assert lines == ["layerstream: AI-Toolkit's UIntXQuantizer layers run their own forward "
                     "(LAYERSTREAM_OSTRIS_DECODE=0); their buffers still stream as stored"]


# The ConvRot backends whose forward is an int8 matmul: stand-ins written from the layouts ostris_decode.h
# describes (int8 codes, bitfields, base-3) and from the contract the glue relies on: in training the layer's
# output is the backend's `_linear_ste(module, rotate(x).reshape(-1, in), dtype name)`, a straight-through
# estimate whose input gradient is grad @ (_qdata(module).to(t) * _scales(module).to(t)[:, None]). The value
# here is a plain float matmul on that weight (the real ones run torch._int_mm); layerstream must take it as
# the backend computes it and do the backward itself.
from test_int_rows_kernels import pack_bitfield, pack_ternary  # noqa: E402


def rotate(x, rot):
    """The stand-ins' rotation (the glue calls the backend's own): a fixed sign flip of every other block."""
    signs = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device).view(-1, rot)
    signs[1::2] = -1
    return x * signs.view(-1)


def _int8_gemm_supported(device):
    return True  # (the real one asks whether torch._int_mm runs on the device; the stand-ins need none)


class _IntSte(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, codes8, scales, bias, backward_scale):
        ctx.save_for_backward(codes8, scales)
        ctx.backward_scale = backward_scale
        out = x2d.float() @ (codes8.float() * scales.unsqueeze(1)).t()
        return (out if bias is None else out + bias.float()).to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        codes8, scales = ctx.saved_tensors
        w = codes8.to(grad.dtype) * scales.to(grad.dtype).unsqueeze(1)
        return grad @ (w if ctx.backward_scale == 1 else w * ctx.backward_scale), None, None, None, None


class _ConvRotInt:
    """What the three stand-ins share: codes of `bits` bits in [-qmax, qmax], row scales, the training forward."""

    rot = 32

    def __init__(self, bits: int, code_skew: int = 0, backward_scale: float = 1.0):
        self.bits, self.code_skew, self.backward_scale = bits, code_skew, backward_scale

    def _codes(self, out_f, in_f):
        qmax = (1 << (self.bits - 1)) - 1
        g = torch.Generator().manual_seed(out_f * 3 + in_f + self.bits)
        codes = torch.randint(-qmax, qmax + 1, (out_f, in_f), generator=g, dtype=torch.int8)
        return codes, (torch.rand(out_f, generator=g) * 0.02 + 1e-3)

    def _scales(self, module):
        return self._scales_u8(module).view(torch.float32)

    def _linear_ste(self, module, x2d, out_dtype):
        assert getattr(torch, out_dtype) == x2d.dtype
        return _IntSte.apply(x2d, self._qdata(module), self._scales(module), module.bias, self.backward_scale)

    def forward(self, module, x):
        out_f = module.out_features
        if x.requires_grad and _int8_gemm_supported(x.device):
            x2d = rotate(x, self.rot).reshape(-1, module.in_features)
            return self._linear_ste(module, x2d, str(x.dtype).split(".")[-1]).reshape(*x.shape[:-1], out_f)
        with torch.no_grad():
            w = (self._qdata(module).float() * self._scales(module).unsqueeze(1)).to(x.dtype)
        return F.linear(rotate(x, self.rot), w, None if module.bias is None else module.bias.to(x.dtype))


class ConvRotInt8Quantizer(_ConvRotInt):
    def __init__(self, **kw):
        super().__init__(8, **kw)

    def quantize_(self, module, weight):
        codes, scales = self._codes(*weight.shape)
        codes[0, :255] = torch.arange(-127, 128, dtype=torch.int8)[: weight.shape[1]]
        module.register_buffer("cr8_qdata", codes, persistent=False)
        module.register_buffer("cr8_scales", scales.view(torch.uint8), persistent=False)
        module.cr8_rot_size = self.rot

    def _qdata(self, module):
        return module.cr8_qdata + self.code_skew

    def _scales_u8(self, module):
        return module.cr8_scales


class ConvRotIntNQuantizer(_ConvRotInt):
    """Bitfield codes; up to 7 bits with a float32 ratio per row and group of 16 (code8 = rint(code * ratio))."""

    group = 16

    def quantize_(self, module, weight):
        out_f, in_f = weight.shape
        codes, scales = self._codes(out_f, in_f)
        module.register_buffer("crn_qdata", self._pack(codes), persistent=False)
        module.register_buffer("crn_scales", scales.view(torch.uint8), persistent=False)
        if self.bits <= 7:
            g = torch.Generator().manual_seed(out_f + in_f)
            ratio = torch.rand(out_f, in_f // self.group, generator=g) * 4 + 0.5
            ratio.view(-1)[:4] = torch.tensor([0.5, 1.5, 2.5, 200.0])  # ties of the rounding, the clamp
            module.register_buffer("crn_gratio", ratio.view(torch.uint8), persistent=False)
        module.crn_bits, module.crn_rot_size = self.bits, self.rot

    def _pack(self, codes):
        return pack_bitfield(codes, self.bits)

    def _unpack(self, module):
        bits, (out_f, in_f) = module.crn_bits, (module.out_features, module.in_features)
        b = module.crn_qdata.view(out_f, in_f // 8, bits).long()
        word = sum(b[..., i] << (8 * i) for i in range(bits))
        fields = torch.stack([(word >> (bits * j)) & ((1 << bits) - 1) for j in range(8)], dim=-1)
        return fields.view(out_f, in_f) - ((1 << (bits - 1)) - 1)

    def _qdata(self, module):
        codes = self._unpack(module).float()
        ratio = getattr(module, "crn_gratio", None)
        if ratio is not None:
            ratio = ratio.view(torch.float32).repeat_interleave(self.group, dim=1)
            codes = torch.round(codes * ratio).clamp(-127, 127)
        return (codes + self.code_skew).to(torch.int8)

    def _scales_u8(self, module):
        return module.crn_scales


class ConvRotBitNetQuantizer(ConvRotIntNQuantizer):
    """Ternary codes, five per byte in base 3, with the group ratios."""

    def __init__(self, **kw):
        super().__init__(2, **kw)

    def _pack(self, codes):
        return pack_ternary(codes)

    def _unpack(self, module):
        out_f, in_f = module.out_features, module.in_features
        b = module.crn_qdata.long().unsqueeze(-1)
        digits = (b // torch.tensor([1, 3, 9, 27, 81], device=b.device)) % 3
        return digits.view(out_f, -1)[:, :in_f] - 1


for _cls in (ConvRotInt8Quantizer, ConvRotIntNQuantizer, ConvRotBitNetQuantizer):
    _cls.__module__ = "fake_aitk.util.convrot_quant"

INT_BACKENDS = {"convrot8": lambda **kw: ConvRotInt8Quantizer(**kw),
                "convrotint4": lambda **kw: ConvRotIntNQuantizer(4, **kw),
                "convrotint8": lambda **kw: ConvRotIntNQuantizer(8, **kw),
                "convrotbitnet": lambda **kw: ConvRotBitNetQuantizer(**kw)}


def stored_bytes(layer) -> int:
    return sum(b.numel() * b.element_size() for b in layer._buffers.values())


@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant"])
@pytest.mark.parametrize("name", sorted(INT_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int_matmul_backends_train_with_layerstreams_backward(engine, device, name, dtype, checkpointing):
    """Training calls take the backend's own forward value and layerstream's backward (the weight decoded from
    the staged codes, proved on the first call): outputs and input gradients bitwise the unmanaged layer's, with
    and without checkpointing, each training call counted, the codes the backward needs kept past the call
    once per call that builds a graph; inference is the backend's own forward and keeps nothing."""
    _streamed(engine)
    from torch.utils.checkpoint import checkpoint

    layer, reference = managed_and_reference(INT_BACKENDS[name](), device, bias=dtype == torch.bfloat16)
    before = {k: mm.stats()[k] for k in ("ostris_decoded", "ostris_kept_bytes")}
    for seed in (1, 2):
        x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
        results = []
        for lin in (reference, layer):
            xin = x.clone().requires_grad_(True)
            # (a sine after the layer: checkpointing's recomputation stops at the last tensor the backward needs,
            # which is then the sine's input, so the layer's recomputed call runs to its end)
            block = lambda t, lin=lin: torch.sin(lin(t))  # noqa: E731
            out = block(xin) if checkpointing == "none" else checkpoint(block, xin, use_reentrant=False)
            out.float().square().sum().backward()
            results.append((out.detach(), xin.grad))
        (want, want_grad), (got, got_grad) = results
        assert got.dtype == dtype and torch.equal(got, want) and torch.equal(got_grad, want_grad)
    passes = 1 if checkpointing == "none" else 2
    assert mm.stats()["ostris_decoded"] - before["ostris_decoded"] == 2 * passes
    assert mm.stats()["ostris_kept_bytes"] - before["ostris_kept_bytes"] == 2 * stored_bytes(layer)
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))
    assert mm.stats()["ostris_decoded"] - before["ostris_decoded"] == 2 * passes
    assert mm.stats()["ostris_kept_bytes"] - before["ostris_kept_bytes"] == 2 * stored_bytes(layer)


@pytest.mark.parametrize("kind,why", [
    ("code_skew", "its weight decoded by layerstream differed from its own unpacked codes times scales"),
    ("backward_scale", "its own training backward is not the gradient times its decoded weight")])
def test_an_int_matmul_backend_that_is_not_the_format_runs_its_own_forward(engine, device, caplog, kind, why):
    """A backend whose codes mean something else than the layout says, or whose backward is not grad @ weight,
    fails the first call's proof: that call and the next are its own (bitwise its own results), INFO once."""
    _streamed(engine)
    backend = ConvRotIntNQuantizer(4, **{kind: 1 if kind == "code_skew" else 2.0})
    assert _refused(backend, device, caplog, 6) == [
        f"layerstream: AI-Toolkit's ConvRotIntNQuantizer layers run their own forward ({why}); their buffers still "
        "stream as stored"]
