"""Checks shared by the tests: a managed Linear against torch's own linear with the weight it should
compute with, outputs and gradients compared bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerstream import manager_modules as mm


def compressed_reference(w: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """What layerstream streams: codes with a float32 scale per output channel (amax / largest code)."""
    top = torch.finfo(fp8).max
    wf = w.detach().float()
    scale = wf.abs().amax(dim=tuple(range(1, wf.dim())), keepdim=True) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (wf / scale).clamp(-top, top).to(fp8)
    return (codes.float() * scale).to(w.dtype)


def check_forward(layer: torch.nn.Linear, x: torch.Tensor, weight: torch.Tensor, label: str) -> None:
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, weight, layer.bias)), label


def check_forward_backward(layer: torch.nn.Linear, x: torch.Tensor, weight: torch.Tensor, label: str) -> None:
    """Forward and backward of `layer` on `x` against F.linear with `weight` (and a copy of the bias, trained
    or not): the output, the input gradient and the bias gradient are the same bits."""
    ref_b = layer.bias.detach().clone().requires_grad_(layer.bias.requires_grad)
    xr, xm = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_r = F.linear(xr, weight, ref_b)
    layer.bias.grad = None
    out_m = layer(xm)
    assert torch.equal(out_m, out_r), label
    out_r.float().square().sum().backward()
    out_m.float().square().sum().backward()
    mm.sync_grad_transfers()
    assert torch.equal(xm.grad, xr.grad), label
    if ref_b.requires_grad:
        assert torch.equal(layer.bias.grad, ref_b.grad), label


def check_model_step(managed: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor, label: str) -> None:
    """One training step's math of a managed model against its unmanaged copy on `x`: the output, the input
    gradient and every parameter gradient are the same bits (the gradients are cleared after)."""
    xr, xm = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    out_m, out_r = managed(xm), reference(xr)
    assert torch.equal(out_m, out_r), label
    out_m.float().square().sum().backward()
    out_r.float().square().sum().backward()
    mm.sync_grad_transfers()
    assert torch.equal(xm.grad, xr.grad), label
    for got, want in zip(managed.parameters(), reference.parameters()):
        if want.grad is not None:
            assert torch.equal(got.grad.to(want.grad.device), want.grad), label
        got.grad = want.grad = None


def start_fuzz(engine: str, monkeypatch, host_dtype: str, seed: int, faults: str):
    """The fuzz tests' setting: the simulator's fault injector (`faults` is its seed), a 1 MiB ring, the
    host storage `host_dtype`, fresh device states; returns the schedule's random source."""
    import random

    import pytest
    from conftest import clear_device_states

    if engine != "sim":
        pytest.skip("the fault injector is the simulator's")
    monkeypatch.setenv("LAYERSTREAM_SIM_FAULTS", faults)
    monkeypatch.setenv("LAYERSTREAM_RING_MB", "1")
    monkeypatch.setenv("LAYERSTREAM_HOST_DTYPE", host_dtype)
    clear_device_states()
    torch.manual_seed(seed)
    return random.Random(seed)
