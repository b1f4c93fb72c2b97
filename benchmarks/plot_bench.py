#!/usr/bin/env python3
"""Plots of `layerstream bench` results (the JSON written with --json-out): step time per mode against the
floor, and the memory each mode holds (peak VRAM, pinned host bytes, weight bytes). One PNG per input file.

    python benchmarks/plot_bench.py benchmarks/data/flux1-all-2026-11-29.json [--out docs/flux1-bench.png]

Needs matplotlib (`pip install matplotlib`); nothing else in layerstream does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GiB = 2**30
COLORS = {"resident": "#7f7f7f", "stock": "#d62728", "layerstream": "#1f77b4"}


def plot(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    meta = data.get("meta", {})
    rows = [r for r in data["results"] if r.get("status") == "ok"]
    if not rows:
        raise SystemExit(f"{path}: no successful rows to plot")
    labels = [r["mode"] for r in rows]
    colors = [COLORS.get(m, "#2ca02c") for m in labels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    means = [r["s_per_step_mean"] for r in rows]
    left.bar(labels, means, color=colors)
    top = max(max(means), max(r.get("floor_s") or 0 for r in rows))
    left.set_ylim(0, top * 1.25)  # room for the labels and the legend above the bars
    for i, r in enumerate(rows):
        left.text(i, max(means[i], r.get("floor_s") or 0) + top * 0.01, f"{means[i]:.3f}", ha="center",
                  va="bottom", fontsize=9)
        if r.get("floor_s"):
            left.hlines(r["floor_s"], i - 0.4, i + 0.4, colors="black", linestyles="dashed",
                        label="floor max(compute, bytes/bandwidth)" if i == 0 else None)
    left.set_ylabel("seconds per training step (mean)")
    left.set_title("step time (lower is better)")
    left.legend(loc="upper left", fontsize=8)

    width = 0.27
    xs = range(len(rows))
    vram = [r.get("peak_vram_allocated_bytes", 0) / GiB for r in rows]
    pinned = [(r.get("pinned_bytes") or 0) / GiB for r in rows]
    weights = [r.get("weight_bytes", 0) / GiB for r in rows]
    right.bar([x - width for x in xs], vram, width, label="peak VRAM allocated", color="#9467bd")
    right.bar(list(xs), pinned, width, label="pinned host memory", color="#ff7f0e")
    right.bar([x + width for x in xs], weights, width, label="weights (bf16)", color="#bcbd22")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("GiB")
    right.set_title("memory held")
    right.set_ylim(0, max(vram + pinned + weights) * 1.3)
    right.legend(fontsize=8, loc="upper left")

    config = meta.get("config", {})
    title = (f"{meta.get('preset', '?')}: {config.get('double_blocks', '?')}+{config.get('single_blocks', '?')} "
             f"blocks, hidden {config.get('hidden', '?')}, LoRA rank {meta.get('rank', '?')}, "
             f"checkpointing {meta.get('checkpointing', '?')} - {meta.get('gpu', '?')}, {meta.get('date', '?')[:10]}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="output PNG (only with one input; default: beside the JSON)")
    args = parser.parse_args()
    if args.out and len(args.json) > 1:
        parser.error("--out takes one input file")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_bench.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    for path in args.json:
        plot(path, args.out or path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
