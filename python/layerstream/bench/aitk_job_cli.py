"""The command line of `layerstream bench aitk-job` (aitk_job.py says what a run is and what it compares)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from . import aitk_job
from .aitk_job import (ACTIVE_LINE, QUANTIZE, JobOptions, RunResult, Workspace, allocator_line, differences,
                       lost_files, run_engine)
from .aitk_models import ARCHES, SIZES


TABLE_HEADER = ("| arch | size | quantize | engine | exit | steps logged | s/it (AI-Toolkit) | median step s | "
                "first to last step s | start to first step s | attach s | sample s | save s | wall s | "
                "peak VRAM GiB | peak RSS GiB | GB copied per step | compute waited ms per step | layerstream active |")


def summary_row(opts: JobOptions, r: RunResult) -> str:
    gib = 2 ** 30
    vram = "" if r.peak_vram_allocated is None else f"{r.peak_vram_allocated / gib:.2f}"
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    attach = " + ".join(f"{a['module']} {a['seconds']:.1f}" for a in r.attaches)
    each = lambda times: " + ".join(f"{t:.1f}" for t in times)  # noqa: E731
    # From the first logged step to the last (samples and saves between them in it): the training's own figure
    # for a short job, where AI-Toolkit's s/it (a moving average) is mostly its last sample and save.
    span = None if r.first_step_s is None or r.last_step_s is None else r.last_step_s - r.first_step_s
    return (f"| {opts.arch} | {opts.size} | {opts.quantize} | {r.engine} | {r.returncode} | {len(r.losses)} | "
            f"{fmt(r.s_per_it, '.3f')} | {fmt(r.median_step_s, '.3f')} | {fmt(span, '.2f')} | "
            f"{fmt(r.first_step_s, '.1f')} | {attach} | "
            f"{each(r.sample_s)} | {each(r.save_s)} | {r.wall_s:.1f} | {vram} | {r.peak_rss_bytes / gib:.2f} | "
            f"{fmt(r.bus_gb_per_step, '.3g')} | "
            f"{fmt(r.copy_wait_ms_per_step, '.0f')} | "
            f"{'yes' if r.active else 'no'} |")


def stress_problems(runs: dict) -> list[str]:
    """--stress-gb: layerstream running out of memory for more of the user's allocations than stock did."""
    ooms = {engine: sum(r.stress["out_of_memory"].values()) for engine, r in runs.items() if r.stress is not None}
    if "layerstream" in ooms and ooms["layerstream"] > ooms.get("stock", 0):
        return [f"out of memory for the user's allocations: {ooms['layerstream']} under layerstream, "
                f"{ooms.get('stock', 'not run')} under stock"]
    return []


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="layerstream bench aitk-job", description=aitk_job.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aitk-dir", default=(os.environ.get("AI_TOOLKIT_DIR") or "").split(os.pathsep)[0] or None,
                        help="AI-Toolkit checkout to copy (default: the first of $AI_TOOLKIT_DIR)")
    parser.add_argument("--arch", choices=ARCHES, action="append",
                        help="model class (repeat for several; default zimage)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="transformer shapes: tiny or the real model's")
    parser.add_argument("--te-size", choices=SIZES, default="tiny", help="text encoder shapes")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: the size's)")
    parser.add_argument("--quantize", choices=QUANTIZE, default="none",
                        help="model.quantize with this qtype (qfloat8 becomes torchao float8 under offloading)")
    parser.add_argument("--engines", default="stock,layerstream",
                        help="comma-separated, run in this order: stock (AI-Toolkit's own offloading), layerstream, "
                             "resident (layer offloading off and no --cap-gb: the model on the GPU, the step's "
                             "compute floor; where its outcome differs from stock's it is printed, not counted)")
    parser.add_argument("--device", default="cpu", help="the job's device (cpu, cuda)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--sample-every", type=int, default=3)
    parser.add_argument("--sample-steps", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--num-frames", type=int, default=1,
                        help="frames of each training clip and sample (video models; 1: images). AI-Toolkit wants "
                             "4k+1 frames for Wan (e.g. 5, 9, 41)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--transformer-percent", type=float, default=1.0)
    parser.add_argument("--te-percent", type=float, default=1.0)
    parser.add_argument("--cap-gb", type=float, help="GPU: cap the job's VRAM at this many GiB once training starts")
    parser.add_argument("--resume", action="store_true",
                        help="also: stop each engine's job with SIGINT after its first save, start it again, and "
                             "compare the resumed losses")
    parser.add_argument("--ctrl-c", choices=("step", "save"), action="append", default=[],
                        help="also: stop each engine's job with SIGINT inside a training step (after 3 optimizer "
                             "steps) or halfway through its second write of optimizer.pt, report the saved files "
                             "lost, and start it again (repeat for both)")
    parser.add_argument("--deterministic", action="store_true",
                        help="GPU: torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 in the "
                             "jobs, so that stock and layerstream can be compared bitwise")
    parser.add_argument("--run-tag", default="",
                        help="appended to each run's folder name: a new run in a --workdir that already has one (the "
                             "same name would resume it), e.g. auto for a LAYERSTREAM_VRAM_BUDGET=auto row")
    parser.add_argument("--second-job", action="store_true",
                        help="give run.py a second job (the same under another name), which it starts in the same "
                             "process when the first ends; its outcome is compared too")
    parser.add_argument("--stubs", help="a folder put on PYTHONPATH of the jobs (tests/aitk_stubs: stand-ins for "
                                        "AI-Toolkit imports that cannot install here)")
    parser.add_argument("--profile", action="store_true",
                        help="write profile.txt in each run's folder: Python's profile (cProfile) of the trainer's "
                             "first sample() call (before the first step, with the warm-up), of its sample() calls "
                             "after the first and of its training steps after the second")
    parser.add_argument("--stress-gb", metavar="GiB,...",
                        help="the user's own allocations while each job trains, e.g. 2,4,8: each size in turn, each "
                             "freed before the next, after every odd optimizer step, inside the step after every "
                             "even one and inside every sample after the first step; out-of-memory errors are "
                             "counted per engine (a problem where layerstream's exceed stock's)")
    parser.add_argument("--workdir", help="keep everything here (default: a new temporary folder, removed)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if not args.aitk_dir:
        parser.error("--aitk-dir (or AI_TOOLKIT_DIR) is required")
    if args.stress_gb is not None:
        try:
            sizes = [float(v) for v in args.stress_gb.split(",")]
        except ValueError:
            sizes = []
        if not sizes or any(not v > 0 for v in sizes):
            parser.error(f"--stress-gb {args.stress_gb!r}: give sizes in GiB above 0, comma-separated (e.g. 2,4,8)")
    engines = [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in engines if e not in aitk_job.ENGINES]
    if unknown or len(set(engines)) != len(engines):
        parser.error(f"--engines {args.engines!r}: give each of {', '.join(aitk_job.ENGINES)} at most once, "
                     f"comma-separated (e.g. resident,stock,layerstream)")
    args.engines = ",".join(engines)
    args.arch = args.arch or ["zimage"]
    return args


def _json_row(arch: str, r: RunResult, **extra) -> dict:
    row = {"arch": arch, **extra, **{k: v for k, v in asdict(r).items() if k not in ("log", "second")}}
    if r.second is not None:
        row["second_job"] = {k: v for k, v in asdict(r.second).items() if k not in ("log", "second")}
    return row


def ctrl_c_checks(ws: Workspace, opts: JobOptions, engines: list[str], places: list[str], prefix: str) -> list[str]:
    """--ctrl-c: each engine's job stopped with SIGINT where it paused for it (aitk_site's AITK_JOB_PAUSE), the
    saved files it lost, and the same job started again. A problem: a job that hung after the SIGINT or did not
    resume, or layerstream losing a file that stock does not (AI-Toolkit loses optimizer.pt in a save itself)."""
    problems = []
    for where in places:
        lost = {}
        for engine in engines:
            name = f"{prefix}-{engine}-ctrl-c-{where}"
            first = run_engine(ws, opts, engine, name, pause="step:3" if where == "step" else "save:2")
            if first.paused is None:
                problems.append(f"{engine} Ctrl-C in a {where}: the job never paused (exit {first.returncode})")
                continue
            lost[engine] = lost_files(first.paused["before"], ws.root / "runs" / name / f"job_{opts.arch}")
            second = run_engine(ws, opts, engine, name)
            found = re.findall(r"Found step (\d+) in metadata", second.log[len(first.log):])
            print(f"   {engine}: Ctrl-C in a {where}: exit {first.returncode}{' (hung: killed)' if first.killed else ''}"
                  f", saved files lost: {lost[engine] or 'none'}; started again from step "
                  f"{found[-1] if found else '?'}: exit {second.returncode}", flush=True)
            if first.killed or second.returncode != 0 or not found:
                problems.append(f"{engine} Ctrl-C in a {where}: hung {first.killed}, resumed exit {second.returncode}")
        if "stock" in lost and "layerstream" in lost and lost["stock"] != lost["layerstream"]:
            problems.append(f"Ctrl-C in a {where}: files lost {lost}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    engines = args.engines.split(",")
    tag = f"-{args.run_tag}" if args.run_tag else ""
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="aitk_job_"))
    ws = Workspace(root=root, source=Path(args.aitk_dir), stubs=Path(args.stubs).resolve() if args.stubs else None)
    failed, rows, results = 0, [], []
    for arch in args.arch:
        opts = JobOptions(arch=arch, size=args.size, te_size=args.te_size, layers=args.layers,
                          quantize=args.quantize, steps=args.steps, save_every=args.save_every,
                          sample_every=args.sample_every, sample_steps=args.sample_steps,
                          resolution=args.resolution, images=args.images, num_frames=args.num_frames,
                          device=args.device, dtype=args.dtype, rank=args.rank,
                          transformer_percent=args.transformer_percent, te_percent=args.te_percent)
        runs, problems = {}, []
        for engine in engines:
            print(f"== {arch} {engine}", flush=True)
            run = run_engine(ws, opts, engine, f"{arch}-{engine}{tag}", cap_gb=args.cap_gb,
                             second_job=args.second_job, deterministic=args.deterministic, profile=args.profile,
                             stress_gb=args.stress_gb)
            runs[engine] = run
            if run.stress is not None:
                print(f"   {engine}: the user's {args.stress_gb} GiB allocations: " + ", ".join(
                    f"{place} {run.stress['made'][place]} made, {run.stress['out_of_memory'][place]} out of memory"
                    for place in run.stress["made"]), flush=True)
            if run.allocator_per_step:
                print(f"   {engine}: {allocator_line(run.allocator_per_step)}", flush=True)
            rows.append(summary_row(opts, run))
            if run.second is not None:
                rows.append(summary_row(opts, run.second).replace(f"| {engine} |", f"| {engine}, 2nd job |"))
                gap = (run.second.first_step_s or 0) - (run.last_step_s or 0)
                print(f"   {engine}: the second job's first step {gap:.1f} s after the first job's last", flush=True)
            if run.returncode != 0:
                print(run.log[-4000:])
                problems.append(f"{engine}: exit status {run.returncode}")
            results.append(_json_row(arch, run))
        if "layerstream" in runs and not runs["layerstream"].active:
            problems.append(f"layerstream: the log has no {ACTIVE_LINE!r}")
        if "stock" in runs and "layerstream" in runs:
            problems += differences(runs["stock"], runs["layerstream"])
        if "resident" in runs and "stock" in runs:
            # Printed, not counted: without offloading AI-Toolkit takes other paths of its own (its samples inside
            # training; qfloat8 through quanto instead of torchao's float8), so its outcome need not be stock's.
            for d in differences(runs["stock"], runs["resident"]):
                print(f"   note {arch}: resident against stock: {d}", flush=True)
        problems += stress_problems(runs)
        if args.resume:
            resumed = {}
            for engine in engines:
                name = f"{arch}-{engine}{tag}-resumed"
                first = run_engine(ws, opts, engine, name, interrupt_after_save=args.save_every)
                resumed[engine] = second = run_engine(ws, opts, engine, name)
                full = runs[engine].losses
                after = {s: v for s, v in second.losses.items() if s > args.save_every}
                print(f"   {engine}: stopped with Ctrl-C after the step-{args.save_every} save (exit "
                      f"{first.returncode}, {'Job stopped' if 'Job stopped' in first.log else 'no Job stopped'}); "
                      f"started again: exit {second.returncode}, steps {sorted(after)}; the same losses as the "
                      f"uninterrupted run: {all(full.get(k) == v for k, v in after.items())}", flush=True)
                if second.returncode != 0 or sorted(after) != [k for k in sorted(full) if k > args.save_every]:
                    problems.append(f"{engine} resumed: exit status {second.returncode}, steps {sorted(second.losses)}")
                results.append(_json_row(arch, second, resumed=True))
            if "stock" in resumed and "layerstream" in resumed:
                problems += [f"resumed: {d}" for d in differences(resumed["stock"], resumed["layerstream"])]
        problems += ctrl_c_checks(ws, opts, engines, args.ctrl_c, f"{arch}{tag}")
        for problem in problems:
            print(f"   DIFFERENT {arch}: {problem}", flush=True)
        failed += bool(problems)
    print(TABLE_HEADER)
    print("|---" * (TABLE_HEADER.count("|") - 1) + "|")
    print("\n".join(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, default=str) + "\n")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(args.arch) - failed} passed, {failed} failed")
    return 1 if failed else 0
