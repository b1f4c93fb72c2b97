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
import shutil
import sys
from pathlib import Path

# torchao's compiled kernels need CUDA libraries; on CPU-only machines skip loading them quietly.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest
import torch

from layerstream import manager_modules as mm
from layerstream.aitk import import_toolkit


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


def triton_c_compiler() -> str | None:
    """The C compiler Triton builds each kernel's launcher with (its runtime/build.py: $CC, else gcc, else
    clang), or None where it would find none."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def skip_unless_triton_can_build(what: str) -> None:
    """AI-Toolkit's convrot and nvfp4 kernels on CUDA are Triton kernels; without a C compiler Triton stops at
    their first launch ("Failed to find C compiler"), under stock AI-Toolkit alike. Such cases skip with the
    reason (the release-wheel run on a GPU runs them again with gcc on PATH)."""
    if triton_c_compiler() is None:
        pytest.skip(f"{what} runs AI-Toolkit's Triton kernels, and Triton needs a C compiler to build their "
                    "launchers: none on PATH (install gcc or set CC); stock AI-Toolkit cannot run them either")


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


# AI-Toolkit's own Python environment (scripts/aitk_venv.sh), for the tests that start its run.py.
AITK_STUBS = Path(__file__).resolve().parents[1] / "aitk_stubs"
AITK_VENV = os.environ.get("AITK_JOBS_VENV", "")
AITK_PYTHON = Path(AITK_VENV) / "bin" / "python"


def aitk_jobs_skip_reason() -> str | None:
    """Why the run.py tests cannot run here, or None: they need a checkout and AI-Toolkit's environment."""
    if not aitk_dirs():
        return "needs a real AI-Toolkit checkout: set AI_TOOLKIT_DIR"
    if not AITK_VENV or not AITK_PYTHON.is_file():
        return ("needs AI-Toolkit's Python environment: make one with scripts/aitk_venv.sh DIR and set "
                "AITK_JOBS_VENV=DIR")
    return None


def torchao_codes_and_scale(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scale torchao keeps for a float8 weight: an AffineQuantizedTensor with the Float8Layout
    (torchao 0.10, AI-Toolkit's pin, to 0.1x) keeps them in its tensor_impl, a Float8Tensor (since) itself."""
    if hasattr(weight, "tensor_impl"):
        return weight.tensor_impl.float8_data, weight.tensor_impl.scale
    return weight.qdata, weight.scale


def block_bytes(*tensors: torch.Tensor) -> int:
    """The size of the arena block layerstream packs `tensors` into, one after another as stored: each
    starts at a 256-byte boundary, the block ends with the last one."""
    end = 0
    for t in tensors:
        end = (end + 255) // 256 * 256 + t.numel() * t.element_size()
    return end


# toolkit/util files of AI-Toolkit's OstrisLinear backends (27a03a91 has all of them, 323b4aaf none).
OSTRIS_BACKEND_FILES = ("uintx_quant", "convrot_quant", "nvfp4_quant", "orbit_quant", "orbit_vq_quant")
_ostris_loaded: dict[str, dict] = {}


def _swap_toolkit(modules: dict) -> dict:
    """Puts `modules` (name: module) in place of the `toolkit` package in sys.modules; returns the one there."""
    before = {n: m for n, m in sys.modules.items() if n == "toolkit" or n.startswith("toolkit.")}
    for name in before:
        del sys.modules[name]
    sys.modules.update(modules)
    return before


class OstrisToolkit:
    """AI-Toolkit's OstrisLinear code of one checkout (toolkit/util/ostris_quant.py and the backends it has),
    imported once per process: the backends' module caches (OrbitVQ's lattice codebooks, ConvRot's
    rotations) are built once, and other checkouts' `toolkit` may be imported in between."""

    def __init__(self, aitk_dir: str):
        util = Path(aitk_dir) / "toolkit" / "util"
        if not (util / "ostris_quant.py").is_file():
            pytest.skip(f"{aitk_dir}: this AI-Toolkit version has no OstrisLinear (toolkit/util/ostris_quant.py)")
        if aitk_dir not in _ostris_loaded:
            files = [f for f in OSTRIS_BACKEND_FILES if (util / f"{f}.py").is_file()]
            import_toolkit(aitk_dir, "toolkit.util.ostris_quant", *(f"toolkit.util.{f}" for f in files))
            _ostris_loaded[aitk_dir] = _swap_toolkit({})
        self.aitk_dir = aitk_dir
        self.modules = _ostris_loaded[aitk_dir]
        self.ostris = self.modules["toolkit.util.ostris_quant"]

    def quantizer(self, qtype: str):
        """get_ostris_quantizer(qtype) of this checkout (it imports its backends when called: this checkout's
        are put in place for the call); a skip where this version does not ship the qtype."""
        before = _swap_toolkit(self.modules)
        try:
            quantizer = self.ostris.get_ostris_quantizer(qtype)
        finally:
            _swap_toolkit(before)
        if quantizer is None:
            pytest.skip(f"{self.aitk_dir}: this AI-Toolkit version has no OstrisLinear backend for {qtype!r}")
        return quantizer
