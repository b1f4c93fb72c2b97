"""LAYERSTREAM_HOST_DTYPE unset (auto, include/layerstream/host_form.h): frozen bfloat16 weights of 1 MiB or
more are packed losslessly, smaller and non-bfloat16 ones stored as they are, and one INFO line says which.
Training is bitwise the unmanaged model's; the arena and the bus hold exactly the packed bytes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from conftest import clear_device_states
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from models import TinyTransformer, apply_lora
from test_lossless import _align, packed_bytes

MIB = 1 << 20
PACKED_LINE = ("layerstream: LAYERSTREAM_HOST_DTYPE=auto: frozen bfloat16 weights of 1 MiB or more packed lossless "
               "(exact: about 0.75x their bytes in host RAM and over the bus, decoded on the device bit for bit); "
               "other weights stored as they are (LAYERSTREAM_HOST_DTYPE=same or =lossless chooses explicitly)")


def _train(model, device, steps=3):
    """LoRA (bfloat16) on every linear, AdamW; the losses and each step's LoRA gradients."""
    loras = [lo.to(device, torch.bfloat16) for lo in apply_lora(model)]
    opt = torch.optim.AdamW([p for lo in loras for p in lo.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(10)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(2, 6, 512, generator=g).to(device, torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        mm.sync_grad_transfers()
        grads.append([p.grad.clone() for lo in loras for p in lo.parameters()])
        opt.step()
        losses.append(loss.item())
    return losses, grads


def _auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "LAYERSTREAM_HOST_DTYPE=auto" in r.getMessage()]


def test_by_default_bf16_weights_of_a_mib_or_more_are_packed_and_training_is_bitwise_the_unmanaged_run(
        engine, device, monkeypatch, caplog):
    """d=512, ff=1024: the attention projections (512 KiB each) stay as they are, the MLP's (1 MiB each) are
    packed; the losses and LoRA gradients equal the unmanaged model's bit for bit, step for step."""
    monkeypatch.delenv("LAYERSTREAM_HOST_DTYPE", raising=False)
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "64")  # every block fits: each crosses the bus once
    monkeypatch.setenv("LAYERSTREAM_VRAM_BUDGET", "min")  # the memory-first mode: every layer streams
    mm._testing.reset_log_once()
    clear_device_states()
    assert mm.settings()["host_dtype"] == "auto"
    torch.manual_seed(7)
    base = TinyTransformer(d=512, heads=4, ff=1024, layers=2, checkpointing="non_reentrant").to(torch.bfloat16)
    base.requires_grad_(False)
    reference = copy.deepcopy(base).to(device)
    model = copy.deepcopy(base)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    big = [m for m in linears if m.weight.nbytes >= MIB]
    small = [m for m in linears if m.weight.nbytes < MIB]
    assert len(big) == 4 and len(small) == 8  # two blocks: fc1 and fc2 packed; q, k, v and out not

    with caplog.at_level(logging.INFO, logger="layerstream"):
        ContractManager.attach(mm, model, device).to_device()
    assert _auto_lines(caplog) == [PACKED_LINE]  # once, for twelve layers
    for m in big:
        assert m._layer_memory_manager.stored_as == "lossless BFloat16"
    for m in small:
        assert m._layer_memory_manager.stored_as == "BFloat16"

    def block(weight_bytes, m):  # the bias follows the weight at the arena's alignment
        return _align(weight_bytes) + m.bias.numel() * 2 if m.bias is not None else weight_bytes

    arena = sum(m._layer_memory_manager.packed_bytes for m in linears)
    assert arena == sum(block(packed_bytes(m.weight), m) for m in big) + sum(
        block(m.weight.numel() * 2, m) for m in small)
    assert sum(packed_bytes(m.weight) for m in big) < 0.76 * sum(m.weight.numel() * 2 for m in big)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        losses, grads = _train(model, device)
        ref_losses, ref_grads = _train(reference, device)
    assert losses == ref_losses
    for a, b in zip(grads, ref_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if engine != "cpu":  # each block crossed the bus once, packed where it was packed
        assert mm._DEVICE_STATE[torch.device(device)].stats()["bytes_h2d"] == arena
    assert _auto_lines(caplog) == [PACKED_LINE]


@pytest.mark.parametrize("value, stored", [("same", "BFloat16"), ("lossless", "lossless BFloat16")])
def test_an_explicit_host_dtype_is_kept_and_says_nothing_of_auto(engine, device, monkeypatch, caplog, value, stored):
    """`same` stores a 2 MiB bfloat16 weight as it is, `lossless` packs even a small one; neither logs auto's line."""
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", value)
    mm._testing.reset_log_once()
    clear_device_states()
    torch.manual_seed(1)
    big = torch.nn.Linear(1024, 1024).to(torch.bfloat16).requires_grad_(False)
    tiny = torch.nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="layerstream"):
        for layer in (big, tiny):
            mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
    assert big._layer_memory_manager.stored_as == stored
    assert tiny._layer_memory_manager.stored_as == stored
    assert _auto_lines(caplog) == []


def test_auto_stores_float32_and_float16_weights_as_they_are(engine, device, monkeypatch):
    monkeypatch.delenv("LAYERSTREAM_HOST_DTYPE", raising=False)
    clear_device_states()
    for dtype, name in ((torch.float32, "Float"), (torch.float16, "Half")):
        layer = torch.nn.Linear(1024, 1024).to(dtype).requires_grad_(False)
        mm.LinearLayerMemoryManager.attach(layer, ContractManager(mm, layer, device))
        assert layer._layer_memory_manager.stored_as == name
        assert layer._layer_memory_manager.packed_bytes == _align(layer.weight.nbytes) + layer.bias.nbytes
