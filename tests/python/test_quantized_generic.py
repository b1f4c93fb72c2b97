"""Tensor-subclass and quantized weights as their libraries run them: nothing crashes, nothing stays on the
device, and outputs are those of the library's own layer (or of its dequantized weight). Kinds layerstream
knows take the fast path (test_quantized.py); others the generic path."""

from __future__ import annotations

import copy

import pytest
import torch

from layerstream import manager_modules as mm


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def _cpu_only(engine):
    if engine == "cuda":
        pytest.skip("the CUDA variant runs in the GPU suite of the quantization issue")


def test_torchao_float8_weight_only_linear(engine, device):
    _cpu_only(engine)
    quant = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    quant.quantize_(model, quant.Float8WeightOnlyConfig())
    layer = model[0]
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight.dequantize().to(torch.bfloat16), layer.bias)
    library = layer(x)
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    assert layer._layer_memory_manager.path == "quantized"  # the fast path (test_quantized.py)
    assert layer.weight.device.type == "cpu"
    out = layer(x)
    assert torch.equal(out, expected)
    assert torch.allclose(out.float(), library.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_optimum_quanto_qlinear_matches_the_library(engine, device, qtype):
    _cpu_only(engine)
    quanto = pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed")
    torch.manual_seed(1)
    # in_features a multiple of 16: quanto's CPU int8 kernels crash on other widths with bf16 inputs.
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)  # the library's own QLinear forward (quantized models cannot be deep-copied)
    for layer in (model[0], model[2]):
        assert type(layer).__name__ == "QLinear"
        mm.LinearLayerMemoryManager.attach(layer, Manager(device))
        assert layer._layer_memory_manager.path == "quantized"
        assert layer.weight.device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_integer_weights_compute_in_the_input_dtype(engine, device):
    _cpu_only(engine)
    layer = torch.nn.Linear(8, 4, bias=False)
    layer.weight = torch.nn.Parameter(torch.randint(-5, 5, (4, 8), dtype=torch.int8), requires_grad=False)
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    # Plain integer tensors are packed as stored (one byte per weight over the bus) ...
    assert layer._layer_memory_manager.path == ("cpu" if engine == "cpu" else "streamed")
    assert layer._layer_memory_manager.packed_bytes == 32
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    # ... and cast to the compute dtype where they are used: bfloat16 inputs compute in bfloat16.
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight.to(torch.bfloat16)))


def test_conv_with_string_padding_takes_the_generic_path(engine, device):
    torch.manual_seed(2)
    ref = torch.nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect").to(device)
    layer = copy.deepcopy(ref).cpu()
    mm.ConvLayerMemoryManager.attach(layer, Manager(device))
    assert layer._layer_memory_manager.path == "generic"
    assert layer.weight.device.type == "cpu"
    x = torch.randn(1, 3, 8, 8, device=device)
    assert torch.equal(layer(x), ref(x))


class OstrisLinear(torch.nn.Linear):
    """A stand-in for AI-Toolkit's quantized linear, written here from its contract: the weight is a
    property that dequantizes the int8 data and scale kept in _buffers; forward uses the quantizer."""

    is_ostris_quantized = True

    def __init__(self, src: torch.nn.Linear):
        super().__init__(src.in_features, src.out_features)
        del self._parameters["weight"]
        scale = src.weight.detach().abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("qdata", (src.weight.detach() / scale).round().to(torch.int8), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = torch.nn.Parameter(src.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self):
        return self.qdata.to(self.scale.dtype) * self.scale

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def test_ostris_linear_buffers_go_home_and_forward_is_unchanged(engine, device):
    torch.manual_seed(3)
    layer = OstrisLinear(torch.nn.Linear(16, 8))
    x = torch.randn(2, 16)
    if engine == "cuda":
        layer = layer.to(device)
    expected = layer(x.to(device)).cpu()  # computed where the managed call computes: CPU and GPU GEMMs differ
    mm.OstrisLinearLayerMemoryManager.attach(layer, Manager(device))
    assert layer._layer_memory_manager.path == "ostris"
    assert all(b.device.type == "cpu" for b in layer._buffers.values())
    assert layer.bias.device.type == "cpu"
    out = layer(x.to(device))
    assert torch.equal(out.cpu(), expected)
    assert all(b.device.type == "cpu" for b in layer._buffers.values())  # put back after the call
