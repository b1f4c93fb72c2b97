"""Training through AI-Toolkit's real manager.py, managed against unmanaged, bitwise: the gradients of
trainable managed weights (issue 24, items 1 and 2, also recorded for AI-Toolkit's stock manager on CUDA)
and the matrix a trainer produces (LoRA or full fine-tune, checkpointing, gradient accumulation, a plain or
a fused optimizer step, how frozen weights are stored). Skipped without AI_TOOLKIT_DIR. The `engine`
fixture checks that the simulator's race checker saw no unordered read of a gradient still being copied.

Devices on CUDA: a managed layer's Parameters and their `.grad` live on the host, its math runs on the GPU;
the unmanaged reference has everything on the GPU. Gradients are compared on the host; optimizers step
where the managed Parameters live (masters.py)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from conftest import aitk_dirs
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management, manager_version
from linear_checks import compressed_reference
from masters import Masters
from models import TinyTransformer, apply_lora

DIRS = aitk_dirs()
pytestmark = pytest.mark.skipif(
    not DIRS, reason="AI_TOOLKIT_DIR is not set (point it at one or more AI-Toolkit checkouts, os.pathsep-separated)"
)


def attach(model: torch.nn.Module, device: torch.device, manager="layerstream", aitk_dir=None) -> torch.nn.Module:
    """Every Linear managed by AI-Toolkit's manager.py (of `aitk_dir`, default the first checkout of
    AI_TOOLKIT_DIR), with layerstream's manager_modules or, `manager="stock"`, the checkout's own."""
    package = load_memory_management(aitk_dir or DIRS[0], engine=manager)
    random.seed(0)
    package.MemoryManager.attach(model, device, offload_percent=1.0)
    model.to(device)  # manager.py's patched .to: only unmanaged modules move
    assert all(hasattr(m, "_layer_memory_manager") for m in model.modules() if isinstance(m, torch.nn.Linear))
    return model


def twins(model: torch.nn.Module, device: torch.device, manager="layerstream", aitk_dir=None):
    """(unmanaged, managed) copies of `model`."""
    return copy.deepcopy(model).to(device), attach(copy.deepcopy(model), device, manager, aitk_dir)


def grad_pairs(reference: torch.nn.Module, managed: torch.nn.Module) -> list:
    """(name, reference's .grad, managed's .grad) of every parameter. A managed gradient lands where its
    Parameter lives (the host, for a managed layer on CUDA)."""
    pairs = []
    for (name, a), b in zip(reference.named_parameters(), managed.parameters()):
        assert b.grad is None or b.grad.device == b.device, f"{name}: gradient on {b.grad.device}, not {b.device}"
        pairs.append((name, a.grad, b.grad))
    return pairs


def differences(pairs) -> dict:
    """name: the largest difference (float64, on the host) of every (name, expected, got) pair that is not
    the same bits; inf where one side is missing. Empty when everything is bitwise equal."""
    found = {}
    for name, a, b in pairs:
        if a is None or b is None:
            if (a is None) != (b is None):
                found[name] = math.inf
            continue
        a, b = a.detach().cpu(), b.detach().cpu()
        if not torch.equal(a, b):
            found[name] = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else math.inf
    return found


def assert_same(pairs):
    found = differences(pairs)
    assert not found, f"not the same bits (name: largest difference): {found}"


# ---- issue 24, item 1: accumulation under non-reentrant checkpointing ------------------------------------
# Each reproducer of items 1 and 2 runs an unmanaged model and its managed twin (layerstream's manager or
# AI-Toolkit's stock one) side by side and returns what to compare: (name, unmanaged, managed) pairs. `sync`
# runs after the last backward (stock needs its sync_grad_transfers() before .grad is read; layerstream
# joins its copies when backward ends).


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


def accumulated(device, checkpointing, manager="layerstream", aitk_dir=None, sync=lambda: None, width=256):
    """Two backward passes into .grad of three Linear(width, width) under `checkpointing`."""
    torch.manual_seed(1)
    reference, managed = twins(Chain(d=width, checkpointing=checkpointing), device, manager, aitk_dir)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(4, width, generator=g).to(device)
        if checkpointing == "reentrant":
            x.requires_grad_(True)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    sync()
    return grad_pairs(reference, managed)


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
def test_gradient_accumulation_under_checkpointing(engine, device, checkpointing):
    # Non-reentrant checkpointing saves a detached alias of the weight: its .grad is never defined, so the
    # second pass's gradient was handed to AccumulateGrad (which adds it into .grad) before its copy landed.
    assert_same(accumulated(device, checkpointing))


# ---- issue 24, item 2: anything that reads a gradient before backward ends -------------------------------


def _record_hooks(model, kind, seen):
    """Hooks on every weight that read the gradient as autograd passes it on."""
    for i, layer in enumerate(model.layers):
        if kind == "tensor":
            layer.weight.register_hook(lambda g, i=i: seen.append((i, g.clone())))
        else:
            layer.weight.register_post_accumulate_grad_hook(lambda p, i=i: seen.append((i, p.grad.clone())))


def hooked(device, kind, manager="layerstream", aitk_dir=None, sync=lambda: None, width=256):
    """A tensor or post-accumulate-grad hook on every weight of three Linear(width, width) reads the
    gradient, in two backward passes (the second adds into .grad: post-accumulate hooks see the sum)."""
    torch.manual_seed(3)
    reference, managed = twins(Chain(d=width), device, manager, aitk_dir)
    seen_ref, seen = [], []
    _record_hooks(reference, kind, seen_ref)
    _record_hooks(managed, kind, seen)
    for _ in range(2):
        x = torch.randn(4, width).to(device)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    sync()
    assert [i for i, _ in seen] == [i for i, _ in seen_ref] and len(seen) == 6
    hooks = [(f"hook {n} (weight {i})", a, b) for n, ((i, a), (_, b)) in enumerate(zip(seen_ref, seen))]
    return hooks + grad_pairs(reference, managed)


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_gradient_hooks_see_the_whole_gradient(engine, device, kind):
    assert_same(hooked(device, kind))


def _fuse_steps(masters: Masters, micro: int):
    """A fused optimizer step in a post-accumulate-grad hook (as AI-Toolkit's Automagic optimizers do), with
    accumulation of its own (as Adafactor's stochastic accumulation does): each micro-step's gradient is read
    in the hook and taken out of .grad; the last one steps. The step runs on the parameter's master (see
    masters.py), then the master is copied into the parameter."""
    for p, master in zip(masters.params, masters.masters):
        opt = torch.optim.AdamW([master], lr=1e-2)
        state = {"n": 0, "sum": None}

        def hook(p, master=master, opt=opt, state=state):
            grad = masters.take_grad(p).float()
            state["sum"] = grad if state["sum"] is None else state["sum"] + grad
            state["n"] += 1
            if state["n"] % micro == 0:
                master.grad = state["sum"].to(master.dtype)
                state["sum"] = None
                opt.step()
                master.grad = None
                masters.masters_to_params(p)

        p.register_post_accumulate_grad_hook(hook)


def master_pairs(reference: Masters, managed: Masters, what=lambda t: t) -> list:
    """(name, reference's, managed's) `what` of every master: on one device on both sides, as built."""
    pairs = []
    for i, (a, b) in enumerate(zip(reference.masters, managed.masters)):
        assert a.device == b.device, f"parameter {i}: the reference's master is on {a.device}, not {b.device}"
        pairs.append((f"parameter {i}", what(a), what(b)))
    return pairs


def test_fused_optimizer_step_in_post_accumulate_hook(engine, device):
    # AI-Toolkit's Automagic optimizers step each Parameter inside backward, from this hook.
    torch.manual_seed(4)
    reference, managed = twins(Chain(), device)
    masters = Masters(managed.parameters())
    ref_masters = Masters(reference.parameters(), placed_like=masters.params)
    _fuse_steps(masters, micro=1)
    _fuse_steps(ref_masters, micro=1)
    for _ in range(3):
        x = torch.randn(4, 256).to(device)
        out, out_ref = managed(x), reference(x)
        assert torch.equal(out, out_ref)
        out.pow(2).mean().backward()
        out_ref.pow(2).mean().backward()
    assert_same(master_pairs(ref_masters, masters))


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


def reused(device, how, manager="layerstream", aitk_dir=None, sync=lambda: None, width=64):
    """Two backward passes through a model whose weight has several uses in one graph (Reuse)."""
    torch.manual_seed(5)
    reference, managed = twins(Reuse(how, d=width), device, manager, aitk_dir)
    for _ in range(2):
        x = torch.randn(3, width).to(device)
        reference(x).pow(2).mean().backward()
        managed(x).pow(2).mean().backward()
    sync()
    return grad_pairs(reference, managed)


@pytest.mark.parametrize("how", ["twice", "tied", "unmanaged_too"])
def test_several_uses_of_one_parameter_in_one_graph(engine, device, how):
    if how == "unmanaged_too" and engine == "cuda":
        pytest.skip("on CUDA a managed weight lives on the host: an operation outside the layer cannot use it with "
                    "device inputs (nor with the stock manager)")
    assert_same(reused(device, how))


# Issue 24 asks whether AI-Toolkit's stock manager_modules shares items 1 and 2 on CUDA (on the CPU its
# gradients are computed on the host as backward runs: nothing is in flight). The reproducers above, each
# with the checkout's own manager_modules: item, reproducer, its argument. Accumulation without
# checkpointing and with reentrant checkpointing are the controls of item 1.
STOCK_CASES = [
    pytest.param(item, reproducer, case, id=f"item{item}-{reproducer.__name__}-{case or 'plain'}")
    for item, reproducer, case in [
        (1, accumulated, None), (1, accumulated, "reentrant"), (1, accumulated, "non_reentrant"),
        (2, hooked, "tensor"), (2, hooked, "post_accumulate"), (2, reused, "twice"), (2, reused, "tied"),
    ]
]


def stock_line(aitk_dir, item, name, run) -> str:
    """`STOCK-ITEM item=1 case=accumulated-non_reentrant aitk=27a03a91 exact=False maxdiff=3.8e+23`, the
    outcome of `run()` (pairs to compare), for docs/reliability.md: maxdiff is the largest difference (nan
    or inf: garbage); an exception is stock's outcome too (`exact=False error=...`)."""
    version = (manager_version(f"{aitk_dir}/toolkit/memory_management") or "unknown").split()[0]
    head = f"STOCK-ITEM item={item} case={name} aitk={version}"
    try:
        found = differences(run())
    except Exception as exc:
        return f"{head} exact=False error={type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    worst = max(found.values(), key=lambda d: math.inf if math.isnan(d) else d, default=0.0)
    return f"{head} exact={not found} maxdiff={worst:.6g}"


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["cuda"], indirect=True)
@pytest.mark.parametrize("aitk_dir", DIRS)
@pytest.mark.parametrize("item,reproducer,case", STOCK_CASES)
def test_items_1_and_2_through_the_stock_manager(engine, device, aitk_dir, item, reproducer, case, capsys):
    """Stock's result is recorded, not asserted: one STOCK-ITEM line per case in pytest's output (it
    waits for the gradient copies only where the tensor saved for backward has a .grad, 27a03a91, or never,
    323b4aaf; its sync_grad_transfers() and a device synchronize run after the last backward, so only
    reads during backward can make it wrong). Layerstream on the same case, through the same checkout's
    manager.py, must be exact. Layers 4096 wide (a 64 MiB float32 gradient takes milliseconds to reach the
    host): a read that is not ordered after its copy is seen, not hidden by a copy that happened to be
    fast."""
    stock_modules = load_memory_management(aitk_dir, engine="stock").manager_modules

    def stock_sync():
        getattr(stock_modules, "sync_grad_transfers", lambda: None)()  # 323b4aaf has none
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    line = stock_line(aitk_dir, item, f"{reproducer.__name__}-{case or 'plain'}", lambda: reproducer(
        device, case, manager="stock", aitk_dir=aitk_dir, sync=stock_sync, width=4096))
    with capsys.disabled():
        print(f"\n{line}")
    assert_same(reproducer(device, case, aitk_dir=aitk_dir, width=4096))


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


def _train(runs, device, micro, step, steps):
    """`steps` optimizer steps of `micro` micro-steps each, of every (model, Masters) in `runs` in lockstep
    (the managed model, then its reference): every loss and every accumulated gradient compared."""
    if step == "plain":
        opts = [torch.optim.AdamW(masters.masters, lr=1e-2) for _, masters in runs]
    else:
        for _, masters in runs:
            _fuse_steps(masters, micro)
    g = torch.Generator().manual_seed(7)
    norm = runs[0][0].norm
    for _ in range(steps):
        for _ in range(micro):
            x = torch.randn(2, 5, norm.normalized_shape[0], generator=g).to(device, norm.weight.dtype)
            losses = []
            for model, _ in runs:
                loss = model(x).float().pow(2).mean() / micro
                loss.backward()
                losses.append(loss.item())
            assert losses[1:] == losses[:1] * (len(losses) - 1)
        if step == "plain":
            for _, masters in runs:
                masters.grads_to_masters()
            assert_same(master_pairs(runs[1][1], runs[0][1], lambda m: m.grad))
            for (_, masters), opt in zip(runs, opts):
                opt.step()
                opt.zero_grad(set_to_none=True)
                masters.masters_to_params()


def _matrix_runs(device, training, checkpointing, storage):
    """[(managed, its Masters), (reference, its Masters placed like the managed ones)] of a one-block
    bf16 TinyTransformer attached through AI-Toolkit's manager.py, trained with LoRA or fully."""
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
    masters = Masters(_trainable(managed, loras))
    return [(managed, masters), (reference, Masters(_trainable(reference, ref_loras), placed_like=masters.params))]


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
    runs = _matrix_runs(device, training, checkpointing, storage)
    # Two optimizer steps when each is one micro-step: the second forward reads the updated weights.
    _train(runs, device, micro, step, steps=2 if micro == 1 else 1)
    assert_same(master_pairs(runs[1][1], runs[0][1]))


@pytest.mark.parametrize("engine", ["sim", "cuda"], indirect=True)
def test_the_matrix_sees_a_managed_gradient_one_ulp_off(engine, device):
    """The comparison can fail: a full fine-tune's row with one element of one managed weight's gradient
    moved by one ulp (by a hook of the test's own) fails at the gradient check."""
    runs = _matrix_runs(device, "full", None, "same")
    managed = runs[0][0]
    weight = managed.blocks[0].up.weight
    index = next(i for i, p in enumerate(runs[0][1].params) if p is weight)

    def nudge(p):  # the gradient's first element, one ulp up
        with torch.no_grad():
            first = p.grad.view(-1)[:1]
            first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))

    weight.register_post_accumulate_grad_hook(nudge)
    with pytest.raises(AssertionError, match=rf"'parameter {index}': "):
        _train(runs, device, 1, "plain", steps=1)
