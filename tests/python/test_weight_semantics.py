"""What a trainer does to managed weights beyond a LoRA step (issue 24, items 3-6): writes through ``.data``
(AI-Toolkit's EMA swap), double backward (a gradient penalty), a weight replaced between a forward and its
backward, unbatched conv input, tied weights, inference tensors, and the VRAM budget under a full fine-tune.
Outputs and gradients are compared bitwise with the unmanaged model."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch

from conftest import aitk_dirs, clear_device_states, deterministic_cudnn
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management
from masters import Masters
from models import TinyTransformer
from test_manager_contract import _steps

DIRS = aitk_dirs()


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def attached(model, device):
    ContractManager.attach(mm, model, device).to_device()
    return model


def mlp(width=64, depth=3):
    torch.manual_seed(4)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


# ---- item 3: writes through .data ----------------------------------------------------------------------

def _import_ema(aitk_dir):
    """AI-Toolkit's own ExponentialMovingAverage, from the checkout."""
    for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
        del sys.modules[name]  # another checkout's toolkit may be loaded
    sys.path.insert(0, aitk_dir)
    try:
        return importlib.import_module("toolkit.ema").ExponentialMovingAverage
    finally:
        sys.path.remove(aitk_dir)


def _ema_run(model, ema_cls, device, masters):
    """AI-Toolkit's loop with an EMA: step, ema.update(); before sampling ema.eval() (store, then copy_to:
    p.data.copy_), sample twice under no_grad; ema.train() (restore: p.data.copy_); every output recorded.
    The optimizer and the EMA act on `masters` (masters.py: where the managed model keeps its Parameters;
    for the managed model, the Parameters themselves)."""
    opt = torch.optim.AdamW(masters.masters, lr=1e-2)
    ema = ema_cls(masters.masters, decay=0.5)
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        x = torch.randn(4, 64, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        mm.sync_grad_transfers()
        masters.grads_to_masters()
        opt.step()
        masters.masters_to_params()
        ema.update()
        out.append(loss.detach())
        ema.eval()
        masters.masters_to_params()
        with torch.no_grad():
            out += [model(x), model(x)]
        ema.train()
        masters.masters_to_params()
        with torch.no_grad():
            out.append(model(x))
    return out + [p.detach().clone() for p in masters.masters]


@pytest.mark.skipif(not DIRS, reason="AI_TOOLKIT_DIR is not set (its toolkit/ema.py is the EMA under test)")
@pytest.mark.parametrize("resident_mb", [None, "1"], ids=["ring", "resident"])
def test_ema_swap_through_data_is_seen_by_the_next_call(engine, device, monkeypatch, resident_mb):
    """EMA's copy_to/restore write p.data.copy_(...), which leaves the Parameter's version alone: a device
    copy (ring or resident) kept from before would be served stale. Trainable layers copy at every use."""
    aitk_dir = DIRS[0]
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")  # the copies counted below are the ring's and RESIDENT_MB's
    if resident_mb:
        monkeypatch.setenv("LAYERSTREAM_RESIDENT_MB", resident_mb)
    ema_cls = _import_ema(aitk_dir)
    package = load_memory_management(aitk_dir, engine="layerstream")
    ref = mlp().to(device)
    managed = mlp()
    package.MemoryManager.attach(managed, device, offload_percent=1.0)
    managed.to(device)
    params = list(managed.parameters())
    expected = _ema_run(ref, ema_cls, device, Masters(ref.parameters(), placed_like=params))
    got = _ema_run(managed, ema_cls, device, Masters(params))
    assert len(got) == len(expected)
    # Outputs and losses on the device, weights where the managed Parameters live.
    assert all(a.device == b.device and torch.equal(a, b) for a, b in zip(got, expected))
    if engine == "sim":
        stats = mm._DEVICE_STATE[device].stats()
        # Per step: 3 forwards, 2 backwards that read the weight (the first layer's input takes no
        # gradient) and 3 forwards under no_grad, each a copy of its layer (64 x 65 float32); a resident
        # layer's first copy is made when it registers.
        assert stats["copies_h2d"] == 3 * (3 + 2 + 9) + (3 if resident_mb else 0)
        assert stats["bytes_h2d"] == stats["copies_h2d"] * 65 * 64 * 4
        assert stats["resident_layers"] == (3 if resident_mb else 0)


def test_frozen_layers_still_reuse_their_device_copies(engine, device, monkeypatch):
    """The common LoRA case (frozen base, no .data writes) keeps its copies: 3 layers, 20 calls, 3 copies (in the
    ring: with the VRAM budget, auto, the plan's resident copies come on top)."""
    if engine != "sim":
        pytest.skip("counts the simulator's copies")
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")
    clear_device_states()
    model = attached(mlp().requires_grad_(False), device)
    x = torch.randn(2, 64, requires_grad=True)
    for _ in range(10):
        model(x).sum().backward()
    stats = mm._DEVICE_STATE[device].stats()
    assert stats["copies_h2d"] == 3 and stats["reuse_hits"] == 3 * 10 * 2 - 3


# ---- item 4: double backward ---------------------------------------------------------------------------

def _penalty_grads(model, x):
    """A gradient penalty: d/dparams of |d out / d x|^2 (create_graph=True), plus the loss's own."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    (out.mean() + gx.pow(2).sum()).backward()
    mm.sync_grad_transfers()
    return [x.grad] + [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("trainable", [True, False], ids=["full", "frozen"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_double_backward_matches_the_unmanaged_model(engine, device, monkeypatch, kind, trainable):
    """create_graph=True runs the layers' backward differentiably: the graph it builds saved views of ring
    memory that the next layers' copies overwrite (five layers cycle the ring), and the weights'
    second-order terms were lost (their gradients went through the D2H staging)."""
    deterministic_cudnn(engine, monkeypatch)
    torch.manual_seed(5)
    layers = []
    for i in range(5):
        if kind == "linear":
            layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
        else:
            layers += [torch.nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), torch.nn.Tanh()]
    ref = torch.nn.Sequential(*layers[:-1]).requires_grad_(trainable)
    x = torch.randn(3, 5, 32) if kind == "linear" else torch.randn(2, 3, 9, 9)
    managed = attached(copy.deepcopy(ref), device)
    ref = ref.to(device)
    x = x.to(device)
    for _ in range(2):  # the second pass accumulates into .grad
        expected = _penalty_grads(ref, x)
        got = _penalty_grads(managed, x)
    assert len(got) == len(expected) == (11 if trainable else 1)
    # The input's gradient is on the device on both sides, a managed weight's where its Parameter lives (the
    # host on CUDA, the unmanaged one's on the device): compared on the host.
    assert all(p.grad.device == p.device for p in managed.parameters() if p.requires_grad)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, expected))


@pytest.mark.parametrize("trainable", [True, False], ids=["full", "frozen"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_autocast_matches_the_unmanaged_model(engine, device, monkeypatch, kind, trainable):
    """float32 weights called under torch.autocast(bfloat16), as an Accelerator with mixed precision runs
    AI-Toolkit's forward: a managed layer casts as upstream's linear and conv do (bfloat16 outputs, float32
    weight gradients), bit for bit, and a layer called under autocast(enabled=False) inside it stays float32."""
    deterministic_cudnn(engine, monkeypatch)
    torch.manual_seed(7)
    if kind == "linear":
        ref = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
        x = torch.randn(3, 5, 32)
    else:
        ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(8, 4, 3))
        x = torch.randn(2, 3, 9, 9)
    ref.requires_grad_(trainable)
    managed = attached(copy.deepcopy(ref), device)
    ref = ref.to(device)
    results = []
    for model in (ref, managed):
        inp = x.to(device).requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden = model[1](model[0](inp))
            with torch.autocast(device.type, enabled=False):
                exact = model[2](hidden.float())
            out = model[2](hidden)
        assert (hidden.dtype, out.dtype, exact.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
        (out.float().square().mean() + exact.square().mean()).backward()
        mm.sync_grad_transfers()
        grads = [p.grad for p in model.parameters()]
        assert all((g is None) != trainable for g in grads)
        assert all(g.dtype == torch.float32 for g in grads if g is not None)
        results.append([out, exact, inp.grad] + [g for g in grads if g is not None])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(*results))


# ---- item 5: replaced weights, unbatched conv, tied weights, inference tensors -------------------------

def test_a_weight_replaced_before_the_backward_is_the_forwards_or_refused(engine, device):
    """Upstream's backward uses the weight its forward saved. Replaced without another call: the packed copy
    is still the forward's, and the result is upstream's. Replaced and called again (packed again): the
    earlier graph's backward is refused rather than computed with the new weight."""
    ref = torch.nn.Linear(8, 8)
    managed = copy.deepcopy(ref)
    mm.LinearLayerMemoryManager.attach(managed, Manager(device))
    grads = []
    for layer in (ref.to(device), managed):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_(True)
        y = layer(x).sum()
        layer.weight = torch.nn.Parameter(layer.weight.detach() * 2)
        y.backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    if engine == "cpu":
        return  # the CPU mode computes with the Parameters themselves, as upstream
    x = torch.randn(2, 8).to(device).requires_grad_(True)
    y = managed(x).sum()
    managed.weight = torch.nn.Parameter(managed.weight.detach() * 2)
    managed(x)  # packs the new weight
    with pytest.raises(RuntimeError, match="replaced .* after a forward and before that forward's backward"):
        y.backward()


def test_unbatched_conv_input_matches_the_unmanaged_layer(engine, device, monkeypatch):
    deterministic_cudnn(engine, monkeypatch)
    torch.manual_seed(6)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1)
    managed = managed_conv = copy.deepcopy(ref)
    mm.ConvLayerMemoryManager.attach(managed_conv, Manager(device))
    results = []
    for layer in (ref.to(device), managed):
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_(True)
        out = layer(x)
        out.pow(2).sum().backward()
        mm.sync_grad_transfers()
        results.append([out, x.grad, layer.weight.grad, layer.bias.grad])
    # On the host: a managed layer's weight gradients land where its Parameters live.
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(*results))


def test_tied_weights_are_packed_once_and_copied_once(engine, device):
    """One Parameter in two managed layers: each layer packed it into its own block and swapped the
    Parameter's data, so the other packed it again at its next call (100 copies in 50 calls)."""
    torch.manual_seed(7)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).requires_grad_(False)
    ref[1].weight = ref[0].weight
    managed = attached(copy.deepcopy(ref), device)
    assert managed[1].weight is managed[0].weight
    ref = ref.to(device)
    x = torch.randn(2, 32).to(device)
    for _ in range(50):
        assert torch.equal(managed(x), ref(x))
    with torch.no_grad():  # an in-place change of the shared weight reaches both layers
        ref[0].weight.mul_(0.5)
        managed[0].weight.mul_(0.5)
    assert torch.equal(managed(x), ref(x))
    if engine == "sim":
        assert mm._DEVICE_STATE[device].stats()["copies_h2d"] == 2 + 2


def test_inference_tensors_at_attach_get_a_clear_error(engine, device):
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"created under torch.inference_mode\(\).*setattr\(module, name, "
                                         r"torch.nn.Parameter\(p.clone\(\), p.requires_grad\)\)"):
        mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    if engine == "cpu":
        return
    # The fix the message gives works.
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 8)
    for name, p in list(layer.named_parameters()):
        setattr(layer, name, torch.nn.Parameter(p.clone(), p.requires_grad))
    ref = copy.deepcopy(layer).to(device)
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    x = torch.randn(2, 8, device=device)
    assert torch.equal(layer(x), ref(x))


# ---- item 6: the VRAM budget under a full fine-tune ----------------------------------------------------

def test_vram_budget_plans_for_a_full_fine_tune(engine, device, monkeypatch):
    """Every managed layer of a full fine-tune runs through the autograd function, whose forward torch runs
    with grad mode off: the budget, waiting for a forward with grad enabled, never planned."""
    if engine != "sim":
        pytest.skip("a fixed budget on a real GPU depends on what the process already holds; CPU has no ring")
    clear_device_states()
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "3MiB")
    # A budget of a few MiB: the cycles measure's quarter of it kept free between steps leaves no layer
    # resident, so these cases of the ring's plan and its replay run on the window measure.
    monkeypatch.setenv("LAYERSTREAM_VRAM_PEAK", "window")
    torch.manual_seed(9)
    base = TinyTransformer(d=256, ff=512, layers=2)
    resident = copy.deepcopy(base)
    managed = attached(copy.deepcopy(base), device)
    # _steps trains the parameters of what it is given: here the whole model.
    assert _steps(managed, [managed], device, 4) == _steps(resident, [resident], device, 4)
    stats = mm._DEVICE_STATE[device].stats()
    assert stats["vram_budget_planned"] == 1 and stats["resident_layers"] > 0
