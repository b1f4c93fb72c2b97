#!/usr/bin/env python3
"""Predicts a training step's time on another card from what flux_bench measured (docs/users-cards.md).

The model, per phase (the forward; the backward with the optimizer) where the run recorded its phases, else for
the step as one phase:

    step = sum over phases of max(compute_p / compute_fraction, bytes_p / bus) + decode

- compute_p: the all-resident run's phase time (its phase split scaled to its mean step), on the measured GPU;
  compute_fraction: the card's bf16 compute as a fraction of that GPU's (0.2: a fifth of the H200's);
- bytes_p: the bytes the streamed row copied in that phase (its phase split scaled to its mean bytes per step);
  bus: the card's pinned host-to-device bandwidth (25 GB/s: PCIe Gen4 x16);
- decode: lossless rows only, the bytes decoded per step (each streamed copy once, each resident packed weight at
  each of its 3 uses with checkpointing) at the decode's measured rate (1.82e12 bf16 bytes/s alone on the H200,
  benchmarks/log.md, sixth session; a decode beside GEMMs lengthens them by its own time), scaled by the
  card's memory bandwidth against the H200's 4.8 TB/s.

`--gpu-itself` predicts the measured GPU's own rows from their inputs (compute_fraction 1, the run's measured
bandwidth, the H200's memory), so the error against the measured step says what the model leaves out. Usage:

    python3 benchmarks/users_card.py RUN.json [--reference-json RESIDENT.json] [--mode layerstream] \\
        [--card-gbs 25] [--card-compute 0.2] [--card-mem-tbs 1.0] [--gpu-itself]
    python3 benchmarks/users_card.py --check     # every recorded H200 pair in CHECKS, as docs/users-cards.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
GiB = 1 << 30
H200_MEM_TBS = 4.8
DECODE_BF16_BYTES_PER_S = 226.5e6 / 124.2e-6  # one 18432 x 6144 weight decoded alone in 124.2 us (H200)
PACKED_RATIO = 0.751  # lossless bytes / bf16 bytes on the FLUX shapes (docs/ai-toolkit.md)
USES_PER_STEP = 3  # forward, checkpointed recompute, backward

# (label, streamed run, mode, resident reference): H200 runs recorded in benchmarks/data, each with the
# resident run of the same preset and settings (not always the same machine start: docs/users-cards.md).
FLUX1_RES = "flux1-resident-layerstream-deep-ring-2026-11-30.json"
FLUX2_RES = "flux2-resident-2026-11-30.json"
CHECKS = [
    ("FLUX.1 100% streamed, stock", "flux1-min-ring-2026-12-01.json", "stock", FLUX1_RES),
    ("FLUX.1 100% streamed, plain (same), default ring", "flux1-min-ring-2026-12-01.json", "layerstream", FLUX1_RES),
    ("FLUX.1 100% streamed, lossless, default ring", "lossless-flux1-2026-12-01k.json", "layerstream", FLUX1_RES),
    ("FLUX.1 100% streamed, lossless, ring 504 MiB", "lossless-flux1-ring504-2026-12-03.json", "layerstream",
     FLUX1_RES),
    ("FLUX.1 24 GiB cap, stock", "flux1-cap24-counted-stock-2026-11-30.json", "stock", FLUX1_RES),
    ("FLUX.1 24 GiB cap, plain, budget", "flux1-cap24-counted-stock-2026-11-30.json", "layerstream", FLUX1_RES),
    ("FLUX.1 24 GiB cap, lossless, budget", "flux1-cap24-lossless-2026-11-30f.json", "layerstream", FLUX1_RES),
    ("FLUX.2 24 GiB cap, plain, budget", "flux2-cap24-plan-2026-11-30e.json", "layerstream", FLUX2_RES),
    ("FLUX.2 24 GiB cap, lossless, budget", "flux2-cap24-lossless-2026-11-30e.json", "layerstream", FLUX2_RES),
]


def load(path: Path) -> tuple[dict, list[dict]]:
    data = json.loads(Path(path).read_text())
    return data.get("meta", {}), data["results"]


def pick(rows: list[dict], mode: str) -> dict | None:
    return next((r for r in rows if r.get("mode") == mode and r.get("status") == "ok"), None)


def phases_of(resident: dict, row: dict) -> list[tuple[float, float]]:
    """(compute s, bytes) per phase: forward and backward where both runs split their phases, else one."""
    ref, mine = resident.get("phases") or {}, row.get("phases") or {}
    moved = row.get("bytes_per_step") or 0.0
    if ref.get("forward_s") and mine.get("forward_bytes") is not None and mine.get("backward_bytes") is not None:
        scale_c = resident["s_per_step_mean"] / (ref["forward_s"] + ref["backward_s"])
        split = mine["forward_bytes"] + mine["backward_bytes"]
        scale_b = moved / split if split else 0.0
        return [(ref["forward_s"] * scale_c, mine["forward_bytes"] * scale_b),
                (ref["backward_s"] * scale_c, mine["backward_bytes"] * scale_b)]
    return [(resident["s_per_step_mean"], moved)]


def decoded_bytes(meta: dict, row: dict) -> float:
    """bf16 bytes decoded per step: lossless rows only (meta's host dtype, or packed bytes on the host)."""
    packed = (row.get("host_memory") or {}).get("host_pinned_packed_bytes") or 0
    if row.get("mode") != "layerstream" or not (meta.get("host_dtype") == "lossless" or packed > 0):
        return 0.0
    resident = (row.get("engine_stats") or {}).get("resident_bytes") or 0
    return ((row.get("bytes_per_step") or 0.0) + USES_PER_STEP * resident) / PACKED_RATIO


def predict(phases: list[tuple[float, float]], decoded: float, bus_bytes_per_s: float, compute_fraction: float,
            mem_tbs: float) -> dict:
    """The model (module docstring): the step, its compute and bus parts and the decode, in seconds."""
    compute = [c / compute_fraction for c, _ in phases]
    bus = [b / bus_bytes_per_s for _, b in phases]
    decode = decoded / (DECODE_BF16_BYTES_PER_S * mem_tbs / H200_MEM_TBS)
    step = sum(max(c, b) for c, b in zip(compute, bus)) + decode
    return {"step_s": step, "compute_s": sum(compute), "bus_s": sum(bus), "decode_s": decode,
            "bound": ["compute" if c >= b else "bus" for c, b in zip(compute, bus)]}


def one(run: Path, reference: Path | None, mode: str, args) -> dict:
    meta, rows = load(run)
    row = pick(rows, mode)
    if row is None:
        raise SystemExit(f"{run}: no finished {mode} row")
    resident = pick(rows, "resident") or (pick(load(reference)[1], "resident") if reference else None)
    if resident is None:
        raise SystemExit(f"{run}: no resident row; pass --reference-json with a resident run of the same preset")
    phases, decoded = phases_of(resident, row), decoded_bytes(meta, row)
    if args.gib_per_step is not None:  # a what-if: the row's phase split at another number of bytes per step
        moved = sum(b for _, b in phases)
        scale = args.gib_per_step * GiB / moved if moved else 0.0
        phases, decoded = [(c, b * scale) for c, b in phases], decoded * scale
    out = {"measured_s": row["s_per_step_mean"], "gib_per_step": (row.get("bytes_per_step") or 0) / GiB,
           "phases": len(phases)}
    if args.gpu_itself:
        out["gpu"] = predict(phases, decoded, meta["h2d_bytes_per_s"], 1.0, H200_MEM_TBS)
        out["error"] = out["gpu"]["step_s"] / row["s_per_step_mean"] - 1
    out["card"] = predict(phases, decoded, args.card_gbs * 1e9, args.card_compute, args.card_mem_tbs)
    return out


def check(args) -> None:
    """Every pair in CHECKS: the H200 predicted from its own inputs against the measured step, and the card."""
    args.gpu_itself, args.gib_per_step = True, None
    print(f"card: {args.card_gbs:g} GB/s, {args.card_compute:g}x the H200's bf16 compute, {args.card_mem_tbs:g} TB/s "
          "memory (predictions)")
    print("| run | GiB/step | H200 measured s/step | H200 predicted (error) | card predicted s/step "
          "(compute / bus / decode) |")
    print("|---|---|---|---|---|")
    for label, run, mode, ref in CHECKS:
        o = one(DATA / run, DATA / ref, mode, args)
        g, c = o["gpu"], o["card"]
        print(f"| {label} | {o['gib_per_step']:.2f} | {o['measured_s']:.3f} | {g['step_s']:.3f} ({o['error']:+.0%}) "
              f"| {c['step_s']:.2f} ({c['compute_s']:.2f} / {c['bus_s']:.2f} / {c['decode_s']:.2f}) |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", nargs="?", type=Path, help="a flux_bench --json-out file")
    p.add_argument("--reference-json", type=Path, help="the resident run, where RUN has none")
    p.add_argument("--mode", default="layerstream", help="the row to predict (layerstream, stock)")
    p.add_argument("--card-gbs", type=float, default=25.0, help="the card's pinned H2D GB/s (PCIe Gen4 x16: 25)")
    p.add_argument("--card-compute", type=float, default=0.2, help="the card's bf16 compute / the measured GPU's")
    p.add_argument("--card-mem-tbs", type=float, default=1.0, help="the card's memory bandwidth, TB/s")
    p.add_argument("--gpu-itself", action="store_true", help="also predict the measured GPU's own row")
    p.add_argument("--gib-per-step", type=float,
                   help="what if the row copied this many GiB per step (its phase split kept): a prediction")
    p.add_argument("--check", action="store_true", help="the recorded H200 pairs (CHECKS)")
    args = p.parse_args(argv)
    if args.check:
        check(args)
        return 0
    if args.run is None:
        p.error("give a flux_bench JSON or --check")
    print(json.dumps(one(args.run, args.reference_json, args.mode, args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
