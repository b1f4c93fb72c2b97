"""One mode: the model built, placed (resident, or attached to AI-Toolkit's MemoryManager on stock's or
layerstream's manager_modules), trained with LoRA for the warm-up and timed steps (train.py), and measured into
one row."""

from __future__ import annotations

import os
import random
import re
import time

import torch

from .counting import StockCopyCounter, layerstream_stats, managed_tensors, stock_pinned_bytes
from .lora import apply_lora
from .measure import GiB, peak_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
from .presets import DTYPE, PRESETS, build_model
from .quant import quantize_model
from .train import Steps, Trainer


def _skipped(mode: str, reason: str) -> dict:
    print(f"[{mode}] skipped: {reason}", flush=True)
    return {"mode": mode, "status": "skipped", "reason": reason}


def load_engine(args, engine: str):
    """(AI-Toolkit's memory_management package on ``engine``, None) or (None, why not)."""
    aitk_dir = args.aitk_dir or os.environ.get("AI_TOOLKIT_DIR")
    if not aitk_dir:
        return None, "needs an AI-Toolkit checkout: pass --aitk-dir or set AI_TOOLKIT_DIR"
    try:
        from layerstream.aitk import load_memory_management

        return load_memory_management(aitk_dir, engine=engine), None
    except Exception as exc:  # layerstream's module may be missing or half-built: skip the mode, say why
        return None, f"cannot load the {engine} engine: {type(exc).__name__}: {exc}"


def attach_manager(package, model, device: torch.device, offload_percent: float, seed: int) -> None:
    """AI-Toolkit's MemoryManager.attach as its model classes call it, then the model to ``device`` (the patched
    .to moves only what the manager does not stream)."""
    random.seed(seed)  # AI-Toolkit picks the layers left resident with random.random()
    loose = model.loose_parameters()
    extra = {"ignore_modules": loose} if loose else {}  # as AI-Toolkit's Wan models pass their tables
    package.MemoryManager.attach(model, device, offload_percent=offload_percent, **extra)
    model.to(device)


def _stock_resident_bytes(shapes_only, args) -> float:
    """What AI-Toolkit's manager leaves on the device at --offload-percent p (it draws each linear's fate with
    random.random(), so 1 - p of them on average), at least: a quantized weight counted at one byte a value."""
    per_value = 1 if args.quantize else DTYPE.itemsize
    linear = sum(m.weight.numel() * per_value + (m.bias.nbytes if m.bias is not None else 0)
                 for m in shapes_only.modules() if type(m) is torch.nn.Linear)
    return (1.0 - args.offload_percent) * linear


def _build(args, mode: str, cfg, weight_bytes: int, device: torch.device):
    """The preset's model on the CPU, quantized where asked (torchao's float8 on ``device``, block by block, as
    AI-Toolkit does): (model, seconds)."""
    t0 = time.perf_counter()
    model = build_model(cfg, args.checkpointing, seed=args.seed + 2)
    if args.quantize:
        quantize_model(model, args.quantize, device)
    build_s = time.perf_counter() - t0
    print(f"[{mode}] built {weight_bytes / GiB:.2f} GiB of bf16 weights"
          f"{f', quantized to {args.quantize}' if args.quantize else ''} in {build_s:.1f} s", flush=True)
    return model, build_s


def _place(args, mode: str, package, model, device: torch.device):
    """The model on the device (resident) or attached, as AI-Toolkit's flow places it, and the LoRA applied:
    (network, seconds in all, seconds of the attach or the resident move alone)."""
    t0 = time.perf_counter()
    if args.aitk_flow and device.type == "cuda" and args.flow_earlier_peak:
        # AI-Toolkit's flow (extensions_built_in/diffusion_models/flux2/flux2_model.py): the transformer goes to
        # the GPU before MemoryManager.attach, and a text encoder comes to the GPU to cache the prompts' embeddings
        # and goes again; both leave their mark on the process's peak and on torch's cache.
        model.to(device)
        encoder = torch.empty(int(args.encoder_gb * GiB), dtype=torch.uint8, device=device)
        del encoder
    # Host memory from here on: what the placement and the training hold (the build's own peak, the weights made
    # on the host before the flow moves them to the GPU, is not the manager's).
    reset_peak_rss()
    t_attach = time.perf_counter()
    if package is None:
        model.to(device)
    else:
        print(f"[{mode}] attaching AI-Toolkit's MemoryManager to the model ...", flush=True)
        attach_manager(package, model, device, args.offload_percent, args.seed)
    attach_s = time.perf_counter() - t_attach
    pack = _lossless_pack_times() if mode == "layerstream" else None
    if pack and pack["weights"]:
        print(f"[{mode}] lossless packing at attach: {pack['weights']} weights, {pack['bytes_in'] / GiB:.2f} GiB: "
              f"{pack['copy_s']:.1f} s copying to host memory, {pack['table_s']:.1f} s building tables, "
              f"{pack['block_s']:.1f} s allocating and encoding arena blocks", flush=True)
    network = apply_lora(model, args.rank, args.lora_init_nonzero, device, seed=args.seed + 1)
    place_s = time.perf_counter() - t0
    print(f"[{mode}] placed the model and applied LoRA in {place_s:.1f} s (attach or move: {attach_s:.1f} s)",
          flush=True)
    return network, place_s, attach_s


def _lossless_pack_times() -> dict | None:
    """layerstream's summed times of lossless packing so far (None for a build without the hook)."""
    try:
        from layerstream import manager_modules

        return dict(manager_modules._testing.lossless_pack_times())
    except Exception:  # an older build, or the module not built: no figure, not a failed run
        return None


def run_mode(args, mode: str, device: torch.device) -> dict:
    """The mode's row: measured ("ok"), "skipped" with the reason, or "oom" where the device ran out of memory
    (under --vram-cap-gb, stock's lower offload_percents do): a row, not a crash."""
    try:
        return _run_mode(args, mode, device)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one, and so is an engine's CUDA allocation error
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc).lower():
            raise
        return _out_of_memory(mode, device, exc)


def _out_of_memory(mode: str, device: torch.device, exc: BaseException) -> dict:
    message = " ".join(str(exc).split()) or type(exc).__name__
    tried = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", message)
    reason = "out of device memory" + (f" (tried to allocate {tried.group(1)})" if tried else "")
    print(f"[{mode}] {reason}: {type(exc).__name__}: {message}", flush=True)
    row = {"mode": mode, "status": "oom", "reason": reason, "error": f"{type(exc).__name__}: {message}",
           "device": str(device), "peak_vram_allocated_bytes": None, "peak_vram_reserved_bytes": None,
           "peak_rss_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        row["peak_vram_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vram_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return row


def _run_mode(args, mode: str, device: torch.device) -> dict:
    cfg = PRESETS[args.preset]
    package = None
    if mode != "resident":
        package, reason = load_engine(args, mode)
        if package is None:
            return _skipped(mode, reason)

    with torch.device("meta"):
        shapes_only = cfg.model(args.checkpointing).to(DTYPE)
    weight_bytes = sum(p.nbytes for p in shapes_only.parameters())
    cap = int(args.vram_cap_gb * GiB) if args.vram_cap_gb and device.type == "cuda" else None
    if mode == "resident" and cap is not None and weight_bytes > cap:
        return _skipped(mode, f"{weight_bytes / GiB:.1f} GiB of weights do not fit in the {args.vram_cap_gb} GiB cap")
    kept = _stock_resident_bytes(shapes_only, args) if mode == "stock" else 0
    if cap is not None and kept > cap:  # a stock sweep's low offload_percents: minutes spent to learn nothing
        return _skipped(mode, f"about {kept / GiB:.1f} GiB of weights stay resident at offload_percent "
                              f"{args.offload_percent:g}: more than the {args.vram_cap_gb:g} GiB cap")

    model, build_s = _build(args, mode, cfg, weight_bytes, device)
    if mode == "layerstream" and args.host_dtype:
        os.environ["LAYERSTREAM_HOST_DTYPE"] = args.host_dtype  # read when attach creates the device state
    if mode == "layerstream":
        # How long compute waits for copies (two event records per fetch: well under 1% of a step).
        os.environ.setdefault("LAYERSTREAM_TIME_WAITS", "1")
    stock_counter = StockCopyCounter(package.manager_modules) if mode == "stock" else None
    try:
        # Cumulative counters of the bytes copied (layerstream's engine, or stock's staging calls), diffed over
        # the timed steps.
        counters = stock_counter.stats if stock_counter is not None else (
            layerstream_stats if mode == "layerstream" else None)
        network, place_s, attach_s = _place(args, mode, package, model, device)
        if cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        if args.aitk_flow and device.type == "cuda":
            # The table's peak is the training run's (the model's placement and the encoder are before it);
            # layerstream's budget measures its own window and reads none of torch's peak statistics.
            torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(args, cfg, model, network, package, device)
        steps = trainer.run(mode, counters)
        phases = trainer.phase_split(counters if steps.stats_end is not None else None)
        sweep = trainer.decode_blocks_sweep(mode)
        floor_activity, timeline = trainer.profiled_step(mode)
    finally:
        if stock_counter is not None:
            stock_counter.close()
    row = {
        "mode": mode, "status": "ok", "device": str(device),
        "s_per_step_mean": sum(steps.times) / len(steps.times), "s_per_step_min": min(steps.times),
        "step_times_s": steps.times, "losses": steps.losses, "weight_bytes": weight_bytes,
        "managed_bytes": None, "lora_params": sum(p.numel() for p in network.parameters()), "build_s": build_s,
        "place_s": place_s, "peak_vram_allocated_bytes": None, "peak_vram_reserved_bytes": None,
        "peak_rss_bytes": peak_rss_bytes(), "pinned_bytes": None, "pinned_bytes_exact": None,
        "bytes_per_step": None, "engine_stats": None, "joules_per_step": steps.joules_per_step,
        "timeline": timeline, "floor_activity": floor_activity, "phases": phases, "aitk_flow": bool(args.aitk_flow), "attach_s": attach_s,
        # The peak from the attach on (None where the platform cannot reset the peak: then peak_rss_bytes only).
        "peak_rss_from_attach_bytes": peak_rss_since_reset_bytes(),
        "lossless_pack_times": _lossless_pack_times() if mode == "layerstream" else None,
        "allocator_per_step": steps.allocator,
        "stress": steps.stress,
    }
    if sweep is not None:
        row["decode_blocks_sweep"] = sweep
    _add_memory_and_bytes(row, mode, model, device, steps)
    return row


def _add_samples(row: dict, steps: Steps) -> None:
    """--aitk-flow's samples among the timed steps: how many, and the bytes each copied on average (left out of
    bytes_per_step, as their time is left out of the steps' times)."""
    if steps.samples:
        row["samples_timed_window"] = steps.samples
        row["bytes_per_sample"] = steps.sample_bytes / steps.samples


def _add_memory_and_bytes(row: dict, mode: str, model, device: torch.device, steps: Steps) -> None:
    """The row's peak VRAM, the bytes the managers hold (pinned) and copy per timed step."""
    managed = managed_tensors(model)
    row["managed_bytes"] = sum(t.nbytes for t in managed)
    if device.type == "cuda":
        row["peak_vram_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vram_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    start, end, n = steps.stats_at_start, steps.stats_end, len(steps.times)
    if mode == "resident":
        row["pinned_bytes"] = row["pinned_bytes_exact"] = row["bytes_per_step"] = 0
        row["phases"]["forward_bytes"] = row["phases"]["backward_bytes"] = 0
    elif mode == "stock":
        row["pinned_bytes"], row["pinned_bytes_exact"] = stock_pinned_bytes(managed)
        # Counted at stock's own staging calls over the timed steps (see StockCopyCounter).
        row["bytes_per_step"] = (end["bytes_h2d"] - start["bytes_h2d"] - steps.sample_bytes) / n
        _add_samples(row, steps)
    else:
        row["engine_stats"] = end
        if end is not None:
            row["pinned_bytes"] = end.get("pinned_bytes")
            # Host memory by form (stats(); PackedWeight Parameters hold no plain copy).
            row["host_memory"] = {k: end.get(k) for k in ("host_pinned_packed_bytes", "host_pinned_plain_bytes",
                                                          "host_pageable_bytes")}
            if start is not None and "bytes_h2d" in end:
                row["bytes_per_step"] = (end["bytes_h2d"] - start["bytes_h2d"] - steps.sample_bytes) / n
                _add_samples(row, steps)
            if start is not None and end.get("copy_waits_timed"):
                row["copy_wait_ms_per_step"] = (end["copy_wait_us"] - start["copy_wait_us"]
                                                - steps.sample_wait_us) / 1e3 / n
