"""Run by test_lossless_host_memory.py in a fresh process (its RSS is then this model's and nothing else's):
attaches a bfloat16 model of `--gib` GiB through AI-Toolkit's own manager.py (`--aitk DIR`; without it, through
contract_driver.py's ContractManager, which makes the calls manager.py makes, so that CI runs it too) with
LAYERSTREAM_HOST_DTYPE=lossless on the simulator, measures the process' resident memory at each step, and
checks that every path that reads the weights sees their exact values. Prints one JSON line.

RSS is read from /proc/self/status (VmRSS; VmHWM, the peak, reset through /proc/self/clear_refs before the
attach); freed heap memory is handed back to the system (malloc_trim) before each reading, so that a
reading is what the process holds, not what glibc kept for later."""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import os
import sys

import torch

_libc = ctypes.CDLL("libc.so.6")


def trim() -> None:
    gc.collect()
    _libc.malloc_trim(0)


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss() -> int:
    trim()
    return status("VmRSS")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def expected_weight(i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return (torch.randn(n, n, generator=g) * 0.02).to(torch.bfloat16)


def build(layers: int, n: int) -> torch.nn.Sequential:
    model = torch.nn.Sequential(*(torch.nn.Linear(n, n, bias=False, device="meta") for _ in range(layers)))
    for i, lin in enumerate(model):
        lin.weight = torch.nn.Parameter(expected_weight(i, n), requires_grad=False)
    return model


class ContractMemoryManager:
    """manager.py's MemoryManager surface that this worker calls (attach, detach, free, release_cached_memory)
    over contract_driver.ContractManager, for a machine without an AI-Toolkit checkout. Every layer is
    offloaded (the worker asks offload_percent 1.0 only)."""

    def __init__(self, mm):
        self.mm = mm

    def attach(self, module, device, offload_percent=1.0):
        from contract_driver import ContractManager

        assert offload_percent == 1.0, "the contract driver offloads every layer"
        ContractManager.attach(self.mm, module, device)

    def detach(self, module):
        module._memory_manager.detach()

    def free(self, module):
        module._memory_manager.free()

    def release_cached_memory(self):
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aitk", default=None, help="an AI-Toolkit checkout (else the contract driver)")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=8192)
    args = ap.parse_args()
    from layerstream import manager_modules as mm
    from layerstream.aitk import load_memory_management
    from layerstream.packed_weight import PackedWeight

    if args.aitk:
        memory_manager = load_memory_management(args.aitk, engine="layerstream").MemoryManager
    else:
        memory_manager = ContractMemoryManager(mm)
    out: dict = {"manager": "AI-Toolkit's manager.py" if args.aitk else "contract_driver.ContractManager"}
    n = args.n
    layers = max(1, round(args.gib * (1 << 30) / (n * n * 2)))
    weight_bytes = layers * n * n * 2
    out.update(weight_bytes=weight_bytes, layers=layers)
    checks: dict = {}

    base = rss()
    model = build(layers, n)
    with_weights = rss()
    reset_peak()
    memory_manager.attach(model, torch.device("cpu"), offload_percent=1.0)
    attach_peak = status("VmHWM")
    attached = rss()
    stats = mm.stats()
    out.update(rss_base=base, rss_with_weights=with_weights, rss_attached=attached, rss_attach_peak=attach_peak,
               host_pinned_packed_bytes=stats["host_pinned_packed_bytes"],
               host_pinned_plain_bytes=stats["host_pinned_plain_bytes"],
               host_pageable_bytes=stats["host_pageable_bytes"], host_bytes_requested=stats["host_bytes_requested"])
    checks["packed"] = all(type(lin.weight) is PackedWeight for lin in model)

    # The managed forward (the simulator decodes each streamed copy) against the plain math.
    x = (torch.randn(2, n, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16)
    with torch.no_grad():
        y = model(x)
        ref = x
        for i in range(layers):
            ref = torch.nn.functional.linear(ref, expected_weight(i, n))
    checks["forward"] = torch.equal(y, ref)
    out["rss_after_forward"] = rss()
    # The simulator's "device" memory (its ring) is host memory of this process: on a GPU it is VRAM.
    out["sim_device_bytes"] = mm.stats()["device_bytes"]

    # state_dict: every entry decoded on demand, exactly, and nothing decoded stays.
    sd = model.state_dict()
    checks["state_dict"] = all(torch.equal(sd[f"{i}.weight"], expected_weight(i, n)) for i in range(layers))
    del sd
    out["rss_after_state_dict"] = rss()

    # torch.save / torch.load (weights_only) of one layer: plain exact tensors.
    buf = io.BytesIO()
    torch.save(model[0].state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()))
    checks["save_load"] = type(loaded["weight"]) is torch.Tensor and torch.equal(loaded["weight"], expected_weight(0, n))
    del buf, loaded

    # Unfreeze the last layer and train it one step: exact values, a plain Parameter again (the same
    # object), and the gradient an unmanaged layer of the exact weight gets.
    last = model[layers - 1]
    param = last.weight
    param.requires_grad_(True)
    xg = x.clone()
    with torch.no_grad():
        for i in range(layers - 1):
            xg = model[i](xg)
    last(xg).float().square().mean().backward()
    mm.sync_grad_transfers()
    reference = torch.nn.Linear(n, n, bias=False, device="meta")
    reference.weight = torch.nn.Parameter(expected_weight(layers - 1, n))
    reference(xg).float().square().mean().backward()
    checks["unfreeze"] = (last.weight is param and type(param) is torch.nn.Parameter
                          and torch.equal(param, reference.weight) and torch.equal(param.grad, reference.weight.grad))
    param.grad = None
    param.requires_grad_(False)
    del param, xg, reference, last

    # AI-Toolkit's detach: every layer holds a plain Parameter of the exact values.
    memory_manager.detach(model)
    checks["detach"] = all(type(lin.weight) is torch.nn.Parameter and torch.equal(lin.weight, expected_weight(i, n))
                           for i, lin in enumerate(model))
    del model
    for key in list(mm._DEVICE_STATE):
        del mm._DEVICE_STATE[key]
    out["rss_after_detach_and_drop"] = rss()
    out["host_bytes_requested_after_drop"] = mm.stats()["host_bytes_requested"]

    # AI-Toolkit's free on a second, smaller model: nothing decoded, everything released.
    small = build(2, 2048)
    memory_manager.attach(small, torch.device("cpu"), offload_percent=1.0)
    before_free = mm.stats()
    memory_manager.free(small)
    for key in list(mm._DEVICE_STATE):
        del mm._DEVICE_STATE[key]
    memory_manager.release_cached_memory()
    after = mm.stats()
    checks["free"] = (before_free["host_pinned_packed_bytes"] > 0 and all(lin.weight.is_meta for lin in small)
                      and after["host_bytes_requested"] == 0 and after["host_pinned_packed_bytes"] == 0
                      and after["host_pinned_plain_bytes"] == 0 and after["host_pageable_bytes"] == 0)
    out["checks"] = checks
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("LAYERSTREAM_BACKEND", "sim")
    main()
