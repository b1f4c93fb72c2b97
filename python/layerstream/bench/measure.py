"""Measurements: the device's energy counter (NVML), peak host RSS, pinned host-to-device bandwidth, and the
timing of one step and of its two phases."""

from __future__ import annotations

import os
import time

import torch

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Nvml:
    """The GPU's energy counter (NVML, millijoules since the driver loaded), read through ctypes so that no
    Python package is needed. None where NVML or the counter is missing (older GPUs, no driver)."""

    def __init__(self, index: int):
        import ctypes

        self._ctypes = ctypes
        self.handle = None
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            handle = ctypes.c_void_p()
            # NVML numbers GPUs as the driver does; torch's index matches unless CUDA_VISIBLE_DEVICES reorders.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
                self.handle = handle
        except (OSError, ValueError, AttributeError):
            self.handle = None

    def energy_mj(self) -> int | None:
        if self.handle is None:
            return None
        value = self._ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, self._ctypes.byref(value)) != 0:
            return None
        return value.value


def use_deterministic_kernels() -> None:
    """Deterministic kernels, so that two runs' losses can be compared bitwise. Strict: under warn_only the
    attention backends keep their nondeterministic backward (seen on the H200: "cuDNN Attention defaults to a
    non-deterministic algorithm", then the same of Flash Attention, and two all-resident runs of AI-Toolkit's flow
    gave different losses); an op with no deterministic kernel raises. CUBLAS_WORKSPACE_CONFIG is set before
    cuBLAS starts (it reads it at its first handle); children inherit it through the environment."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)


# The process's peak resident set size when reset_peak_rss() last started VmHWM again (None: never reset).
_peak_before_reset: int | None = None


def _vm_hwm() -> int | None:
    """VmHWM, the kernel's own peak of this process's resident set (Linux), in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start the kernel's peak resident set size again from the current one (Linux: "5" to /proc/self/clear_refs
    resets VmHWM), so that peak_rss_since_reset_bytes() tells the peak from here on; peak_rss_bytes() still
    tells the process's. False where the platform cannot."""
    global _peak_before_reset
    before = _vm_hwm()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    _peak_before_reset = max(before or 0, _peak_before_reset or 0)
    return True


def peak_rss_since_reset_bytes() -> int | None:
    """The peak resident set size since the last reset_peak_rss() (None where there was none)."""
    return _vm_hwm() if _peak_before_reset is not None else None


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process, resets of VmHWM included.

    VmHWM first: the kernel tracks the true peak there. psutil has no peak RSS on Linux (memory_info().rss is
    the current value), so it is only the fallback elsewhere (peak_wset on Windows).
    """
    hwm = _vm_hwm()
    if hwm is not None:
        return max(hwm, _peak_before_reset or 0)
    try:
        import psutil
    except ImportError:
        return None
    info = psutil.Process().memory_info()
    return getattr(info, "peak_wset", info.rss)


def measure_h2d_bytes_per_s(size: int = GiB, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of one pinned ``size``-byte tensor to the GPU, in bytes/s."""
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(repeats):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, size / (start.elapsed_time(end) / 1e3))
    return best


def phase_split(model, inputs, optimizer, sync_grads, device, stats) -> dict:
    """One more step (not timed), synchronized between its forward and its backward: how long each took and,
    where the engine reports them, the bytes each copied. With the resident run's phases this gives the
    floor per phase (a forward that waits for the bus cannot lend its idle GPU to the backward)."""
    def copied() -> int | None:
        s = stats() if stats is not None else None
        return None if s is None else s.get("bytes_h2d")

    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    b0, t0 = copied(), time.perf_counter()
    loss = model(*inputs).float().pow(2).mean()
    _sync(device)
    b1, t1 = copied(), time.perf_counter()
    loss.backward()
    if sync_grads is not None:
        sync_grads()
    optimizer.step()
    _sync(device)
    b2, t2 = copied(), time.perf_counter()
    both = None not in (b0, b1, b2)
    return {"forward_s": t1 - t0, "backward_s": t2 - t1,
            "forward_bytes": b1 - b0 if both else None, "backward_bytes": b2 - b1 if both else None}


# torch's caching allocator's counters that say whether a step ran against the memory limit: a retry is an
# allocation that found no cached block and no room below the limit, so the allocator freed its cache
# (synchronizing the device) and tried again; device allocs and frees are cudaMalloc and cudaFree calls.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def allocator_counters(device: torch.device) -> dict | None:
    """ALLOCATOR_COUNTERS now (cumulative), None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def allocator_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the allocator did between two allocator_counters() readings."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in ALLOCATOR_COUNTERS}


def _timed(step, device: torch.device):
    """step() between two device synchronizations: (its result, wall seconds)."""
    _sync(device)
    t0 = time.perf_counter()
    result = step()
    _sync(device)
    return result, time.perf_counter() - t0
