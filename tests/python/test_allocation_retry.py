"""The elastic budget's borrowed memory comes back to any tensor allocation that needs it (issue 45): torch's
CUDA allocator is wrapped (src/torch/cuda_allocation_retry.cc), and an allocation that runs out of memory while
layers are resident gives them back and is tried again, between steps and inside them.

The wrapper must delegate every virtual function of torch's allocator interface, or a feature would silently
take the base class's default: the first test reads the headers of the torch installed here (CPU builds ship
them too) and fails on one the wrapper does not override. The GPU cases run where there is a GPU."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from layerstream import manager_modules as mm
from test_vram_elastic import _on_a_capped_gpu

MiB = 1 << 20
SOURCE = Path(__file__).resolve().parents[2] / "src" / "torch" / "cuda_allocation_retry.cc"
INCLUDE = Path(torch.__file__).parent / "include"
# The class bodies whose virtual functions the wrapper overrides: (header, class name).
INTERFACES = [("c10/core/Allocator.h", "Allocator"),
              ("c10/core/CachingDeviceAllocator.h", "DeviceAllocator"),
              ("c10/cuda/CUDACachingAllocator.h", "CUDAAllocator")]


def _class_body(text: str, name: str) -> str:
    match = re.search(r"^(?:class|struct) (?:C10_\w+ )?" + name + r"\b[^;{]*\{", text, re.M)
    assert match, f"no class {name}"
    depth, i = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[match.end():i]


def _virtuals(body: str) -> set[str]:
    body = re.sub(r"//[^\n]*", "", body)
    names = set()
    for decl in re.findall(r"\bvirtual\b([^;{]*)", body):
        found = re.search(r"(~?\w+)\s*\(", decl)
        if found and not found.group(1).startswith("~"):
            names.add(found.group(1))
    return names


def _torch_minor() -> int:
    return int(torch.__version__.split(".")[1])


def test_the_wrapper_delegates_every_virtual_function_of_the_installed_torchs_allocator():
    if not (INCLUDE / "c10/cuda/CUDACachingAllocator.h").is_file():
        pytest.skip(f"torch {torch.__version__} ships no c10/cuda headers")
    if not (torch.__version__.startswith("2.") and 11 <= _torch_minor() <= 13):
        pytest.skip(f"the wrapper is built for torch 2.11-2.13 only, not {torch.__version__}")
    wanted = set()
    for header, name in INTERFACES:
        wanted |= _virtuals(_class_body((INCLUDE / header).read_text(), name))
    source = SOURCE.read_text()
    overridden = set(re.findall(r"(\w+)\([^()]*(?:\([^()]*\)[^()]*)*\)\s*(?:const\s*)?override", source))
    # Base-class helpers with no state of their own (Allocator's clone/raw_allocate are not virtual); the
    # reporting interface (MemoryReportingInfoBase) is another class.
    missing = sorted(wanted - overridden)
    assert not missing, f"torch {torch.__version__}: the wrapper does not delegate {missing}"
    assert {"allocate", "raw_alloc", "emptyCache", "name"} <= overridden


def test_the_parser_sees_a_virtual_function_the_wrapper_lacks():
    """The parity check above can fail: a made-up interface with one more virtual is reported."""
    body = _class_body("class C10_API Fake : public X {\n virtual void allocate(size_t n) = 0;\n"
                       " virtual int brandNew(int a,\n int b) {}\n virtual ~Fake() = default;\n};\n", "Fake")
    assert _virtuals(body) == {"allocate", "brandNew"}


def test_an_allocation_larger_than_all_that_is_free_between_steps_gets_the_resident_layers_memory(
        engine, device, monkeypatch, caplog):
    """Between steps, with more free than the quarter the plan keeps, the user asks at once for all that is
    free and half the resident layers' bytes more (the case that ran out of memory before: the free-memory
    callback is not told the size, and saw no pressure). The allocation is made, the budget plans again, and the
    losses stay the all-resident run's."""
    with _on_a_capped_gpu(engine, monkeypatch, share=0.7) as gpu:
        state, cap, held = gpu.state, gpu.cap, gpu.held
        made = []

        def between(step):
            if step == 3:
                resident_bytes = state.stats()["resident_bytes"]
                assert resident_bytes > gpu.weights // 2, (resident_bytes, gpu.weights)
                assert mm._testing.allocation_retry_installed()
                retries = mm._testing.allocation_retries()
                room = cap - torch.cuda.memory_allocated(gpu.device)
                held.append(torch.empty(room + resident_bytes // 2, dtype=torch.uint8, device=gpu.device))
                made.append(mm._testing.allocation_retries() - retries)
            if step == 5:
                held.clear()

        with caplog.at_level(logging.INFO, logger="layerstream"):
            losses = gpu.run(gpu.managed, between)
        assert losses == gpu.ref
        assert made == [1]
        assert state.stats()["pressure_yields"] >= 1


def test_an_allocation_inside_a_forward_larger_than_the_plans_headroom_is_made(engine, device, monkeypatch):
    """Inside a step (a forward hook of the fifth block, as a large attention buffer would), an allocation of
    everything free and a quarter of the resident bytes more: made after a yield, freed at once, and the step's
    losses stay the all-resident run's."""
    with _on_a_capped_gpu(engine, monkeypatch, share=0.7) as gpu:
        state, cap = gpu.state, gpu.cap
        made = []
        steps = []

        def big_buffer(module, args):
            if len(steps) == 4 and not made:
                resident_bytes = state.stats()["resident_bytes"]
                room = cap - torch.cuda.memory_allocated(gpu.device)
                retries = mm._testing.allocation_retries()
                buf = torch.empty(room + resident_bytes // 4, dtype=torch.uint8, device=gpu.device)
                made.append((mm._testing.allocation_retries() - retries, state.stats()["pressure_yields"]))
                del buf

        block = [m for m in gpu.managed.modules() if isinstance(m, torch.nn.Linear)][20]
        hook = block.register_forward_pre_hook(big_buffer)
        try:
            losses = gpu.run(gpu.managed, lambda step: steps.append(step))
        finally:
            hook.remove()
        assert losses == gpu.ref
        assert len(made) == 1 and made[0][0] == 1 and made[0][1] >= 1, made


def test_an_allocation_that_cannot_fit_even_without_resident_layers_still_raises(engine, device, monkeypatch):
    """More than the cap itself: the layers are given back, the retry fails too, and torch's own
    out-of-memory error reaches the caller; training then goes on with the same losses."""
    with _on_a_capped_gpu(engine, monkeypatch, share=0.7) as gpu:
        cap = gpu.cap
        raised = []

        def between(step):
            if step == 3:
                try:
                    torch.empty(cap + 64 * MiB, dtype=torch.uint8, device=gpu.device)
                except torch.OutOfMemoryError as e:
                    raised.append(type(e).__name__)

        losses = gpu.run(gpu.managed, between)
        assert raised == ["OutOfMemoryError"]
        assert losses == gpu.ref
