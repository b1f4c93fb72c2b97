#!/usr/bin/env python3
"""LoRA training on a FLUX.2-shaped transformer whose linears are AI-Toolkit OstrisLinear layers (its own
quantizers: uint4, convrot8, nvfp4, orbit4, orbitvq4, ...), under AI-Toolkit's own MemoryManager (every
linear offloaded), with its stock manager_modules.py and with layerstream's, beside the same model held whole on
the GPU without a manager (`resident`, never capped: the compute floor both engines are measured against).

The model is layerstream.bench's FLUX-shaped transformer (the `flux2` preset: 32B parameters; SwiGLU, no
biases, shared modulation). Quantizing 32B random weights would take most of a GPU session (and 60 GiB of bf16
first), so one random weight per distinct linear shape (six in FLUX.2) is quantized on the GPU by the
checkout's own get_ostris_quantizer / convert_linear_to_ostris, and every linear of that shape gets a copy of
its buffers: the bytes per layer, the kernels and the dequantization per call are those of a real quantized
model; only the values repeat across blocks. Checkpointing per block and a LoRA on every block linear, as
layerstream.bench runs them.

Each (qtype, mode) runs in a process of its own (peak VRAM and peak RSS are per-process high-water marks)
and reports s/step, peak VRAM, peak RSS, pinned host bytes, the bytes over the bus per step (layerstream's
engine counters; for stock, the CPU buffers its OstrisLinear manager stages at each call, counted at the call)
and the losses: both modes run the layer's own forward on the same buffers and the same inputs, so with
--deterministic they agree bitwise unless one of them is wrong (without it attention's backward accumulates
in a nondeterministic order on the GPU, and two runs of the same mode differ after the first step).

  python benchmarks/ostris_bench.py --qtypes uint4,convrot8,nvfp4,orbit4,orbitvq4 --cap-gb 24 \\
      --aitk-dir /path/to/ai-toolkit --md-out ostris.md --json-out ostris.json
  python benchmarks/ostris_bench.py --preset flux2-small --qtypes uint4 --warmup 1 --steps 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from layerstream.aitk import import_toolkit, load_memory_management
from layerstream.bench import DTYPE, GiB, PRESETS, FluxShapedTransformer, apply_lora, peak_rss_bytes, stock_pinned_bytes
from layerstream.bench.cli import _strip_options
from layerstream.bench.measure import measure_h2d_bytes_per_s, use_deterministic_kernels

MODES = ("resident", "stock", "layerstream")


def quantized_model(cfg, qtype: str, aitk_dir: str, device: torch.device, checkpointing: bool, seed: int):
    """The FLUX-shaped model with every linear an OstrisLinear of `qtype` (on the CPU, frozen): one weight per
    shape quantized on `device` by AI-Toolkit's own code, its buffers copied into every linear of that shape."""
    ostris = import_toolkit(aitk_dir, "toolkit.util.ostris_quant")[0]
    quantizer = ostris.get_ostris_quantizer(qtype)
    if quantizer is None:
        raise ValueError(f"{aitk_dir}: AI-Toolkit has no OstrisLinear backend for qtype {qtype!r}")
    with torch.device("meta"):
        model = FluxShapedTransformer(cfg, checkpointing).to(DTYPE)
    templates = {}
    generator = torch.Generator(device=device).manual_seed(seed)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            shape = (child.in_features, child.out_features, child.bias is not None)
            if shape not in templates:
                lin = nn.Linear(*shape, device=device, dtype=DTYPE)
                with torch.no_grad():
                    for p in lin.parameters():
                        p.normal_(0.0, 0.02, generator=generator)
                if not ostris.convert_linear_to_ostris(lin, quantizer):
                    raise ValueError(f"{qtype} does not quantize a {shape[1]}x{shape[0]} linear (can_quantize)")
                templates[shape] = lin.to("cpu").requires_grad_(False)
            # A copy with buffers of its own, sharing the one quantizer (as AI-Toolkit's quantize() does).
            template = templates[shape]
            setattr(parent, name, copy.deepcopy(template, memo={id(template.ostris_quantizer): template.ostris_quantizer}))
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on the meta device: {leftover[:5]}")
    return model.requires_grad_(False), len(templates)


def stored_bytes(layer: nn.Module) -> int:
    """What a managed OstrisLinear keeps on the host: its buffers and bias (read from the dicts: `weight` is
    a property that dequantizes)."""
    tensors = [b for b in layer._buffers.values() if b is not None]
    bias = layer._parameters.get("bias")
    return sum(t.nbytes for t in tensors) + (0 if bias is None else bias.nbytes)


def count_stock_copies(model: nn.Module) -> list[int]:
    """Wraps each managed layer's forward to add up what stock's OstrisLinear manager stages at that call: the
    buffers and bias it finds on the CPU (toolkit/memory_management/manager_modules.py of 27a03a91)."""
    moved = [0]
    for layer in model.modules():
        if not hasattr(layer, "_layer_memory_manager"):
            continue

        def counted(x, *args, _forward=layer.forward, _layer=layer, **kwargs):
            tensors = [b for b in _layer._buffers.values() if b is not None]
            bias = _layer._parameters.get("bias")
            moved[0] += sum(t.nbytes for t in tensors + ([] if bias is None else [bias]) if t.device.type == "cpu")
            return _forward(x, *args, **kwargs)

        layer.forward = counted
    return moved


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(args, qtype: str, mode: str, device: torch.device) -> dict:
    cfg = PRESETS[args.preset]
    if mode == "layerstream" and args.cap_gb and device.type == "cuda":
        os.environ.setdefault("LAYERSTREAM_VRAM_BUDGET", f"{args.cap_gb:g}GiB")  # read at the first attach
    if mode == "layerstream":
        # How long compute waits for copies (two event records per fetch), as layerstream.bench measures it.
        os.environ.setdefault("LAYERSTREAM_TIME_WAITS", "1")
    t0 = time.perf_counter()
    model, shapes = quantized_model(cfg, qtype, args.aitk_dir, device, args.checkpointing, args.seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the templates' quantization is not part of the run
    layers = [m for m in model.modules() if hasattr(m, "ostris_quantizer")]
    host_bytes = sum(stored_bytes(m) for m in layers)
    build_s = time.perf_counter() - t0
    print(f"[{qtype} {mode}] {len(layers)} OstrisLinear ({shapes} shapes quantized), {host_bytes / GiB:.2f} GiB "
          f"stored, built in {build_s:.1f} s", flush=True)

    t0 = time.perf_counter()
    random.seed(args.seed)
    if mode == "resident":  # no manager: every buffer on the device, the floor of compute
        package = None
        model.to(device)
        paths = {"resident"}
    else:
        package = load_memory_management(args.aitk_dir, engine=mode)
        package.MemoryManager.attach(model, device, offload_percent=1.0)
        model.to(device)
        paths = {getattr(m._layer_memory_manager, "path", "stock") for m in layers}
    # (Stock stages nothing on a CPU process device: it runs the layer's forward where the buffers are.)
    stock_moved = count_stock_copies(model) if mode == "stock" and device.type == "cuda" else None
    network = apply_lora(model, args.rank, True, device, seed=args.seed + 1)
    place_s = time.perf_counter() - t0
    if args.cap_gb and device.type == "cuda" and mode != "resident":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GiB / total))
        torch.cuda.reset_peak_memory_stats(device)

    g = torch.Generator().manual_seed(args.seed)
    img, txt, vec = (torch.randn(shape, generator=g, dtype=DTYPE).to(device)
                     for shape in ((1, cfg.img_tokens, cfg.hidden), (1, cfg.txt_tokens, cfg.hidden), (1, cfg.hidden)))
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    sync_grads = getattr(package, "sync_grad_transfers", lambda: None)

    def moved() -> int:
        if mode == "resident":
            return 0
        if mode == "stock":
            return stock_moved[0] if stock_moved is not None else 0
        from layerstream import manager_modules

        return int(manager_modules.stats()["bytes_h2d"])

    def waited_us() -> float | None:
        """How long layerstream's compute stream waited for its copies so far (None for the other modes)."""
        if mode != "layerstream":
            return None
        from layerstream import manager_modules

        return float(manager_modules.stats().get("copy_wait_us", 0))

    def ostris_counts() -> dict:
        """layerstream's calls that decoded (or did the backward) themselves, and the staged bytes that outlived
        their call (copied out of the ring), so far."""
        if mode != "layerstream":
            return {}
        from layerstream import manager_modules

        stats = manager_modules.stats()
        return {k: stats[k] for k in ("ostris_decoded", "ostris_kept_bytes")}

    losses, times, start_bytes, start_wait, start_counts = [], [], 0, None, {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start_bytes, start_wait, start_counts = moved(), waited_us(), ostris_counts()
        sync(device)
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(img, txt, vec).float().pow(2).mean()
        loss.backward()
        sync_grads()
        optimizer.step()
        sync(device)
        elapsed = time.perf_counter() - t
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(elapsed)
        print(f"[{qtype} {mode}] step {step}{' (warmup)' if step < args.warmup else ''}: {elapsed:.3f} s, "
              f"loss {losses[-1]:.8g}", flush=True)
    row = {
        "qtype": qtype, "mode": mode, "status": "ok", "device": str(device), "paths": sorted(paths),
        "layers": len(layers), "stored_bytes": host_bytes, "build_s": build_s, "place_s": place_s,
        "s_per_step_mean": sum(times) / len(times), "s_per_step_min": min(times), "step_times_s": times,
        "bytes_per_step": (moved() - start_bytes) / len(times), "losses": losses,
        "copy_wait_ms_per_step": None if start_wait is None else (waited_us() - start_wait) / 1e3 / len(times),
        "peak_rss_bytes": peak_rss_bytes(), "peak_vram_allocated_bytes": None, "peak_vram_reserved_bytes": None,
    }
    for key, value in ostris_counts().items():
        row[f"{key}_per_step"] = (value - start_counts[key]) / len(times)
    if device.type == "cuda":
        row["peak_vram_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vram_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if mode == "resident":
        row["pinned_bytes"] = 0
    elif mode == "stock":
        row["pinned_bytes"] = stock_pinned_bytes(
            [t for m in layers for t in list(m._buffers.values()) + list(m._parameters.values()) if t is not None])[0]
    else:
        from layerstream import manager_modules

        row["pinned_bytes"] = manager_modules.stats()["pinned_bytes"]
    return row


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def markdown_table(rows: list[dict], h2d_bytes_per_s: float | None = None) -> str:
    lines = ["| qtype | mode | s/step mean (min) | peak VRAM GiB alloc / reserved | peak RSS GiB | pinned GiB "
             "| stored GiB | GiB/step over bus | compute waited for copies ms/step "
             "| losses = stock's (bitwise only with --deterministic) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    stock = {r["qtype"]: r for r in rows if r["mode"] == "stock" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['qtype']} | {r['mode']} | {r['status']}: {r['reason']} | | | | | | | |")
            continue
        same = "" if r["qtype"] not in stock or r["mode"] == "stock" else (
            "yes" if r["losses"] == stock[r["qtype"]]["losses"] else "**no**")
        lines.append(
            f"| {r['qtype']} | {r['mode']} | {_fmt(r['s_per_step_mean'], digits=3)} "
            f"({_fmt(r['s_per_step_min'], digits=3)}) | {_fmt(r['peak_vram_allocated_bytes'], GiB)} / "
            f"{_fmt(r['peak_vram_reserved_bytes'], GiB)} | {_fmt(r['peak_rss_bytes'], GiB)} "
            f"| {_fmt(r['pinned_bytes'], GiB)} | {_fmt(r['stored_bytes'], GiB)} | {_fmt(r['bytes_per_step'], GiB)} "
            f"| {_fmt(r.get('copy_wait_ms_per_step'), digits=1)} | {same} |")
    resident = {r["qtype"]: r for r in rows if r["mode"] == "resident" and r["status"] == "ok"}
    for qtype, r in resident.items():
        # The floor of a streamed step: the resident step's compute, or the bus time of what layerstream moved
        # (stock's bytes where layerstream did not run), whichever is longer.
        streamed = [x for x in rows if x["qtype"] == qtype and x["status"] == "ok" and x["mode"] != "resident"]
        moved = next((x for x in streamed if x["mode"] == "layerstream"), streamed[0] if streamed else None)
        bus = None if moved is None or not h2d_bytes_per_s else moved["bytes_per_step"] / h2d_bytes_per_s
        floor = max(r["s_per_step_min"], bus or 0.0)
        lines.append(f"| {qtype} | floor: max(compute, bytes/bus) | {floor:.3f} (compute {r['s_per_step_min']:.3f}"
                     f", bus {_fmt(bus, digits=3)} s at {_fmt(h2d_bytes_per_s, 1e9, 1)} GB/s) | | | | | | | |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ostris_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="flux2")
    parser.add_argument("--qtypes", default="uint4,convrot8,nvfp4,orbit4,orbitvq4",
                        help="comma-separated AI-Toolkit qtypes (get_ostris_quantizer's names)")
    parser.add_argument("--modes", default="stock,layerstream", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--aitk-dir", default=os.environ.get("AI_TOOLKIT_DIR", "").split(os.pathsep)[0] or None,
                        help="AI-Toolkit checkout with toolkit/util/ostris_quant.py (default: $AI_TOOLKIT_DIR)")
    parser.add_argument("--cap-gb", type=float, default=24.0,
                        help="cap this process's VRAM at this many GiB (GPU; layerstream's LAYERSTREAM_VRAM_BUDGET "
                             "defaults to the cap); 0: no cap")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = rank), lora_up nonzero")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (layerstream.bench.measure.use_deterministic_kernels), so that the "
                             "losses can be compared with stock's bitwise")
    parser.add_argument("--json-out")
    parser.add_argument("--md-out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.qtype_list = [q for q in args.qtypes.split(",") if q]
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.aitk_dir:
        parser.error("needs an AI-Toolkit checkout: pass --aitk-dir or set AI_TOOLKIT_DIR")
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def run_children(argv: list[str], args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ostris_bench_") as tmp:
        for qtype in args.qtype_list:
            for mode in args.mode_list:
                out = Path(tmp) / f"{qtype}-{mode}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--qtypes", qtype, "--modes", mode,
                       "--json-out", str(out), "--child"]
                print(f"== {qtype} {mode}: {shlex.join(cmd)}", flush=True)
                code = subprocess.run(cmd).returncode
                rows.append(json.loads(out.read_text())["results"][0] if out.is_file() else
                            {"qtype": qtype, "mode": mode, "status": "failed",
                             "reason": f"exit code {code}, no result (see its output above)"})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.deterministic:  # the children get the flag in their argv
        use_deterministic_kernels()
    if args.child:
        torch.manual_seed(args.seed)
        row = run_one(args, args.qtype_list[0], args.mode_list[0], device)
        Path(args.json_out).write_text(json.dumps({"results": [row]}) + "\n")
        return 0
    rows = run_children(_strip_options(argv, ("--qtypes", "--modes", "--json-out", "--md-out")), args)
    h2d = measure_h2d_bytes_per_s() if torch.cuda.is_available() and "resident" in args.mode_list else None
    table = markdown_table(rows, h2d)
    print("\n" + table)
    meta = {"command": shlex.join([sys.executable, *sys.argv]), "preset": args.preset, "cap_gb": args.cap_gb,
            "rank": args.rank, "checkpointing": args.checkpointing, "warmup": args.warmup, "steps": args.steps,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
            "h2d_bytes_per_s": h2d}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(f"# ostris_bench: {args.preset}, VRAM cap {args.cap_gb or 'none'} GiB\n\n"
                                     f"- command: `{meta['command']}`\n- GPU: {meta['gpu'] or 'none (CPU)'}\n"
                                     f"- torch: {meta['torch']}\n\n{table}\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
