"""Several devices in one process, on the simulator: `cpu:0` and `cpu:1` with LAYERSTREAM_BACKEND=sim are
two simulated devices, each with its own device state (backend, streams, events, ring, arena). Every
stream, event and ring a layer uses must belong to its own process device: a model on the second device
works exactly as on the first, and neither touches the other's engine. (On CUDA the same code runs per
`cuda:N`; the two-GPU runs belong to the GPU machine.)"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from conftest import clear_device_states
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from models import TinyTransformer, apply_lora, train_lora


@pytest.fixture
def two_sim_devices(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim")
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "1")  # layers come and go on both devices
    clear_device_states()
    yield torch.device("cpu", 0), torch.device("cpu", 1)
    mm.sync_grad_transfers()
    assert mm.stats()["sim_races"] == 0
    clear_device_states()


def test_each_device_has_its_own_engine_and_a_model_on_the_second_is_exact(two_sim_devices):
    dev0, dev1 = two_sim_devices
    torch.manual_seed(41)
    base = TinyTransformer(d=128, ff=256, layers=2, checkpointing="non_reentrant").requires_grad_(False)
    resident = copy.deepcopy(base)
    ref = train_lora(resident, apply_lora(resident), torch.device("cpu"), 3)
    models, drivers, loras = [], [], []
    for dev in (dev0, dev1):
        model = copy.deepcopy(base)
        drivers.append(ContractManager.attach(mm, model, dev))
        drivers[-1].to_device()
        models.append(model)
        loras.append(apply_lora(model))
    states = [mm._DEVICE_STATE[dev0], mm._DEVICE_STATE[dev1]]
    assert sorted(mm.stats()["devices"]) == ["cpu:0 [sim backend: sim:0]", "cpu:1 [sim backend: sim:1]"]

    # Only the model on the second device runs: the first device's engine does not move a byte.
    assert train_lora(models[1], loras[1], torch.device("cpu"), 3, mm.sync_grad_transfers) == ref
    first = states[0].stats()
    assert first["fetches"] == 0 and first["bytes_h2d"] == 0
    second = states[1].stats()
    assert second["fetches"] > 0 and second["ring_bytes"] == 1 << 20

    # Then the first device's model, interleaved with more work on the second: each stays exact.
    assert train_lora(models[0], loras[0], torch.device("cpu"), 3, mm.sync_grad_transfers) == ref
    assert states[1].stats()["fetches"] == second["fetches"]  # the first model used only its own engine
    weights = sum(p.numel() * 4 for m in base.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    for s in states:  # each device holds exactly one model's weights in its own arena
        assert s.stats()["host_bytes_requested"] == weights


def test_freeing_one_device_leaves_the_other_training(two_sim_devices):
    dev0, dev1 = two_sim_devices
    torch.manual_seed(42)
    base = TinyTransformer(d=64, ff=128, layers=2).requires_grad_(False)
    resident = copy.deepcopy(base)
    ref = train_lora(resident, apply_lora(resident), torch.device("cpu"), 4)
    keep, drop = copy.deepcopy(base), copy.deepcopy(base)
    ContractManager.attach(mm, keep, dev0).to_device()
    drop_driver = ContractManager.attach(mm, drop, dev1)
    drop_driver.to_device()
    with torch.no_grad():
        drop(torch.randn(1, 3, 64))
    drop_driver.free()
    del mm._DEVICE_STATE[dev1], drop, drop_driver
    gc.collect()
    assert mm.live_device_states() == 1
    assert train_lora(keep, apply_lora(keep), torch.device("cpu"), 4, mm.sync_grad_transfers) == ref


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs two GPUs (this machine has {torch.cuda.device_count()})")
def test_a_model_on_the_second_gpu_is_exact_while_the_first_is_current(monkeypatch):
    """AI-Toolkit once used device 0's stream for a model on cuda:1, with nothing ordering its copies
    against compute. Here cuda:0 stays the current device while a model trains on cuda:1: every stream,
    event and ring is cuda:1's, and the result is bitwise the resident model's on cuda:1."""
    clear_device_states()
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "1")  # layers come and go
    torch.cuda.set_device(0)
    dev1 = torch.device("cuda", 1)
    torch.manual_seed(43)
    base = TinyTransformer(d=128, ff=256, layers=2, checkpointing="non_reentrant").requires_grad_(False)
    resident = copy.deepcopy(base).to(dev1)
    ref = train_lora(resident, [lo.to(dev1) for lo in apply_lora(resident)], dev1, 4)
    model = copy.deepcopy(base)
    ContractManager.attach(mm, model, dev1).to_device()
    assert torch.cuda.current_device() == 0
    assert train_lora(model, [lo.to(dev1) for lo in apply_lora(model)], dev1, 4, mm.sync_grad_transfers) == ref
    assert torch.cuda.current_device() == 0  # nothing switched the caller's device behind its back
    assert [str(k) for k in mm._DEVICE_STATE] == ["cuda:1"]
    stats = mm._DEVICE_STATE[dev1].stats()
    assert stats["fetches"] > 0 and stats["copies_h2d"] > 0
    clear_device_states()
