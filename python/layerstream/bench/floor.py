"""The floor breakdown of a training step: how long the copy engine copied to the device, how long the GPU
computed and how long both at once, from one more step under torch.profiler's CUDA activity (CUPTI's own
timestamps of every kernel and copy of the process, layerstream's streams included); then the gap between
that step and its floor, max(compute, bytes / bandwidth), item by item, the items summing to the gap.

The step's wall time W splits exactly into four parts: copies and kernels at once (O), copies alone (the GPU
idle), kernels alone (the bus idle) and neither. Compute-bound (the floor is the compute time C), the gap
W - C is: compute kernels above C, layerstream's decode kernels where no other kernel ran, copies alone (the GPU
waiting for them), the allocator's cudaMalloc/cudaFree and the rest of neither (host, launches, syncs).
Bus-bound (the floor is bytes / bandwidth B), the gap W - B is: copy-engine time above B (copies slower than
the measured bandwidth), kernels alone (the bus idle while the GPU computes; decodes apart), the allocator and
the rest. Off CUDA nothing is measured: the row says "not measured: no CUDA"."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from .measure import _sync

Span = tuple[float, float]

NOT_MEASURED = "not measured: no CUDA"
# layerstream's kernels that rebuild a stored weight (src/core/*.cu): the decode, not the model's compute.
DECODE_KERNELS = ("decode_values", "patch_exceptions", "dequant_wide", "dequant_scalar", "decode_uintx",
                  "decode_codebook", "decode_nvfp4", "decode_int_rows")
ALLOCATOR_CALLS = ("cudaMalloc", "cudaFree")


def union(spans: list[Span]) -> list[Span]:
    """The union of (start, end) spans, sorted and merged."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(spans: list[Span]) -> float:
    return sum(end - start for start, end in union(spans))


def overlap(a: list[Span], b: list[Span]) -> float:
    """How long the unions of `a` and `b` cover at once."""
    a, b = union(a), union(b)
    covered, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            covered += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return covered


def subtract(a: list[Span], b: list[Span]) -> list[Span]:
    """The parts of the union of `a` that the union of `b` does not cover."""
    out: list[Span] = []
    b = union(b)
    for start, end in union(a):
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out


def is_decode(kernel_name: str) -> bool:
    return "layerstream::" in kernel_name and any(f"{k}(" in kernel_name for k in DECODE_KERNELS)


def spans_of_trace(events: list[dict]) -> dict:
    """The chrome trace's device activity in ms: host-to-device copies (and their bytes), compute kernels,
    layerstream's decode kernels, and the host calls of the allocator (None where the trace has no runtime
    calls at all)."""
    out: dict = {"copies": [], "copy_bytes": 0, "compute": [], "decode": [], "allocator": None}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]) / 1e3, (float(e["ts"]) + float(e["dur"])) / 1e3)
        name, cat = e.get("name", ""), e.get("cat")
        if cat == "gpu_memcpy" and "HtoD" in name:
            out["copies"].append(span)
            out["copy_bytes"] += int((e.get("args") or {}).get("bytes", 0))
        elif cat == "kernel":
            out["decode" if is_decode(name) else "compute"].append(span)
        elif cat == "cuda_runtime":
            out["allocator"] = out["allocator"] or []
            if name in ALLOCATOR_CALLS:
                out["allocator"].append(span)
    return out


def summarize(spans: dict, wall_ms: float) -> dict:
    """The step's busy times in ms (see the module's note), from spans_of_trace()."""
    copies, compute, decode = spans["copies"], spans["compute"], spans["decode"]
    kernels = compute + decode
    decode_alone = subtract(decode, compute)  # decodes where no other kernel ran
    copy_busy, kernel_busy, both = total(copies), total(kernels), overlap(copies, kernels)
    allocator = spans["allocator"]
    return {
        "wall_ms": wall_ms, "copy_busy_ms": copy_busy, "kernel_busy_ms": kernel_busy,
        "compute_ms": total(compute), "decode_ms": total(decode_alone), "both_ms": both,
        "copy_only_ms": copy_busy - both, "kernel_only_ms": kernel_busy - both,
        "decode_bus_idle_ms": total(decode_alone) - overlap(decode_alone, copies),
        "neither_ms": wall_ms - (copy_busy + kernel_busy - both),
        "allocator_ms": None if allocator is None else total(allocator),
        "copy_bytes": spans["copy_bytes"], "copies": len(copies), "kernels": len(kernels),
    }


def breakdown(activity: dict | None, h2d_bytes_per_s: float | None, compute_s: float | None,
              step_mean_s: float | None = None, mean_bytes: float | None = None) -> dict:
    """The floor of the profiled step and its gap item by item (ms). `compute_s`: the resident run's step
    (None: this step's compute kernels). The floor's bus time is the step's own copied bytes at the measured
    pinned bandwidth; where the trace gave copies without their sizes, the timed steps' `mean_bytes`."""
    if activity is None:
        return {"status": NOT_MEASURED}
    if not h2d_bytes_per_s:
        return {"status": "not measured: no host-to-device bandwidth"}
    a = activity
    compute_from = "the resident run" if compute_s is not None else "this step's kernels"
    compute_ms = compute_s * 1e3 if compute_s is not None else a["compute_ms"]
    moved, bus_from = a["copy_bytes"], "the profiled step's copies"
    if a["copies"] and not moved and mean_bytes:
        moved, bus_from = mean_bytes, "the timed steps' mean bytes"
    bus_ms = moved / h2d_bytes_per_s * 1e3
    floor_ms = max(compute_ms, bus_ms)
    neither = a["neither_ms"]
    allocator = None if a["allocator_ms"] is None else min(a["allocator_ms"], max(neither, 0.0))
    if compute_ms >= bus_ms:
        items = [("compute kernels above the floor's compute", a["compute_ms"] - compute_ms),
                 ("decode kernels, no other kernel running", a["decode_ms"]),
                 ("un-overlapped copies: the GPU idle, waiting for them", a["copy_only_ms"])]
    else:
        items = [("copy engine busy above bytes / bandwidth", a["copy_busy_ms"] - bus_ms),
                 ("un-overlapped compute: the bus idle while kernels run",
                  a["kernel_only_ms"] - a["decode_bus_idle_ms"]),
                 ("decode kernels, the bus idle", a["decode_bus_idle_ms"])]
    items.append(("allocator: cudaMalloc and cudaFree", allocator))
    items.append(("other: neither busy (host, launches, syncs)", neither - (allocator or 0.0)))
    out = {"status": "ok", "copy_busy_ms": a["copy_busy_ms"], "kernel_busy_ms": a["kernel_busy_ms"],
           "both_ms": a["both_ms"], "decode_ms": a["decode_ms"],
           "bound": "compute" if compute_ms >= bus_ms else "bus", "compute_ms": compute_ms, "bus_from": bus_from,
           "compute_from": compute_from, "bus_ms": bus_ms, "floor_ms": floor_ms, "step_ms": a["wall_ms"],
           "gap_ms": a["wall_ms"] - floor_ms, "items": [{"item": k, "ms": v} for k, v in items]}
    if step_mean_s is not None:
        out["timed_mean_minus_profiled_ms"] = step_mean_s * 1e3 - a["wall_ms"]
    return out


def profile_step(step, device: torch.device) -> tuple[dict, dict] | None:
    """Runs `step` once under torch.profiler's CUDA activity: (summarize()'s figures, the raw spans in ms from
    the step's first device activity, for a timeline), or None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device activity only: a small trace
        t0 = time.perf_counter()
        step()
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    spans = spans_of_trace(events)
    device_spans = spans["copies"] + spans["compute"] + spans["decode"]
    if not device_spans:
        return None
    t_first = min(s for s, _ in device_spans)
    shifted = {k: [(s - t_first, e - t_first) for s, e in spans[k]] for k in ("copies", "compute", "decode")}
    return summarize(spans, wall_ms), shifted


def describe(name: str, b: dict, wait_ms: float | None = None) -> str:
    """One row's breakdown as printed under the table."""
    if b.get("status") != "ok":
        return f"  {name}: {b.get('status')}"
    items = "; ".join(f"{i['item']} {'-' if i['ms'] is None else format(i['ms'], '.0f')}" for i in b["items"])
    line = (f"  {name}: profiled step {b['step_ms']:.0f} ms: copy engine busy {b['copy_busy_ms']:.0f} ms, kernels "
            f"{b['kernel_busy_ms']:.0f} ms (decodes alone {b['decode_ms']:.0f}), both at once {b['both_ms']:.0f} ms; "
            f"floor {b['floor_ms']:.0f} ms ({b['bound']}-bound: "
            f"compute {b['compute_ms']:.0f} from {b['compute_from']}, bus {b['bus_ms']:.0f}); gap "
            f"{b['gap_ms']:.0f} ms = {items}")
    if b.get("timed_mean_minus_profiled_ms") is not None:
        line += f"; the timed steps' mean is {b['timed_mean_minus_profiled_ms']:+.0f} ms from the profiled step"
    if wait_ms is not None:
        line += f"; layerstream's own count of compute waiting for copies: {wait_ms:.0f} ms/step"
    return line
