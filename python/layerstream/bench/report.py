"""The floors (max of compute and bus time, per step and per phase) and the report: the stdout table, the JSON
and the markdown file."""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from . import floor, sweep
from .measure import GiB
from .presets import PRESETS


def reference_row(path: str | None) -> dict | None:
    """The resident row of an earlier run's --json-out (the same preset and settings, uncapped), for the
    floors of a run without one; a file without one is a ValueError."""
    if not path:
        return None
    rows = json.loads(Path(path).read_text())["results"]
    row = next((r for r in rows if r.get("mode") == "resident" and r.get("status") == "ok"), None)
    if row is None:
        raise ValueError(f"--reference-json {path}: no finished resident row in it; give the --json-out of a run "
                         "with --mode resident")
    return row


def add_floors(rows: list[dict], h2d_bytes_per_s: float | None, reference: dict | None = None) -> float | None:
    """Fill t_bus_s, floor_s and ratio_to_floor of each finished row; returns T_compute (None without a
    resident run, in `rows` or else `reference`: a resident row of an earlier run). The ratio uses the mean
    step time."""
    resident = next((r for r in rows if r["mode"] == "resident" and r["status"] == "ok"), reference)
    t_compute = resident["s_per_step_mean"] if resident else None
    for row in rows:
        if row["status"] != "ok":
            continue
        moved = row["bytes_per_step"]
        row["t_bus_s"] = moved / h2d_bytes_per_s if moved is not None and h2d_bytes_per_s else None
        bounds = [t for t in (t_compute, row["t_bus_s"]) if t is not None]
        row["floor_s"] = max(bounds) if bounds else None
        row["ratio_to_floor"] = row["s_per_step_mean"] / row["floor_s"] if row["floor_s"] else None
        row["phase_floor_s"] = phase_floor(resident, row, h2d_bytes_per_s)
        row["ratio_to_phase_floor"] = (row["s_per_step_mean"] / row["phase_floor_s"]
                                       if row["phase_floor_s"] else None)
        activity = row.get("floor_activity")
        row["floor_breakdown"] = (
            {"status": f"not measured: {activity['error']}"} if activity and "error" in activity
            else floor.breakdown(activity, h2d_bytes_per_s, t_compute, row["s_per_step_mean"], row["bytes_per_step"]))
    return t_compute


def phase_floor(resident: dict | None, row: dict, h2d_bytes_per_s: float | None) -> float | None:
    """max(compute, bus) per phase, summed: the resident run's forward and backward (optimizer included)
    times against the bytes this row copied in each. The forward is mostly copies with little compute and
    the backward the other way round, so this bound is above max(T_compute, bytes / bandwidth)."""
    ref, mine = (resident or {}).get("phases"), row.get("phases")
    if not ref or not mine or not h2d_bytes_per_s:
        return None
    if mine.get("forward_bytes") is None or mine.get("backward_bytes") is None:
        return None
    # The phase step's resident compute, scaled to the timed steps' mean (the extra synchronize and one
    # step's noise are not the steady state).
    scale = resident["s_per_step_mean"] / (ref["forward_s"] + ref["backward_s"])
    fwd, bwd = ref["forward_s"] * scale, ref["backward_s"] * scale
    return (max(fwd, mine["forward_bytes"] / h2d_bytes_per_s) +
            max(bwd, mine["backward_bytes"] / h2d_bytes_per_s))


_LIBRARY = {"qfloat8": "optimum-quanto", "qint8": "optimum-quanto", "float8": "torchao"}


def _library_version(name: str) -> str:
    """"torchao 0.10.0", or the name alone where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


def _from_attach(row: dict) -> str:
    """The peak RSS from the attach on, after the process's own, where it was measured."""
    value = row.get("peak_rss_from_attach_bytes")
    return "" if value is None else f" ({_fmt(value, GiB)})"


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def label(row: dict) -> str:
    """The row's name in the table: its mode, or a stock sweep run's offload_percent (the best one marked)."""
    return row.get("label", row["mode"]) + (" (best)" if row.get("stock_best") else "")


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| mode | s/step mean (min) | peak VRAM GiB alloc / reserved | peak RSS GiB (from attach) | pinned GiB (exact) "
        "| GiB/step over bus | floor s | x floor | phase floor s | x phase floor | J/step "
        "| compute waited for copies ms/step | first loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "oom":  # how far it got: the peaks at the failed allocation
            lines.append(f"| {label(r)} | {r['status']}: {r['reason']} "
                         f"| {_fmt(r['peak_vram_allocated_bytes'], GiB)} / {_fmt(r['peak_vram_reserved_bytes'], GiB)} "
                         f"| {_fmt(r['peak_rss_bytes'], GiB)} | | | | | | | | | |")
            continue
        if r["status"] != "ok":
            lines.append(f"| {label(r)} | {r['status']}: {r['reason']} | | | | | | | | | | | |")
            continue
        exact = "" if r["pinned_bytes_exact"] is None else f" ({_fmt(r['pinned_bytes_exact'], GiB)})"
        lines.append(
            f"| {label(r)} | {_fmt(r['s_per_step_mean'], digits=3)} ({_fmt(r['s_per_step_min'], digits=3)}) "
            f"| {_fmt(r['peak_vram_allocated_bytes'], GiB)} / {_fmt(r['peak_vram_reserved_bytes'], GiB)} "
            f"| {_fmt(r['peak_rss_bytes'], GiB)}{_from_attach(r)} | {_fmt(r['pinned_bytes'], GiB)}{exact} "
            f"| {_fmt(r['bytes_per_step'], GiB)} | {_fmt(r['floor_s'], digits=3)} "
            f"| {_fmt(r['ratio_to_floor'])} | {_fmt(r.get('phase_floor_s'), digits=3)} "
            f"| {_fmt(r.get('ratio_to_phase_floor'))} | {_fmt(r.get('joules_per_step'), digits=0)} "
            f"| {_fmt(r.get('copy_wait_ms_per_step'), digits=1)} | {r['losses'][0]:.6g} |"
        )
    return "\n".join(lines)


def report(args, rows: list[dict], h2d_bytes_per_s: float | None, t_compute: float | None) -> None:
    cfg = PRESETS[args.preset]
    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "preset": args.preset, "config": asdict(cfg), "checkpointing": args.checkpointing, "rank": args.rank,
        "lora_init_nonzero": args.lora_init_nonzero, "offload_percent": args.offload_percent,
        "host_dtype": args.host_dtype, "quantize": args.quantize,
        "vram_cap_gb": args.vram_cap_gb, "warmup": args.warmup, "steps": args.steps, "seed": args.seed,
        "h2d_bytes_per_s": h2d_bytes_per_s, "t_compute_s": t_compute,
    }
    if args.stock_sweep:
        meta["stock_sweep"] = args.stock_sweep
    if args.quantize:
        meta["quantize_library"] = _library_version(_LIBRARY[args.quantize])
    table = markdown_table(rows)
    summary = (
        f"pinned H2D: {_fmt(h2d_bytes_per_s, 1e9)} GB/s (1 GB = 1e9 B); T_compute: {_fmt(t_compute, digits=3)} s; "
        "floor = max(T_compute, bytes over the bus / bandwidth); phase floor = the same per phase (forward; "
        "backward with the optimizer), summed, from one more step synchronized between them; x floor uses the "
        "mean step time"
    )
    print()
    print(table)
    print(summary)
    best = sweep.summary(rows, args.vram_cap_gb)
    if best:
        print(best)
        summary += "\n\n" + best
    losses = "\n".join(f"  {label(r)}: {', '.join(f'{x:.6g}' for x in r['losses'])}"
                       for r in rows if r["status"] == "ok")
    if losses:
        print("losses per step (warmup included):\n" + losses)
    attach = "\n".join(f"  {label(r)}: {r['attach_s']:.1f} s" for r in rows
                        if r["status"] == "ok" and r.get("attach_s") is not None)
    if attach:
        attach = "MemoryManager.attach (resident: the move to the device):\n" + attach
        print(attach)
        losses += "\n\n" + attach
    samples = "\n".join(
        f"  {label(r)}: {r['samples_timed_window']} sample(s), {r['bytes_per_sample'] / GiB:.2f} GiB copied each"
        for r in rows if r["status"] == "ok" and r.get("samples_timed_window"))
    if samples:
        samples = ("--aitk-flow's no_grad samples among the timed steps (untimed; their bytes are not in GiB/step "
                   "or the floor):\n" + samples)
        print(samples)
        losses += "\n\n" + samples
    # The runs' notes, each printed and kept under the table when there is anything to say.
    for note in (floor_breakdowns(rows), budget_plans(rows),
                 bucket_times(rows, args.warmup, args.buckets) if args.aitk_flow else "", allocator_churn(rows),
                 stress_outcome(rows)):
        if note:
            print(note)
            losses += "\n\n" + note
    sweeps = "\n".join(
        f"  {r['mode']}, decode blocks {x['decode_blocks'] or 'all'}: {x['s_per_step_mean']:.3f} s/step (min "
        f"{x['s_per_step_min']:.3f}), forward {x['phases']['forward_s']:.3f} s, backward {x['phases']['backward_s']:.3f} s"
        for r in rows for x in r.get("decode_blocks_sweep") or [])
    if sweeps:
        print("decode blocks sweep (after the timed steps, same process):\n" + sweeps)
        losses += "\n\ndecode blocks sweep:\n\n" + sweeps
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str) + "\n")
    if args.md_out:
        quantized = f", weights quantized to {args.quantize} ({meta['quantize_library']})" if args.quantize else ""
        Path(args.md_out).write_text(
            f"# flux_bench: {args.preset}, mode {args.mode}\n\n"
            f"- command: `{meta['command']}`\n- date: {meta['date']}\n- GPU: {meta['gpu'] or 'none (CPU)'}\n"
            f"- torch: {meta['torch']}\n- config: {meta['config']}, checkpointing {args.checkpointing}, LoRA rank "
            f"{args.rank}, offload_percent {args.offload_percent}, VRAM cap {args.vram_cap_gb or 'none'} GiB"
            f"{f', stock swept over offload_percent {args.stock_sweep}' if args.stock_sweep else ''}"
            f"{f', layerstream host dtype {args.host_dtype}' if args.host_dtype else ''}"
            f"{quantized}\n\n"
            f"{table}\n\n{summary}\n\nlosses per step (warmup included):\n\n{losses}\n"
        )


def floor_breakdowns(rows: list[dict]) -> str:
    """One line per finished row: its s/step beside the floor breakdown of one more, profiled step (floor.py)."""
    lines = [floor.describe(f"{label(r)} ({r['s_per_step_mean']:.3f} s/step)", r["floor_breakdown"],
                            r.get("copy_wait_ms_per_step"))
             for r in rows if r.get("status") == "ok" and r.get("floor_breakdown")]
    return ("floor breakdown (one more step under the profiler; the items sum to the gap):\n" + "\n".join(lines)
            if lines else "")


def budget_plans(rows: list[dict]) -> str:
    """One line per row whose VRAM budget planned: its ring, what it kept resident, and its replay's estimate
    of the bytes per step beside the bytes measured."""
    lines = []
    for r in rows:
        s = r.get("engine_stats") or {}
        if r.get("status") != "ok" or not s.get("vram_budget_planned"):
            continue
        measured = r.get("bytes_per_step")
        lines.append(
            f"  {label(r)}: VRAM budget plan: ring {s.get('ring_bytes', 0) / 2**20:.1f} MiB, "
            f"{s.get('resident_layers', 0)} layers ({s.get('resident_bytes', 0) / 2**20:.1f} MiB) resident; "
            f"estimated {s.get('vram_budget_estimate', 0) / 2**20:.1f} MiB/step over the bus, measured "
            f"{'-' if measured is None else f'{measured / 2**20:.1f}'}"
            f"; yielded to memory pressure {s.get('pressure_yields', 0)} time(s), "
            f"{s.get('pressure_yielded_bytes', 0) / 2**20:.1f} MiB"
            + (f"; lent between steps {s['gap_lends']} time(s), {s.get('gap_lent_bytes', 0) / 2**20:.1f} MiB"
               if s.get("gap_lends") else ""))
    return "budget plans:\n" + "\n".join(lines) if lines else ""


def allocator_churn(rows: list[dict]) -> str:
    """One line per CUDA row: what torch's caching allocator did in the timed steps. Retries (an allocation
    that found no cached block and no room under the limit, so the allocator freed its cache, synchronizing the
    device, and tried again) say the steps ran against the cap, which costs time the bytes over the bus do not
    explain."""
    lines = []
    for r in rows:
        per_step = r.get("allocator_per_step") if r.get("status") == "ok" else None
        if not per_step:
            continue
        total = {k: sum(step[k] for step in per_step) for k in per_step[0]}
        lines.append(
            f"  {label(r)}: {total['num_alloc_retries']} retries, {total['num_device_alloc']} cudaMalloc, "
            f"{total['num_device_free']} cudaFree over {len(per_step)} timed steps (retries per step: "
            f"{', '.join(str(step['num_alloc_retries']) for step in per_step)})")
    return "torch's allocator in the timed steps:\n" + "\n".join(lines) if lines else ""


def stress_outcome(rows: list[dict]) -> str:
    """--stress-gb: per row, the user's allocations made between and inside steps and those that ran out of
    memory."""
    lines = []
    for r in rows:
        st = r.get("stress") if r.get("status") == "ok" else None
        if not st:
            continue
        made, oom = st["made"], st["out_of_memory"]
        lines.append(f"  {label(r)}: {made['between']} made / {oom['between']} out of memory between steps, "
                     f"{made['inside']} made / {oom['inside']} out of memory inside steps "
                     f"({', '.join(f'{g:g}' for g in st['sizes_gb'])} GiB in turn)")
    return "--stress-gb, the user's allocations:\n" + "\n".join(lines) if lines else ""


def bucket_times(rows: list[dict], warmup: int, buckets: list[float]) -> str:
    """--aitk-flow's timed steps by bucket (step k takes bucket k % len(buckets), the warm-up steps counted):
    the median and the fastest of each, one line per row. Runs compared bucket by bucket are less at the mercy
    of one slow step than their means."""
    if len(buckets) < 2:
        return ""
    lines = []
    for r in rows:
        times = r.get("step_times_s") if r.get("status") == "ok" else None
        if not times:
            continue
        parts = []
        for b, fraction in enumerate(buckets):
            mine = sorted(t for i, t in enumerate(times) if (warmup + i) % len(buckets) == b)
            if not mine:
                continue
            mid = len(mine) // 2
            median = mine[mid] if len(mine) % 2 else (mine[mid - 1] + mine[mid]) / 2
            parts.append(f"{fraction:g} of the image tokens: median {median:.3f} s, fastest {mine[0]:.3f} "
                         f"({len(mine)} step{'s' if len(mine) != 1 else ''})")
        lines.append(f"  {label(r)}: " + "; ".join(parts))
    return "timed steps by bucket:\n" + "\n".join(lines) if lines else ""
