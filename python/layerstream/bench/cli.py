"""LoRA training step on a FLUX-, Qwen-Image- or Wan-shaped transformer: all resident, AI-Toolkit's stock
offloading, layerstream.

The model (``--preset``) has a real model's block layout and layer shapes with random weights: flux1 (FLUX.1,
19 double-stream and 38 single-stream blocks at hidden 3072, 11.85B bf16 parameters), flux2 (FLUX.2 [dev], 32.0B),
qwen-image (Qwen-Image, 60 dual-stream blocks at 3072, 20.4B), wan22 (one Wan 2.2 14B expert, 40 blocks at 5120
over 32,760 video tokens, 14.2B; wan22-41f: 17,160 tokens, which fit 24 GiB), each with smaller variants
(medium: full width, few blocks; small: toy size).
No embedders, RoPE or final layer, because only the block linears matter for what is measured: how long a
training step takes when those weights stream over PCIe. A rank-128 LoRA wraps every block linear the way
AI-Toolkit's LoRA network does (after the memory manager has attached, so the LoRA's ``org_forward`` is the
manager's forward), and AdamW trains it.

Modes (``--mode``):
  resident     the whole model on the device: the compute time T_compute of a step
  stock        AI-Toolkit's own MemoryManager with its own manager_modules.py
  layerstream  AI-Toolkit's own MemoryManager with layerstream's manager_modules
  all          the three above, each in its own subprocess (clean peak-memory figures), then one table

Each mode reports s/step, peak VRAM, peak host RSS, pinned host bytes, bytes over the bus per step, the
first losses (the same weights, inputs and LoRA init in every mode, so they should agree) and the ratio to
the floor max(T_compute, bytes_per_step / pinned H2D bandwidth) (docs/benchmarks.md).

Examples (`layerstream bench` and `python benchmarks/flux_bench.py` are the same entry point):
  layerstream bench --preset flux1 --mode all --aitk-dir /path/to/ai-toolkit --md-out bench.md
  layerstream bench --preset flux1 --mode all --vram-cap-gb 24 --aitk-dir /path/to/ai-toolkit
  layerstream bench --preset qwen-image --mode stock,layerstream --stock-sweep 0.25,0.5,0.75,1.0 \
      --vram-cap-gb 24 --aitk-dir /path/to/ai-toolkit       # stock at its best offload_percent under 24 GiB
  layerstream bench --preset small --mode resident          # CPU smoke test
  layerstream bench aitk-job --help                         # AI-Toolkit's run.py on a YAML job (aitk_job.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import sweep
from .measure import GiB, measure_h2d_bytes_per_s, use_deterministic_kernels
from .presets import PRESETS, preset_weight_bytes
from .quant import QTYPES
from .report import add_floors, reference_row, report
from .run import run_mode

MODES = ("resident", "stock", "layerstream")
CPU_LIMIT_BYTES = 2 * GiB  # larger presets refuse to run without a GPU unless --force


def _strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the given value-taking options (``--x v`` and ``--x=v`` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


def run_all(argv: list[str], runs: list[tuple[str, float | None]]) -> list[dict]:
    """Every run in its own process: peak VRAM and RSS are per-process high-water marks. A run is a mode, or
    (stock, an offload_percent) of --stock-sweep (see sweep.jobs)."""
    child_argv = _strip_options(argv, ("--mode", "--json-out", "--md-out", "--stock-sweep"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for index, (mode, percent) in enumerate(runs):
            out = Path(tmp) / f"{index}-{mode}.json"
            own = [] if percent is None else ["--offload-percent", str(percent)]
            base = child_argv if percent is None else _strip_options(child_argv, ("--offload-percent",))
            cmd = [sys.executable, "-m", "layerstream.bench", *base, *own, "--mode", mode, "--json-out", str(out),
                   "--child"]
            print(f"== {mode}: {shlex.join(cmd)}", flush=True)
            code = subprocess.run(cmd).returncode
            if out.is_file():
                row = json.loads(out.read_text())["results"][0]
            else:
                row = {"mode": mode, "status": "failed", "reason": f"exit code {code}, no result (see its output above)"}
            rows.append(row if percent is None else sweep.mark(row, percent))
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    # allow_abbrev=False: `--mode all` rewrites the command line for its children by exact option names.
    parser = argparse.ArgumentParser(prog="layerstream bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="flux1")
    parser.add_argument("--mode", default="all",
                        help=f"one of {', '.join(MODES)}, a comma-separated list of them, or all")
    parser.add_argument("--aitk-dir", help="AI-Toolkit checkout (default: $AI_TOOLKIT_DIR)")
    parser.add_argument("--offload-percent", type=float, default=1.0,
                        help="AI-Toolkit's offload_percent: the fraction of linears the manager takes over")
    parser.add_argument("--vram-cap-gb", type=float, help="cap this process's VRAM at this many GiB")
    parser.add_argument("--stock-sweep", metavar="PERCENTS",
                        help="run stock at each of these offload_percents (comma-separated, e.g. 0.25,0.5,0.75,1.0), "
                             "each in its own process under the same cap; a run out of device memory is a row, and "
                             "the fastest of the others is stock's best")
    parser.add_argument("--reference-json", help="the --json-out of an earlier run with a resident row: its "
                        "compute times give the floors of this run when it has no resident mode of its own")
    parser.add_argument("--timeline-out", help="GPU: profile one extra step per streamed mode and draw its copies "
                                                   "against its kernels into FILE-<mode>.png")
    parser.add_argument("--quantize", choices=QTYPES,
                        help="quantize every linear's weight in every mode (frozen): qfloat8 or qint8 with "
                             "optimum-quanto, float8 with torchao's Float8WeightOnlyConfig (what AI-Toolkit uses "
                             "with layer_offloading)")
    parser.add_argument("--host-dtype", choices=("auto", "same", "lossless", "float8_e4m3fn", "float8_e5m2"),
                        help="layerstream mode only: LAYERSTREAM_HOST_DTYPE (unset: the environment's, else auto, "
                             "the default), frozen weights kept and streamed as they are (same), packed exactly in "
                             "about 12 bits per value (lossless; auto for bfloat16 weights of 1 MiB or more) or as "
                             "8-bit codes with a scale per output channel (float8; the other modes stream bf16)")
    parser.add_argument("--decode-blocks-sweep",
                        help="with --host-dtype lossless: after the timed steps, --steps more at each of these "
                             "limits on the decode's thread blocks (comma-separated; 0: no limit), in one process")
    parser.add_argument("--rank", type=int, default=128, help="LoRA rank (alpha = rank)")
    parser.add_argument("--lora-init-nonzero", action="store_true",
                        help="start lora_up at N(0, 1e-3) instead of zero, so lora_down gets gradients too")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="gradient checkpointing per block")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (on the H200 the third step of a process is still slow in every "
                             "mode, resident included: 2026-11-30)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8, so that "
                             "losses of two runs (resident, stock, layerstream) can be compared bitwise (attention's "
                             "backward otherwise accumulates in a nondeterministic order)")
    parser.add_argument("--aitk-flow", action="store_true",
                        help="as AI-Toolkit runs: the model on the GPU before attach, a text-encoder-sized "
                             "allocation made and freed before training, a no_grad sample before the first step "
                             "and every --sample-every steps, steps cycling through --buckets")
    parser.add_argument("--flow-earlier-peak", action=argparse.BooleanOptionalAction, default=True,
                        help="--aitk-flow: the model on the GPU before attach and the text encoder made and freed "
                             "there (the process's peak before training); --no-flow-earlier-peak attaches the model "
                             "from the host and makes no encoder (the same flow without the earlier peak)")
    parser.add_argument("--encoder-gb", type=float, default=9.5,
                        help="--aitk-flow: the text encoder's GiB on the device before training (T5-XXL bf16: 9.5)")
    parser.add_argument("--sample-every", type=int, default=4, help="--aitk-flow: a sample every N steps (0: none)")
    parser.add_argument("--buckets", type=lambda v: [float(f) for f in v.split(",")], default=[1.0, 0.5625, 0.25],
                        help="--aitk-flow: the image tokens of each bucket as fractions of the preset's "
                             "(default 1,0.5625,0.25: AI-Toolkit's 1024/768/512)")
    parser.add_argument("--user-alloc-gb", type=float, default=0.0,
                        help="GPU: before step --user-alloc-at the user takes this many GiB of the device, for "
                             "--user-alloc-steps steps (memory pressure)")
    parser.add_argument("--user-alloc-at", type=int, default=4)
    parser.add_argument("--stress-gb", type=lambda v: [float(f) for f in v.split(",")], default=[],
                        help="GPU: allocations of these GiB in turn (e.g. 2,4,8), one before every odd step "
                             "(between steps) and one inside every even step (in the forward of the middle "
                             "linear), each freed at once; an out-of-memory error is counted and training goes on")
    parser.add_argument("--user-alloc-steps", type=int, default=2)
    parser.add_argument("--force", action="store_true",
                        help=f"run a preset of more than {CPU_LIMIT_BYTES // GiB} GiB of weights without a GPU "
                             "(hours of CPU time and as much host RAM per mode)")
    parser.add_argument("--json-out", help="write the results as JSON")
    parser.add_argument("--md-out", help="write the table as markdown, with the command, date, GPU and torch")
    # Set by `--mode all` for its children: the parent measures the bandwidth and the floor once for all.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = list(MODES) if args.mode == "all" else args.mode.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--mode: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)} or all")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.stock_sweep is not None:
        if "stock" not in args.modes:
            parser.error("--stock-sweep runs the stock mode: add stock to --mode")
        try:
            args.stock_sweep = sweep.parse_percents(args.stock_sweep)
        except ValueError as exc:
            parser.error(f"--stock-sweep: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["aitk-job"]:  # AI-Toolkit's own trainer on a YAML job: aitk_job_cli.py
        from .aitk_job_cli import main as aitk_job_main

        return aitk_job_main(argv[1:])
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    weight_bytes = preset_weight_bytes(args.preset)
    if not cuda and not args.force and weight_bytes > CPU_LIMIT_BYTES:
        print(f"layerstream bench: error: no GPU here, and --preset {args.preset} builds {weight_bytes / GiB:.1f} GiB "
              "of weights on the CPU (hours per mode). Use --preset small (or flux2-small, qwen-image-small, "
              "wan22-small), or pass --force",
              file=sys.stderr)
        return 2
    reference = None if args.child else reference_row(args.reference_json)  # before the runs: fail fast
    if args.deterministic:  # the children of `--mode all` get the flag in their argv
        use_deterministic_kernels()
    runs = sweep.jobs(args.modes, args.stock_sweep)
    if len(runs) > 1 or args.stock_sweep:
        rows = run_all(argv, runs)
        sweep.pick_best(rows)
    else:
        device = torch.device("cuda") if cuda else torch.device("cpu")
        torch.manual_seed(args.seed)
        rows = [run_mode(args, args.modes[0], device)]
        gc.collect()  # the LoRA wrappers and the layers reference each other: free the model before measuring
        if cuda:
            torch.cuda.empty_cache()
    if args.child:
        Path(args.json_out).write_text(json.dumps({"results": rows}, default=str) + "\n")
        return 0
    h2d = measure_h2d_bytes_per_s() if cuda else None
    t_compute = add_floors(rows, h2d, reference)
    report(args, rows, h2d, t_compute)
    # Out of memory is a result in a sweep (that offload_percent does not fit), a failure anywhere else.
    return 0 if all(r["status"] != "failed" and (r["status"] != "oom" or r.get("stock_sweep")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
