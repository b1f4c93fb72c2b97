"""--stock-sweep: stock at several offload_percents (each in its own process, under the same --vram-cap-gb),
the fastest of those that did not run out of memory picked as stock's best, and the other modes set against it."""

from __future__ import annotations


def parse_percents(value: str) -> list[float]:
    """"0.25,0.5,0.75,1.0" -> [0.25, 0.5, 0.75, 1.0]; a ValueError that names the bad item."""
    percents = []
    for item in value.split(","):
        try:
            percent = float(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a number; give offload_percents in (0, 1], e.g. 0.25,0.5,0.75,1.0")
        if not 0.0 < percent <= 1.0:
            raise ValueError(f"{item} is not in (0, 1]; give offload_percents in (0, 1], e.g. 0.25,0.5,0.75,1.0")
        percents.append(percent)
    return percents


def jobs(modes: list[str], percents: list[float] | None) -> list[tuple[str, float | None]]:
    """The runs, in order: (mode, the offload_percent of a stock sweep run or None)."""
    out: list[tuple[str, float | None]] = []
    for mode in modes:
        out += [(mode, p) for p in percents] if mode == "stock" and percents else [(mode, None)]
    return out


def mark(row: dict, percent: float) -> dict:
    """A stock sweep run's row, named by its offload_percent in the table."""
    row.update({"stock_sweep": True, "offload_percent": percent, "label": f"stock, offload {percent:g}"})
    return row


def pick_best(rows: list[dict]) -> dict | None:
    """The fastest finished stock sweep row, marked ``stock_best``; None when none finished."""
    done = [r for r in rows if r.get("stock_sweep") and r["status"] == "ok"]
    if not done:
        return None
    best = min(done, key=lambda r: r["s_per_step_mean"])
    best["stock_best"] = True
    return best


def summary(rows: list[dict], cap_gb: float | None) -> str:
    """One line: stock's best offload_percent (and which ran out of memory) and each other finished mode's
    speed against it; empty without a sweep."""
    swept = [r for r in rows if r.get("stock_sweep")]
    if not swept:
        return ""
    where = f"under the {cap_gb:g} GiB cap" if cap_gb else "uncapped"
    oom = [f"{r['offload_percent']:g}" for r in swept if r["status"] == "oom"]
    skipped = [f"{r['offload_percent']:g}" for r in swept if r["status"] == "skipped"]
    failed = [f"{r['offload_percent']:g}" for r in swept if r["status"] not in ("ok", "oom", "skipped")]
    best = next((r for r in swept if r.get("stock_best")), None)
    parts = [f"stock's best offload_percent {where}: "
             + (f"{best['offload_percent']:g} at {best['s_per_step_mean']:.3f} s/step" if best else "none finished")]
    if oom:
        parts.append(f"out of memory at {', '.join(oom)}")
    if skipped:
        parts.append(f"skipped at {', '.join(skipped)}")
    if failed:
        parts.append(f"failed at {', '.join(failed)}")
    for r in rows:
        if not r.get("stock_sweep") and r["status"] == "ok" and r["mode"] != "stock":
            speed = f" ({best['s_per_step_mean'] / r['s_per_step_mean']:.2f}x as fast as stock's best)" if best else ""
            parts.append(f"{r['mode']} {r['s_per_step_mean']:.3f} s/step{speed}")
    return "; ".join(parts)
