"""A managed layer refuses what torch refuses. An input of a dtype no layer computes in (complex, integer,
bool) gets torch's own error, the one the unmanaged layer and AI-Toolkit's stock manager give (its float path
casts nothing); layerstream used to cast it to bfloat16, so that a complex input silently lost its imaginary
part."""

from __future__ import annotations

import pytest
import torch

from layerstream import manager_modules as mm


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_an_input_torch_refuses_gets_torchs_error(engine, device, dtype, kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    else:
        layer, x = torch.nn.Conv2d(2, 3, 3), torch.randn(1, 2, 5, 5)
    layer = layer.to(device)
    x = x.to(device=device, dtype=dtype)
    with pytest.raises(Exception) as unmanaged:
        layer(x)
    manager = mm.LinearLayerMemoryManager if kind == "linear" else mm.ConvLayerMemoryManager
    manager.attach(layer, Manager(device))
    with pytest.raises(type(unmanaged.value)) as managed:
        layer(x)
    assert str(managed.value).splitlines()[0] == str(unmanaged.value).splitlines()[0]
    # A float input still computes, in its own dtype.
    assert layer(x.real.float() if dtype.is_complex else x.float()).dtype == torch.float32
