"""Training through AI-Toolkit's real manager.py, managed against unmanaged, bitwise: the gradients of
trainable managed weights (issue 24, items 1 and 2) and the matrix a trainer produces (LoRA or full
fine-tune, checkpointing, gradient accumulation, a plain or a fused optimizer step, how frozen weights are
stored). Skipped without AI_TOOLKIT_DIR. The `engine` fixture checks that the simulator's race checker saw
no unordered read of a gradient still being copied."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from conftest import aitk_dirs
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management
from models import TinyTransformer, apply_lora

DIRS = aitk_dirs()
pytestmark = pytest.mark.skipif(
    not DIRS, reason="AI_TOOLKIT_DIR is not set (point it at one or more AI-Toolkit checkouts, os.pathsep-separated)"
)


def attach(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Every Linear managed by AI-Toolkit's manager.py (the first checkout of AI_TOOLKIT_DIR)."""
    package = load_memory_management(DIRS[0], engine="layerstream")
    random.seed(0)
    package.MemoryManager.attach(model, device, offload_percent=1.0)
    model.to(device)  # manager.py's patched .to: only unmanaged modules move
    assert all(hasattr(m, "_layer_memory_manager") for m in model.modules() if isinstance(m, torch.nn.Linear))
    return model


def twins(model: torch.nn.Module, device: torch.device):
    """(unmanaged, managed) copies of `model`."""
    return copy.deepcopy(model).to(device), attach(copy.deepcopy(model), device)


def assert_grads_equal(reference: torch.nn.Module, managed: torch.nn.Module):
    for (name, a), b in zip(reference.named_parameters(), managed.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad.to(a.grad.device)), f"{name}: max diff {(a.grad - b.grad.to(a.grad.device)).abs().max()}"


# ---- issue 24, item 1: accumulation under non-reentrant checkpointing ------------------------------------


class Chain(torch.nn.Module):
    """Linears one after another, each under checkpoint() when `checkpointing` says so."""

    def __init__(self, n=3, d=256, checkpointing=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.checkpointing = checkpointing

    def forward(self, x):
        for layer in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = layer(x)
        return x


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
def test_gradient_accumulation_under_checkpointing(engine, device, checkpointing):
    # Non-reentrant checkpointing saves a detached alias of the weight: its .grad is never defined, so the
    # second pass's gradient was handed to AccumulateGrad (which adds it into .grad) before its copy landed.
    torch.manual_seed(1)
    reference, managed = twins(Chain(checkpointing=checkpointing), device)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(4, 256, generator=g).to(device)
        if checkpointing == "reentrant":
            x.requires_grad_(True)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    assert_grads_equal(reference, managed)


# ---- issue 24, item 2: anything that reads a gradient before backward ends -------------------------------


def _record_hooks(model, kind, seen):
    """Hooks on every weight that read the gradient as autograd passes it on."""
    for i, layer in enumerate(model.layers):
        if kind == "tensor":
            layer.weight.register_hook(lambda g, i=i: seen.append((i, g.clone())))
        else:
            layer.weight.register_post_accumulate_grad_hook(lambda p, i=i: seen.append((i, p.grad.clone())))


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_gradient_hooks_see_the_whole_gradient(engine, device, kind):
    torch.manual_seed(3)
    reference, managed = twins(Chain(), device)
    seen_ref, seen = [], []
    _record_hooks(reference, kind, seen_ref)
    _record_hooks(managed, kind, seen)
    for _ in range(2):  # the second pass adds into .grad (post-accumulate hooks see the sum)
        x = torch.randn(4, 256).to(device)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    assert [i for i, _ in seen] == [i for i, _ in seen_ref] and len(seen) == 6
    for (_, a), (_, b) in zip(seen_ref, seen):
        assert torch.equal(a, b.to(a.device))
    assert_grads_equal(reference, managed)


def test_fused_optimizer_step_in_post_accumulate_hook(engine, device):
    # AI-Toolkit's Automagic optimizers step each Parameter inside backward, from this hook.
    torch.manual_seed(4)
    reference, managed = twins(Chain(), device)

    def fuse(model):
        for p in model.parameters():
            opt = torch.optim.AdamW([p], lr=1e-2)

            def step(p, opt=opt):
                opt.step()
                opt.zero_grad(set_to_none=True)

            p.register_post_accumulate_grad_hook(step)

    fuse(reference)
    fuse(managed)
    for _ in range(3):
        x = torch.randn(4, 256).to(device)
        out, out_ref = managed(x), reference(x)
        assert torch.equal(out, out_ref)
        out.pow(2).mean().backward()
        out_ref.pow(2).mean().backward()
    for a, b in zip(reference.parameters(), managed.parameters()):
        assert torch.equal(a, b.to(a.device))


class Reuse(torch.nn.Module):
    """One Parameter with several uses in one graph: a layer called twice, a weight tied to a second layer,
    or a weight that an unmanaged operation uses as well."""

    def __init__(self, how: str, d=64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))
        self.how = how
        if how == "tied":
            self.layers[1].weight = self.layers[0].weight

    def forward(self, x):
        a, b = self.layers
        if self.how == "twice":
            return b(a(a(x)))
        if self.how == "unmanaged_too":
            return b(a(x)) + F.linear(x, a.weight)
        return b(torch.tanh(a(x)))


@pytest.mark.parametrize("how", ["twice", "tied", "unmanaged_too"])
def test_several_uses_of_one_parameter_in_one_graph(engine, device, how):
    torch.manual_seed(5)
    reference, managed = twins(Reuse(how), device)
    for _ in range(2):
        x = torch.randn(3, 64).to(device)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    assert_grads_equal(reference, managed)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_the_common_case_keeps_the_copy_overlapped(engine, device, checkpointing):
    # One use, no hook, no .grad yet: the copy is joined when backward ends, not when the gradient is
    # handed over (checked in a hook on the input's gradient, which autograd computes last).
    if engine == "cpu":
        pytest.skip("a CPU process device computes on the host: nothing is copied")
    torch.manual_seed(6)
    _, managed = twins(Chain(checkpointing=checkpointing), device)
    pending = []
    x = torch.randn(4, 256).to(device).requires_grad_(True)
    x.register_hook(lambda g: pending.append(mm.stats()["downloads_pending"]))
    managed(x).pow(2).mean().backward()
    assert pending == [6]  # three weights and three biases still in flight
    assert mm.stats()["downloads_pending"] == 0
