"""Fixtures shared by the manager_modules tests.

``engine`` runs a test once per engine mode available here:
  * ``cpu``  - a CPU process device, computed on the CPU as upstream does (always);
  * ``sim``  - the same autograd functions driven through the transfer engine on the simulator (always);
  * ``cuda`` - the real thing (only where a GPU and a CUDA build exist; skipped with the reason).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys

# torchao's compiled kernels need CUDA libraries; on CPU-only machines skip loading them quietly.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest
import torch

from layerstream import manager_modules as mm


@pytest.fixture(autouse=True)
def deadline():
    """No test may hang: past LAYERSTREAM_TEST_DEADLINE_S seconds (default 600; 0 turns it off, e.g. under
    a slow sanitizer) every thread's stack is printed and the run exits with a failure."""
    seconds = float(os.environ.get("LAYERSTREAM_TEST_DEADLINE_S", "600"))
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    yield
    if seconds > 0:
        faulthandler.cancel_dump_traceback_later()


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def clear_device_states():
    """Drops every device state (as deleting `_DEVICE_STATE` keys does in manager.py) and collects what is left."""
    for key in list(mm._DEVICE_STATE):
        del mm._DEVICE_STATE[key]
    gc.collect()


@pytest.fixture(params=["cpu", "sim", "cuda"])
def engine(request, monkeypatch):
    mode = request.param
    if mode == "cuda":
        reason = _cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    monkeypatch.setenv("LAYERSTREAM_BACKEND", "sim" if mode == "sim" else "cpu")
    clear_device_states()
    yield mode
    mm.sync_grad_transfers()
    # The simulator's race checker watched every copy and every read of the test: none may be unordered.
    assert mm.stats()["sim_races"] == 0
    clear_device_states()


@pytest.fixture
def device(engine):
    return torch.device("cuda") if engine == "cuda" else torch.device("cpu")


def deterministic_cudnn(engine: str, monkeypatch) -> None:
    """CUDA cases that compare convolutions bitwise: cuDNN may otherwise pick a nondeterministic algorithm
    per call (the same call twice can differ)."""
    if engine == "cuda":
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)


def aitk_dirs() -> list[str]:
    """AI_TOOLKIT_DIR may name one checkout, or several separated by os.pathsep."""
    value = os.environ.get("AI_TOOLKIT_DIR", "")
    return [p for p in value.split(os.pathsep) if p]


def torchao_codes_and_scale(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scale torchao keeps for a float8 weight: an AffineQuantizedTensor with the Float8Layout
    (torchao 0.10, AI-Toolkit's pin, to 0.1x) keeps them in its tensor_impl, a Float8Tensor (since) itself."""
    if hasattr(weight, "tensor_impl"):
        return weight.tensor_impl.float8_data, weight.tensor_impl.scale
    return weight.qdata, weight.scale
