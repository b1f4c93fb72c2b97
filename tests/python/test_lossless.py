"""LAYERSTREAM_HOST_DTYPE=lossless: frozen bfloat16 weights kept in the arena and streamed packed (a sign and
mantissa byte, a 4-bit exponent code, listed exceptions; include/layerstream/lossless.h) and rebuilt where
the layer computes. Every output and gradient is bitwise the unpacked run's; the arena holds exactly the
packed bytes; the bus carries them."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import clear_device_states
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from linear_checks import check_forward, check_forward_backward, check_model_step, start_fuzz
from models import TinyTransformer, apply_lora


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def packed_bytes(w: torch.Tensor) -> int:
    """The encoded size lossless.h gives: n low bytes, n/2 code bytes (each section 16-aligned), and eight
    bytes per value whose exponent is not among the tensor's fifteen most frequent."""
    n = w.numel()
    exponents = ((w.detach().cpu().contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF).flatten()
    counts = torch.bincount(exponents, minlength=256).sort(descending=True, stable=True).values
    exceptions = n - int(counts[:15].sum())
    return _align(n, 16) + _align((n + 1) // 2, 16) + 8 * exceptions


def _spread(w: torch.Tensor) -> None:
    """Gives twenty values magnitudes over forty octaves (more exponents than the table holds: exceptions),
    and four more zeros of both signs and subnormals."""
    with torch.no_grad():
        flat = w.view(-1)
        flat[4:24].mul_(torch.exp2(torch.randint(-30, 12, (20,)).float()).to(w.dtype))
        flat[:4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39], dtype=w.dtype)


@pytest.fixture
def decode_blocks(request):
    """The limit on the decode's thread blocks for one test (0: none; 1: one block loops over the whole
    weight, on the GPU), set back afterwards."""
    before = mm._testing.decode_blocks()
    mm._testing.set_decode_blocks(request.param)
    yield request.param
    mm._testing.set_decode_blocks(before)


@pytest.mark.parametrize("placed", [False, True], ids=["from-host", "from-device"])
@pytest.mark.parametrize("decode_blocks", [0, 1], indirect=True, ids=["all-blocks", "one-block"])
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_lossless_weights_cross_the_bus_packed_and_change_no_bit(engine, device, monkeypatch, conv, decode_blocks,
                                                                 placed):
    """`from-device`: the layer on the GPU before attach, as AI-Toolkit places its transformer; its weight is
    copied to page-locked host memory for the encoder, then freed when the Parameter becomes a PackedWeight."""
    if placed and torch.device(device).type != "cuda":
        pytest.skip("on a host device the placed layer is the host one (from-host)")
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    clear_device_states()
    torch.manual_seed(12)
    layer = (torch.nn.Conv2d(8, 16, 3) if conv else torch.nn.Linear(96, 48)).to(torch.bfloat16)
    _spread(layer.weight)
    layer.weight.requires_grad_(False)  # frozen weight, trainable bias
    original = layer.weight.detach().clone()
    reference = copy.deepcopy(layer).to(device)
    if placed:
        layer.to(device)
    expected_bytes = packed_bytes(original)
    assert expected_bytes > _align(original.numel(), 16) + _align(original.numel() // 2, 16)  # some exceptions

    cls = mm.ConvLayerMemoryManager if conv else mm.LinearLayerMemoryManager
    cls.attach(layer, Manager(device))
    lmm = layer._layer_memory_manager
    assert (lmm.stored_as, lmm.form) == ("lossless BFloat16", "lossless-bf16")
    assert lmm.packed_bytes == _align(expected_bytes) + layer.bias.numel() * 2
    shape = (2, 8, 7, 7) if conv else (6, 96)
    for i in range(2):  # the second call finds the weight in the ring (or resident): same bits
        x = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        out, ref = layer(x), reference(xr)
        assert torch.equal(out, ref)
        if i == 0 and engine != "cpu":  # the packed block crossed the bus once
            assert mm._DEVICE_STATE[torch.device(device)].stats()["bytes_h2d"] == lmm.packed_bytes
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        mm.sync_grad_transfers()
        assert torch.equal(x.grad, xr.grad)
        assert torch.equal(layer.bias.grad.to(device), reference.bias.grad)
        layer.bias.grad = None
        reference.bias.grad = None
    # The Parameter keeps its exact values (state_dict, saving, a later unfreeze see them).
    assert torch.equal(layer.weight.detach().cpu(), original)
    assert type(layer.weight).__name__ == "PackedWeight" and layer.weight.device.type == "cpu"
    if engine != "cpu":  # decoded by the copy stream, never on the compute stream
        stats = mm._DEVICE_STATE[torch.device(device)].stats()
        assert stats["dequant_on_copy"] > 0
        assert stats["dequant_into_scratch"] == stats["dequant_reused"] == 0


def test_lossless_training_is_bitwise_the_plain_streamed_run_with_a_quarter_fewer_bytes(engine, device, monkeypatch):
    """LoRA training of a bf16 transformer with checkpointing: the same losses and LoRA gradients, step for
    step, as streaming the weights as they are; the weights take three quarters of the arena's bytes, and
    the bus carries the packed blocks (the device's own count of bytes copied)."""
    if engine == "cpu":
        pytest.skip("the CPU mode copies nothing")
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "8")  # every block fits: each crosses the bus once
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")  # the memory-first mode: every layer streams
    torch.manual_seed(5)
    base = TinyTransformer(d=128, ff=384, layers=3, checkpointing="non_reentrant").to(torch.bfloat16)
    base.requires_grad_(False)
    linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]

    def train(host_dtype):
        monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", host_dtype)
        clear_device_states()
        model = copy.deepcopy(base)
        ContractManager.attach(mm, model, device).to_device()
        loras = [lo.to(device, torch.bfloat16) for lo in apply_lora(model)]
        opt = torch.optim.AdamW([p for lo in loras for p in lo.parameters()], lr=1e-2)
        g = torch.Generator().manual_seed(10)
        losses, grads = [], []
        for _ in range(3):
            x = torch.randn(2, 6, 128, generator=g).to(device, torch.bfloat16)
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            mm.sync_grad_transfers()
            grads.append([p.grad.clone() for lo in loras for p in lo.parameters()])
            opt.step()
            losses.append(loss.item())
        state = mm._DEVICE_STATE[torch.device(device)].stats()
        arena = sum(m._layer_memory_manager.packed_bytes for m in model.modules() if isinstance(m, torch.nn.Linear))
        return losses, grads, state, arena

    # The math attention kernel in both runs: cuDNN's bf16 flash-attention backward reports barrier
    # divergence inside itself under compute-sanitizer synccheck (H200, 2026-11-30), which would hide
    # what the check says of layerstream's own kernels in gpu_check.sh `san`.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        plain_losses, plain_grads, plain_state, plain_arena = train("same")
        losses, grads, state, arena = train("lossless")
    assert losses == plain_losses
    for a, b in zip(grads, plain_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    def block(weight_bytes, m):  # the bias follows the weight at the arena's alignment
        return _align(weight_bytes) + m.bias.numel() * 2 if m.bias is not None else weight_bytes

    assert plain_arena == sum(block(m.weight.numel() * 2, m) for m in linears)
    assert arena == sum(block(packed_bytes(m.weight), m) for m in linears)
    assert sum(packed_bytes(m.weight) for m in linears) < 0.76 * sum(m.weight.numel() * 2 for m in linears)
    assert (state["bytes_h2d"], plain_state["bytes_h2d"]) == (arena, plain_arena)


def test_lossless_leaves_what_it_does_not_take_as_it_is_packed_once(engine, device, monkeypatch):
    """float32 weights, bf16 ones in another layout, and bf16 ones whose exponents spread too widely to
    shrink are stored as they are, and stay so over several frozen uses (the block is packed once: the
    same host bytes, copied once into a ring that holds them all)."""
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    clear_device_states()
    torch.manual_seed(2)
    fp32 = torch.nn.Linear(16, 8)
    transposed = torch.nn.Linear(16, 8).to(torch.bfloat16)
    transposed.weight = torch.nn.Parameter(transposed.weight.detach().t().contiguous().t())
    spread = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():  # every value its own exponent: most are exceptions of 8 bytes
        spread.weight.copy_(torch.exp2(torch.randint(-100, 100, spread.weight.shape).float()).to(torch.bfloat16))
    assert packed_bytes(spread.weight) >= spread.weight.numel() * 2
    for layer in (fp32, transposed, spread):
        layer.requires_grad_(False)
        mm.LinearLayerMemoryManager.attach(layer, Manager(device))
        lmm = layer._layer_memory_manager
        x = torch.randn(2, layer.in_features, dtype=layer.weight.dtype, device=device)
        host_view = layer.weight.data_ptr()
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight.to(device), layer.bias.to(device)))
        assert lmm.stored_as == ("Float" if layer is fp32 else "BFloat16")
        assert layer.weight.data_ptr() == host_view  # not packed again at each use
    if engine != "cpu":
        assert mm._DEVICE_STATE[torch.device(device)].stats()["copies_h2d"] == 3


def test_an_unknown_host_dtype_names_lossless_among_the_choices(engine, device, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossles")
    refusal = r"LAYERSTREAM_HOST_DTYPE=lossles \(the environment\) is not accepted; it takes auto .*, same .*, lossless "
    with pytest.raises(ValueError, match=refusal):
        mm.LinearLayerMemoryManager.attach(torch.nn.Linear(8, 8).requires_grad_(False), Manager(device))


def test_lossless_packs_once_frozen_and_stores_plainly_while_trained(engine, device, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    clear_device_states()
    torch.manual_seed(6)
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    lmm = layer._layer_memory_manager
    x = torch.randn(3, 32, dtype=torch.bfloat16, device=device)
    assert lmm.stored_as == "BFloat16"  # trainable at attach
    layer.requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight.to(device), layer.bias.to(device)))
    assert lmm.stored_as == "lossless BFloat16"
    layer.requires_grad_(True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(x).float().sum().backward()
    assert lmm.stored_as == "BFloat16"
    mm.sync_grad_transfers()
    opt.step()
    layer.requires_grad_(False)
    after = layer.weight.detach().clone()
    with torch.no_grad():  # packed again from the updated values
        assert torch.equal(layer(x), torch.nn.functional.linear(x, after.to(device), layer.bias.to(device)))
    assert lmm.stored_as == "lossless BFloat16"


def test_the_pack_and_unpack_bindings_round_trip_and_refuse_a_wrong_shape(engine, device):
    torch.manual_seed(7)
    weight = (torch.randn(33, 17) * 0.05).to(torch.bfloat16)
    packed, spec = mm._testing.lossless_pack(weight)
    assert packed.numel() == packed_bytes(weight) and spec[0] == weight.numel()
    assert torch.equal(mm._testing.lossless_unpack(packed.to(device), spec, [33, 17]).cpu(), weight)
    with pytest.raises(ValueError, match="561 values needed.*shape \\[17, 34\\]"):
        mm._testing.lossless_unpack(packed, spec, [17, 34])
    with pytest.raises(ValueError, match="non-empty bfloat16 tensor, not Float"):
        mm._testing.lossless_pack(weight.float())


def test_the_decode_block_limit_refuses_what_the_kernel_cannot_launch():
    import subprocess
    import sys

    before = mm._testing.decode_blocks()
    with pytest.raises(ValueError, match="70000 is above the kernel's limit of 65536 \\(0: no limit\\)"):
        mm._testing.set_decode_blocks(70000)
    assert mm._testing.decode_blocks() == before
    code = "from layerstream import manager_modules as mm; print(mm._testing.decode_blocks())"
    for value, expected in (("132", "132"), ("", "0")):
        env = dict(os.environ, LAYERSTREAM_DECODE_BLOCKS=value)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr
    for bad in ("-3", "many", "70000"):
        env = dict(os.environ, LAYERSTREAM_DECODE_BLOCKS=bad)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines()[-1] == (
            f"ImportError: LAYERSTREAM_DECODE_BLOCKS={bad} (the environment) is not accepted; it takes a whole number "
            "of thread blocks from 0 (no limit) to 65536, e.g. LAYERSTREAM_DECODE_BLOCKS=64 (unset: 0)")


def test_fuzz_lossless_layers_under_delays_and_scrambled_copies(engine, device, monkeypatch):
    """Packed layers of random shapes behind a ring that holds few of them, the simulator delaying every
    stream and landing copies in random pieces, and a random interleaving of forward-only calls,
    forward+backward (trainable biases), replaced weights and in-place changes: every output and gradient
    equals the same math with the exact weights, and the race checker sees nothing (the decode on the copy
    stream included)."""
    rng = start_fuzz(engine, monkeypatch, "lossless", seed=13, faults="5")
    pool = []
    for _ in range(12):
        layer = torch.nn.Linear(16 * rng.randint(1, 12), 16 * rng.randint(1, 12)).to(torch.bfloat16)
        layer.weight.requires_grad_(False)
        layer.bias.requires_grad_(rng.random() < 0.5)
        mm.LinearLayerMemoryManager.attach(layer, Manager(device))
        pool.append(layer)
    for op in range(250):
        layer = rng.choice(pool)
        x = torch.randn(rng.randint(1, 4), layer.in_features, dtype=torch.bfloat16)
        action = rng.choice(["forward", "backward", "backward", "replace", "inplace"])
        if action == "forward":
            check_forward(layer, x, layer.weight, f"op {op}")
        elif action == "backward":
            check_forward_backward(layer, x, layer.weight.detach(), f"op {op}")
        elif action == "replace":
            layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight) * 0.1, requires_grad=False)
        else:
            with torch.no_grad():
                layer.weight.mul_(0.5)  # in place: packed again at the next use
    stats = mm._DEVICE_STATE[torch.device(device)].stats()
    assert stats["sim_races"] == 0
    assert stats["dequant_on_copy"] > 0


def test_resident_packed_layers_are_decoded_ahead_of_use_and_change_no_bit(engine, device, monkeypatch):
    """Layers kept resident (LAYERSTREAM_RESIDENT_MB) stay packed on the device; each use finds its weight decoded
    by the engine's stream into a ring region of its own (the prefetcher names the next layer), never on the compute
    stream into memory of its own. Outputs and gradients over several steps are bitwise the unmanaged model's, and
    the race checker sees every order (the decode reads the resident copy and writes the ring)."""
    if engine == "cpu":
        pytest.skip("a CPU process device has no copies to decode")
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", "lossless")
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")
    monkeypatch.setenv("LAYERSTREAM_RESIDENT_MB", "64")
    clear_device_states()
    torch.manual_seed(31)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(torch.bfloat16)
    for layer in model:
        _spread(layer.weight)
        layer.weight.requires_grad_(False)  # frozen weights, trainable biases
    reference = copy.deepcopy(model).to(device)
    for layer in model:
        mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    for step in range(3):
        check_model_step(model, reference, torch.randn(8, 256, dtype=torch.bfloat16, device=device), f"step {step}")
    stats = mm._DEVICE_STATE[torch.device(device)].stats()
    assert stats["resident_layers"] == 4
    assert stats["dequant_own_memory"] == 0
    assert stats["dequant_on_copy"] >= 3 * 4 * 2  # every forward and every backward of every step
    assert stats.get("sim_races", 0) == 0
