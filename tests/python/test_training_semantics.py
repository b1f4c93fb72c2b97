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
from linear_checks import compressed_reference
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
    if how == "unmanaged_too" and engine == "cuda":
        pytest.skip("on CUDA a managed weight lives on the host: an operation outside the layer cannot use it with "
                    "device inputs (nor with the stock manager)")
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


# ---- the matrix a trainer produces ------------------------------------------------------------------------


def _trainable(model, loras):
    return [p for lo in loras for p in lo.parameters()] if loras is not None else list(model.parameters())


def _fuse_steps(params, micro):
    """A fused optimizer step in a post-accumulate-grad hook (as AI-Toolkit's Automagic optimizers do), with
    accumulation of its own (as Adafactor's stochastic accumulation does): each micro-step's gradient is read
    in the hook and taken out of .grad; the last one steps."""
    for p in params:
        opt = torch.optim.AdamW([p], lr=1e-2)
        state = {"n": 0, "sum": None}

        def hook(p, opt=opt, state=state):
            state["sum"] = p.grad.float() if state["sum"] is None else state["sum"] + p.grad.float()
            p.grad = None
            state["n"] += 1
            if state["n"] % micro == 0:
                p.grad = state["sum"].to(p.dtype)
                state["sum"] = None
                opt.step()
                p.grad = None

        p.register_post_accumulate_grad_hook(hook)


def _train(model, params, device, micro, step, steps=2, reference=None):
    """`steps` optimizer steps of `micro` micro-steps each; with a `reference` (model, params), the same on it
    in lockstep, every loss and every accumulated gradient compared."""
    opts = [torch.optim.AdamW(ps, lr=1e-2) for ps in ([params] + ([reference[1]] if reference else []))]
    if step == "fused":
        _fuse_steps(params, micro)
        if reference:
            _fuse_steps(reference[1], micro)
    g = torch.Generator().manual_seed(7)
    width = model.norm.normalized_shape[0]
    for _ in range(steps):
        for _ in range(micro):
            x = torch.randn(2, 5, width, generator=g).to(device, model.norm.weight.dtype)
            losses = []
            for m in [model] + ([reference[0]] if reference else []):
                loss = m(x).float().pow(2).mean() / micro
                loss.backward()
                losses.append(loss.item())
            assert losses[1:] == losses[:1] * (len(losses) - 1)
        if step == "plain":
            if reference:
                for a, b in zip(reference[1], params):
                    assert torch.equal(a.grad, b.grad.to(a.device))
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)


# Every combination for weights stored as they are. LAYERSTREAM_HOST_DTYPE applies to frozen weights only:
# LoRA (a frozen base) crosses it with 4 micro-steps (one step of the adapter leaves the base as it was);
# with a full fine-tune (nothing frozen among the Linears) one corner checks that the weights stay exact.
MATRIX = [
    pytest.param(training, checkpointing, micro, step, storage,
                 id=f"{training}-{checkpointing or 'plain'}-x{micro}-{step}-{storage}")
    for training in ("lora", "full")
    for checkpointing in (None, "reentrant", "non_reentrant")
    for micro in (1, 4)
    for step in ("plain", "fused")
    for storage in ("same", "float8_e4m3fn", "lossless")
    if storage == "same" or (micro == 4 and (training == "lora" or checkpointing == "non_reentrant"))
]


@pytest.mark.parametrize("engine", ["sim", "cuda"], indirect=True)
@pytest.mark.parametrize("training,checkpointing,micro,step,storage", MATRIX)
def test_training_matrix(engine, device, monkeypatch, training, checkpointing, micro, step, storage):
    if storage != "same":
        monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", storage)
    torch.manual_seed(12)
    base = TinyTransformer(d=32, heads=2, ff=64, layers=1, checkpointing=checkpointing).to(torch.bfloat16)
    if training == "lora":
        base.requires_grad_(False)
    reference = copy.deepcopy(base)
    if storage == "float8_e4m3fn" and training == "lora":
        # Frozen weights stream as float8 codes: the reference computes with what the device sees.
        with torch.no_grad():
            for m in reference.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(compressed_reference(m.weight, torch.float8_e4m3fn))
    reference.to(device)
    managed = attach(copy.deepcopy(base), device)
    if storage != "same" and training == "lora":
        expected = "Float8_e4m3fn" if storage == "float8_e4m3fn" else "lossless BFloat16"
        stored = {m._layer_memory_manager.stored_as for m in managed.modules() if isinstance(m, torch.nn.Linear)}
        assert stored == {expected}
    loras = ref_loras = None
    if training == "lora":
        ref_loras = [lo.to(device, torch.bfloat16) for lo in apply_lora(reference)]
        loras = [lo.to(device, torch.bfloat16) for lo in apply_lora(managed)]
    params, ref_params = _trainable(managed, loras), _trainable(reference, ref_loras)
    # Two optimizer steps when each is one micro-step: the second forward reads the updated weights.
    _train(managed, params, device, micro, step, steps=2 if micro == 1 else 1, reference=(reference, ref_params))
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b.to(a.device))
