"""bitsandbytes 4-bit (Linear4bit, nf4 and fp4), streamed as stored: the packed 4-bit codes and the quant_state's
tensors (absmax, the code table, and for nested statistics the offset and a second absmax and table) live in the
pinned arena at their stored size, cross the bus as stored, and bitsandbytes' own forward runs on the staged
copies (it decodes them). Outputs and input gradients are bitwise those of the same module run unmanaged.

Before this form was added, main took a Linear4bit down the generic path (moved as stored, "dequantized by its
library": INFO "weights of type bitsandbytes.nn.modules.Params4bit, dtype torch.uint8 take the generic path"). A
Params4bit has no dequantize() of its own (torch's leaves the codes as they are), so that path cast the packed uint8 codes ([out * in / 2, 1]) to the compute dtype
and called F.linear with them: the layer's first call raised (with Linear4bit's default float32 bias: "self and
mat2 must have the same dtype, but got Float and BFloat16"; test_main_before keeps what that path does).

On the host (cpu and sim engines) bitsandbytes' CPU 4-bit kernels compute; the cuda engine case runs its CUDA
kernels (a GPU run of this file is the integrator's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerstream import manager_modules as mm

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


def _linear4bit(quant_type: str, nested: bool, bias: bool, compute: torch.dtype, device, seed: int = 0):
    """A frozen Linear4bit of fixed weights, quantized where it is placed (the host, or the GPU)."""
    torch.manual_seed(seed)
    dense = torch.nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(256, 96, bias=bias, compute_dtype=compute, compress_statistics=nested,
                              quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, compress_statistics=nested,
                                     quant_type=quant_type)
    if bias:
        layer.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    layer = layer.to(device)
    # bitsandbytes repacks a weight for its AVX512-BF16 CPU kernel at the first inference call, in place; the
    # managed and unmanaged layers both keep the portable layout (the GPU never repacks).
    layer.support_avx512bf16_for_cpu = False
    return layer.requires_grad_(False)


def _stored(layer) -> list[torch.Tensor]:
    """What a Linear4bit stores, in block order: the codes, the quant_state's tensors, then the bias."""
    qs = layer.weight.quant_state
    out = [layer.weight.data, qs.absmax, qs.code]
    if qs.nested:
        out += [qs.offset, qs.state2.absmax, qs.state2.code]
    return out + ([] if layer.bias is None else [layer.bias.data])


def _block_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        total = _align(total) + t.numel() * t.element_size()
    return total


def _run(layer, x, train: bool):
    x = x.detach().clone().requires_grad_(train)
    out = layer(x)
    if not train:
        return out.detach(), None
    out.float().square().sum().backward()
    mm.sync_grad_transfers()
    return out.detach(), x.grad


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "grad_input"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_linear4bit_streams_as_stored_and_computes_bitwise(engine, device, quant_type, nested, bias, train):
    compute = torch.bfloat16
    reference = _linear4bit(quant_type, nested, bias, compute, device)
    layer = _linear4bit(quant_type, nested, bias, compute, device)
    x = torch.randn(7, 256, dtype=torch.bfloat16, device=device)
    expected = [_run(reference, x, train) for _ in range(2)]
    stored_bytes = _block_bytes(_stored(layer))
    codes_bytes = layer.weight.numel()
    assert layer.weight.dtype == torch.uint8 and codes_bytes == 96 * 256 // 2

    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    lmm = layer._layer_memory_manager
    assert (lmm.path, lmm.form) == ("bnb-4bit", "bnb-4bit")
    # One block: the codes at their stored size (half a byte a value), the statistics, the bias.
    assert lmm.packed_bytes == stored_bytes
    assert all(t.device.type == "cpu" for t in _stored(layer))
    if engine == "cuda":
        assert layer.weight.data.is_pinned()
    moved = mm.stats()["bytes_h2d"]
    got = [_run(layer, x, train) for _ in range(2)]
    if engine == "sim":
        assert mm.stats()["bytes_h2d"] - moved >= stored_bytes  # the block crossed the (simulated) bus
    for (g_out, g_grad), (e_out, e_grad) in zip(got, expected):
        assert g_out.device == e_out.device and torch.equal(g_out, e_out)
        if train:
            assert torch.equal(g_grad, e_grad)
    # After the call the layer holds its host views again (nothing of the device copy stays in it).
    assert all(t.device.type == "cpu" for t in _stored(layer))


def test_a_requantized_weight_is_packed_again(engine, device):
    """A Linear4bit given a new Params4bit after attach (a reload, a re-quantization) is packed again: the next
    call computes with the new codes, bitwise as the unmanaged layer with them."""
    layer = _linear4bit("nf4", True, True, torch.bfloat16, device, seed=0)
    bias = layer.bias.detach().clone()
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=device)
    layer(x)
    fresh = _linear4bit("nf4", True, True, torch.bfloat16, device, seed=1)
    reference = _linear4bit("nf4", True, True, torch.bfloat16, device, seed=1)
    reference.bias = torch.nn.Parameter(bias, requires_grad=False)  # the managed layer keeps its bias
    layer.weight = fresh.weight
    assert torch.equal(layer(x), reference(x))
    assert layer._layer_memory_manager.packed_bytes == _block_bytes(_stored(layer))


def test_main_before():
    """What the generic path (main's for a Linear4bit) makes of one, step by step as it did: the weight moved as
    stored, torch's Tensor.dequantize() (which leaves the packed codes as they are: Params4bit has no dequantize
    of its own), the codes cast to the compute dtype, then F.linear, which refuses them."""
    layer = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.bfloat16).to("cpu")  # the default: a float32 bias
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = layer.weight.to(torch.device("cpu"), non_blocking=True)
    assert w.dtype == torch.uint8 and w.shape == (64 * 32 // 2, 1)
    w = w.dequantize().to(torch.bfloat16)
    b = layer.bias.to(torch.device("cpu"), non_blocking=True)
    with pytest.raises(RuntimeError, match="^self and mat2 must have the same dtype, but got Float and BFloat16$"):
        F.linear(x, w, b)
