"""One profiled step drawn: when the bus copied and when the GPU computed (floor.profile_step's spans)."""

from __future__ import annotations

from pathlib import Path

from .floor import union


def draw_timeline(activity: dict, spans: dict, png: Path, title: str) -> dict:
    """Draws copies against kernels (layerstream's decodes among them) over the profiled step into `png`, and
    returns the busy times in ms: copies, kernels, both at once, and the span of the step's device activity."""
    copies, kernels = spans["copies"], spans["compute"] + spans["decode"]
    busy_c, busy_k = union(copies), union(kernels)
    summary = {
        "span_ms": max(e for _, e in copies + kernels),
        "copy_busy_ms": activity["copy_busy_ms"], "kernel_busy_ms": activity["kernel_busy_ms"],
        "both_ms": activity["both_ms"], "copies": activity["copies"], "kernels": activity["kernels"],
        "png": str(png),
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
