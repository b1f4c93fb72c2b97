"""One step under torch.profiler: when the bus copied and when the GPU computed, drawn and summed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from .measure import _sync


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, sorted and merged."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def profile_timeline(step, device: torch.device, png: Path, title: str) -> dict:
    """Runs `step` once under torch.profiler (CUDA activity: every kernel and every copy of the process,
    layerstream's own streams included), draws copies against kernels over the step into `png`, and returns
    the busy times in ms: copies, kernels, both at once, and the step's span."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device activity only: a small trace
        step()
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]) / 1e3, (float(e["ts"]) + float(e["dur"])) / 1e3)  # ms
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append(span)
        elif e.get("cat") == "kernel":
            kernels.append(span)
    if not copies and not kernels:
        return {"error": "the profiler recorded no device activity"}
    t0 = min(s for s, _ in copies + kernels)
    copies = [(s - t0, e - t0) for s, e in copies]
    kernels = [(s - t0, e - t0) for s, e in kernels]
    busy_c, busy_k = _busy(copies), _busy(kernels)
    summary = {
        "span_ms": max(e for _, e in copies + kernels),
        "copy_busy_ms": sum(e - s for s, e in busy_c),
        "kernel_busy_ms": sum(e - s for s, e in busy_k),
        "both_ms": _overlap(busy_c, busy_k),
        "copies": len(copies), "kernels": len(kernels), "png": str(png),
    }
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(14, 2.6))
        ax.broken_barh([(s, e - s) for s, e in busy_k], (10, 8), color="tab:blue", label="GPU kernels")
        ax.broken_barh([(s, e - s) for s, e in busy_c], (0, 8), color="tab:orange", label="H2D copies")
        ax.set_yticks([4, 14], labels=["H2D copies", "kernels"])
        ax.set_xlabel("ms from the first device activity of the step")
        ax.set_title(f"{title}: one training step (copies busy {summary['copy_busy_ms']:.0f} ms, kernels busy "
                     f"{summary['kernel_busy_ms']:.0f} ms, both {summary['both_ms']:.0f} ms, span "
                     f"{summary['span_ms']:.0f} ms)", fontsize=9)
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=110)
        plt.close(fig)
    except ImportError:
        summary["png"] = None
    print(f"timeline: {summary}", flush=True)
    return summary
