"""LAYERSTREAM_HOST_DTYPE=lossless keeps a frozen bfloat16 weight's host copy as its packed bytes only:
its Parameter (the same object) becomes a PackedWeight (layerstream/packed_weight.py) that has no storage
and decodes the exact values for whatever reads it. Every path that reads the weight sees them bit for bit
(state_dict, torch.save/load, .data, clone, deepcopy, unfreeze then train, a write, detach, free); outputs
and gradients are the unmanaged model's; the host holds the packed bytes and nothing else."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from conftest import clear_device_states
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from layerstream.packed_weight import PackedWeight
from masters import Masters
from models import TinyTransformer


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def _packed_size(w: torch.Tensor) -> int:
    """lossless.h's encoded size (see test_lossless.packed_bytes)."""
    n = w.numel()
    exponents = ((w.detach().contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF).flatten()
    counts = torch.bincount(exponents, minlength=256).sort(descending=True, stable=True).values
    return _align(n, 16) + _align((n + 1) // 2, 16) + 8 * (n - int(counts[:15].sum()))


@pytest.fixture
def lossless(engine, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    clear_device_states()
    return engine


def _model(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyTransformer(d=64, ff=192, layers=2).to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _host_counts():
    s = mm.stats()
    return s["host_pinned_packed_bytes"], s["host_pinned_plain_bytes"], s["host_pageable_bytes"]


def test_the_parameter_holds_only_the_packed_bytes(lossless, device):
    model = _model()
    reference = copy.deepcopy(model)
    params = {id(m): m.weight for m in _linears(model)}
    before = _host_counts()
    ContractManager.attach(mm, model, device).to_device()
    packed = plain = 0
    for m in _linears(model):
        w = m.weight
        assert w is params[id(m)]  # the same Parameter object
        assert type(w) is PackedWeight and isinstance(w, torch.nn.Parameter) and not w.requires_grad
        assert (w.shape, w.dtype, w.device) == ((m.out_features, m.in_features), torch.bfloat16, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="invalid python storage"):  # no storage behind the Parameter
            w.untyped_storage().data_ptr()
        assert m._layer_memory_manager.stored_as == "lossless BFloat16"
        ref = dict(reference.named_modules())[next(n for n, x in model.named_modules() if x is m)]
        size = _packed_size(ref.weight)
        packed += size
        assert m._layer_memory_manager.packed_bytes == (_align(size) + 2 * m.bias.numel() if m.bias is not None else size)
        plain += m._layer_memory_manager.packed_bytes - size
    # The counters: the packed weights, the biases as they are, no pageable copy (the simulator's and the
    # CPU mode's arena are pinned host memory of the backend).
    assert tuple(a - b for a, b in zip(_host_counts(), before)) == (packed, plain, 0)
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16, device=device)
        assert torch.equal(model(x), reference.to(device)(x))


def test_every_read_sees_the_exact_values(lossless, device):
    model = _model()
    reference = copy.deepcopy(model)
    ContractManager.attach(mm, model, device).to_device()
    lin, ref = _linears(model)[0], _linears(reference)[0]
    w, exact = lin.weight, ref.weight.detach()
    assert type(w) is PackedWeight
    assert torch.equal(w, exact) and torch.equal(w.data, exact) and torch.equal(w.detach(), exact)
    assert type(w.clone()) is torch.Tensor and torch.equal(w.clone(), exact)
    assert torch.equal(w.to(torch.float32), exact.float()) and torch.equal(w * 2, exact * 2)
    assert torch.equal(w.t(), exact.t()) and torch.equal(w[3], exact[3]) and w.sum().item() == exact.sum().item()
    assert torch.equal(torch.nn.functional.linear(torch.ones(3, w.shape[1], dtype=torch.bfloat16), w),
                       torch.nn.functional.linear(torch.ones(3, w.shape[1], dtype=torch.bfloat16), exact))
    assert repr(w).startswith("PackedWeight(tensor(")
    # state_dict: the values, decoded on demand (the dict holds PackedWeights); saving writes plain tensors.
    sd, ref_sd = model.state_dict(), reference.state_dict()
    # (On CUDA the unmanaged norm sits on the device, the managed weights on the host: compared on the host.)
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k].cpu(), ref_sd[k]) for k in sd)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()))  # weights_only: plain tensors
    assert all(type(loaded[k]) is torch.Tensor and torch.equal(loaded[k].cpu(), ref_sd[k]) for k in ref_sd)
    clone = copy.deepcopy(lin.weight)
    assert type(clone) is torch.nn.Parameter and torch.equal(clone, exact)
    # Reads leave it packed: nothing decoded stays.
    assert type(lin.weight) is PackedWeight and lin.weight._ls_packed.plain is None


def test_a_checkpoint_loaded_into_the_managed_model_is_packed_again(lossless, device):
    model = _model()
    other = _model(seed=9)
    ContractManager.attach(mm, model, device).to_device()
    model.load_state_dict(other.state_dict())  # copy_ into every Parameter: a write
    lin = _linears(model)[0]
    assert type(lin.weight) is PackedWeight and lin.weight._ls_packed.plain is not None
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16, device=device)
        assert torch.equal(model(x), other.to(device)(x))
    for m, o in zip(_linears(model), _linears(other)):  # packed again at the use: no plain copy left
        assert type(m.weight) is PackedWeight and m.weight._ls_packed.plain is None
        assert torch.equal(m.weight, o.weight.cpu())


@pytest.mark.parametrize("how", ["copy_", "data", "inplace", "setitem"])
def test_a_write_into_the_weight_is_seen_and_packed_again(lossless, device, how):
    torch.manual_seed(4)
    layer = torch.nn.Linear(48, 32).to(torch.bfloat16).requires_grad_(False)
    mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
    param = layer.weight
    new = (torch.randn(32, 48) * 0.1).to(torch.bfloat16)
    expected = layer.weight.detach().clone()
    with torch.no_grad():
        if how == "copy_":
            layer.weight.copy_(new)
            expected = new
        elif how == "data":
            layer.weight.data.copy_(new)
            expected = new
        elif how == "inplace":
            layer.weight.mul_(0.5)
            expected = expected * 0.5
        else:
            layer.weight[1:3] = 0
            expected[1:3] = 0
    assert torch.equal(layer.weight, expected)
    x = torch.randn(3, 48, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, expected.to(device), layer.bias.to(device)))
    assert layer.weight is param and type(param) is PackedWeight and param._ls_packed.plain is None
    assert torch.equal(param, expected)


def test_unfrozen_it_trains_bitwise_as_the_unmanaged_layer(lossless, device):
    torch.manual_seed(5)
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    reference = copy.deepcopy(layer).to(device)
    mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
    param = layer.weight
    assert type(param) is PackedWeight
    opt = torch.optim.SGD([param, layer.bias], lr=0.01)  # holds the Parameter objects
    layer.requires_grad_(True)
    reference.requires_grad_(True)
    # The reference steps host masters where the managed layer keeps its Parameters (on CUDA: the host; an
    # optimizer is not bitwise the same on the two devices), masters.py.
    masters = Masters(list(reference.parameters()), [param, layer.bias])
    ref_opt = torch.optim.SGD(masters.masters, lr=0.01)
    for step in range(3):
        x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
        out, ref = layer(x), reference(x)
        assert torch.equal(out, ref), step
        out.float().square().mean().backward()
        ref.float().square().mean().backward()
        mm.sync_grad_transfers()
        assert layer.weight is param and type(param) is torch.nn.Parameter  # plain again, same object
        assert torch.equal(param.grad.to(device), reference.weight.grad)
        opt.step()
        masters.grads_to_masters()
        ref_opt.step()
        masters.masters_to_params()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert torch.equal(param.to(device), reference.weight)
    layer.requires_grad_(False)  # frozen again: packed again, from the trained values
    with torch.no_grad():
        x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
        assert torch.equal(layer(x), reference(x))
    assert type(param) is PackedWeight and torch.equal(param.to(device), reference.weight)


def test_outputs_and_input_gradients_are_the_unmanaged_models(lossless, device):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ContractManager.attach(mm, model, device).to_device()
    for _ in range(2):
        x = torch.randn(2, 6, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        out, ref = model(x), reference(xr)
        assert torch.equal(out, ref)
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        mm.sync_grad_transfers()
        assert torch.equal(x.grad, xr.grad)
    assert all(type(m.weight) is PackedWeight for m in _linears(model))


def test_detach_gives_plain_exact_weights_and_free_releases_everything(lossless, device):
    gc.collect()
    before = mm.stats()["host_bytes_requested"], _host_counts()
    model = _model()
    reference = copy.deepcopy(model)
    manager = ContractManager.attach(mm, model, device)
    manager.to_device()
    assert _host_counts()[0] > 0
    manager.detach()
    for m, r in zip(_linears(model), _linears(reference)):
        assert type(m.weight) is torch.nn.Parameter and not m.weight.is_pinned()
        assert torch.equal(m.weight, r.weight)
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
        assert torch.equal(model.cpu()(x), reference(x))

    model2 = _model()
    manager2 = ContractManager.attach(mm, model2, device)
    manager2.to_device()
    manager2.free()
    assert all(m.weight.is_meta for m in _linears(model2))
    del model, manager, model2, manager2, m, r
    clear_device_states()
    gc.collect()
    assert (mm.stats()["host_bytes_requested"], _host_counts()) == before


def test_doctor_checks_the_ram_for_the_weights_in_the_chosen_form(monkeypatch):
    from layerstream import doctor

    GiB = doctor.GiB
    monkeypatch.setattr(doctor, "host_ram", lambda: (64 * GiB, 60 * GiB))
    # FLUX.2's 60 GiB of bf16 weights on a 64 GiB machine: as they are they do not fit; packed they do.
    same = doctor._host_ram_line(60, "same")
    assert same.verdict == "FAIL"
    assert "need about 66.0 GiB (1x the weights plus 10%)" in same.detail
    assert "LAYERSTREAM_HOST_DTYPE=lossless (exact) would need about 50.2 GiB, which is available" in same.detail
    packed = doctor._host_ram_line(60, "lossless")
    assert packed.verdict == "OK" and "LAYERSTREAM_HOST_DTYPE=lossless, need about 50.2 GiB (0.76x" in packed.detail
    tight = doctor._host_ram_line(75, "lossless")  # 62.7 GiB: more than available, less than the total
    assert tight.verdict == "WARN" and "do not fit in the RAM available" in tight.detail
    assert doctor._host_ram_line(60, "float8_e4m3fn").verdict == "FAIL"  # 1.5x: float8 keeps the exact copy too
    # auto, the default: checked as they are (at most), the packed form named and suggested
    automatic = doctor._host_ram_line(60, "auto")
    assert automatic.verdict == "FAIL" and "as they are at most (LAYERSTREAM_HOST_DTYPE=auto packs" in automatic.detail
    assert "LAYERSTREAM_HOST_DTYPE=lossless (exact) would need about 50.2 GiB, which is available" in automatic.detail
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "fp8")  # not a form: checked as the default
    assert doctor.chosen_host_dtype() == "auto"
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    assert doctor.chosen_host_dtype() == "lossless"
    with pytest.raises(ValueError, match="--host-dtype must be one of same, lossless"):
        doctor.run(weights_gb=1, host_dtype="fp8")


def test_copying_a_weight_into_itself_and_assigning_data_keep_the_values(lossless, device):
    torch.manual_seed(8)
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16).requires_grad_(False)
    exact = layer.weight.detach().clone()
    mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
    w = layer.weight
    with torch.no_grad():
        w.copy_(w.data)  # its own values, through an alias of the same packed bytes
    assert torch.equal(w, exact)
    replacement = (torch.randn(16, 32) * 0.1).to(torch.bfloat16)
    w.data = replacement  # set_data, as nn.Module._apply and loaders do
    assert torch.equal(w, replacement) and w.data_ptr() == replacement.data_ptr()
    x = torch.randn(3, 32, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, replacement.to(device), layer.bias.to(device)))
    assert layer.weight is w and type(w) is PackedWeight and torch.equal(w, replacement)


@pytest.mark.parametrize("how", ["dtype", "host", "alias"])
def test_a_move_that_changes_nothing_decodes_nothing_and_keeps_it_packed(lossless, device, monkeypatch, how):
    """AI-Toolkit moves its models to their own dtype around every sample (its manager's to() calls the model's
    original to(dtype=...)): nn.Module._apply then assigns each weight to its own .data. That must leave the
    weight packed, decode nothing and give the layer nothing to pack again; the outputs stay the unmanaged
    model's."""
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ContractManager.attach(mm, model, device).to_device()
    weights = [m.weight for m in _linears(model)]
    writes = [w._ls_packed.writes for w in weights]
    decoded = []
    unpack = mm._packed.unpack
    monkeypatch.setattr(mm._packed, "unpack", lambda *a: decoded.append(a[2]) or unpack(*a))
    if how == "dtype":
        torch.nn.Module.to(model, dtype=torch.bfloat16)
    elif how == "host":
        for m in _linears(model):
            torch.nn.Module.to(m, "cpu")
    else:
        for w in weights:
            w.data = w.data
    assert decoded == []
    assert all(type(w) is PackedWeight and w._ls_packed.plain is None for w in weights)
    assert [w._ls_packed.writes for w in weights] == writes
    assert [m.weight for m in _linears(model)] == weights
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16, device=device)
        assert torch.equal(model(x), reference(x))
    assert decoded == [] and all(w._ls_packed.plain is None for w in weights)


def test_a_model_detached_then_attached_without_lossless_is_stored_plain(lossless, device, monkeypatch):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    manager = ContractManager.attach(mm, model, device)
    manager.to_device()
    manager.detach()
    # Upstream's detach leaves the old Parameter in _parameters behind the plain clone it sets.
    assert all(type(m._parameters["weight"]) is PackedWeight for m in _linears(model))
    monkeypatch.delenv("LAYERSTREAM_HOST_DTYPE")
    clear_device_states()
    ContractManager.attach(mm, model, device).to_device()
    assert all(type(m._parameters["weight"]) is torch.nn.Parameter for m in _linears(model))
    assert {m._layer_memory_manager.stored_as for m in _linears(model)} == {"BFloat16"}
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16, device=device)
        assert torch.equal(model(x), reference(x))


def test_a_layer_given_another_layers_packed_weight_computes_with_its_values(lossless, device, monkeypatch):
    torch.manual_seed(9)
    a = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
    exact = a.weight.detach().clone()
    mm.LinearLayerMemoryManager.attach(a, ContractManager(mm, a, device))
    b = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    b.weight = a.weight  # one Parameter, two layers (tied); b is stored without lossless
    monkeypatch.delenv("LAYERSTREAM_HOST_DTYPE")
    clear_device_states()
    mm.LinearLayerMemoryManager.attach(b, ContractManager(mm, b, device))
    x = torch.randn(3, 32, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        assert torch.equal(b(x), torch.nn.functional.linear(x, exact.to(device)))
        assert torch.equal(a(x), torch.nn.functional.linear(x, exact.to(device)))
    assert type(a.weight) is PackedWeight and b.weight is a.weight
    assert a.weight._ls_packed.plain is None  # b's attach could not make it plain, and left it packed


def test_float8_counts_the_plain_copy_its_parameter_keeps_as_pageable(engine, device, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "float8_e4m3fn")
    clear_device_states()
    before = _host_counts()
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
    assert type(layer.weight) is torch.nn.Parameter  # float8 is not exact: the Parameter keeps its values
    codes, scale, bias = 32 * 64, 32 * 4, 32 * 2  # float8 codes, a float32 scale per row, the bf16 bias
    packed = _align(codes) + scale
    assert layer._layer_memory_manager.packed_bytes == _align(packed) + bias
    # Packed: the codes and the scale up to the bias's alignment; plain: the bias; pageable: the Parameter.
    assert tuple(a - b for a, b in zip(_host_counts(), before)) == (_align(packed), bias, layer.weight.nbytes)
