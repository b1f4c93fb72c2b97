"""One mode: the model built, placed (resident, or attached to AI-Toolkit's MemoryManager on stock's or
layerstream's manager_modules), trained with LoRA for the warm-up and timed steps, and measured into one row."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from .counting import StockCopyCounter, layerstream_stats, managed_tensors, stock_pinned_bytes
from .lora import apply_lora
from .measure import GiB, _Nvml, _sync, _timed, peak_rss_bytes, phase_split
from .presets import DTYPE, PRESETS, build_model
from .quant import quantize_model
from .timeline import profile_timeline


def decode_blocks_sweep(args, mode, one_step, device, model, inputs, optimizer, sync_grads) -> list[dict] | None:
    """--decode-blocks-sweep: after the timed steps, the same model again at each limit on the lossless
    decode's thread blocks (one step to settle, then --steps timed, then a phase split): the settings
    side by side in one process, with the model built and packed once."""
    if not args.decode_blocks_sweep or mode != "layerstream" or args.host_dtype != "lossless":
        return None
    from layerstream import manager_modules as mm

    before = mm._decode_blocks()
    results = []
    try:
        for blocks in (int(b) for b in args.decode_blocks_sweep.split(",")):
            mm._set_decode_blocks(blocks)
            one_step()
            times = [_timed(one_step, device)[1] for _ in range(args.steps)]
            phases = phase_split(model, inputs, optimizer, sync_grads, device, None)
            results.append({"decode_blocks": blocks, "s_per_step_mean": sum(times) / len(times),
                            "s_per_step_min": min(times), "step_times_s": times, "phases": phases})
            print(f"[{mode}] decode blocks {blocks or 'all'}: {results[-1]['s_per_step_mean']:.3f} s/step "
                  f"(min {min(times):.3f}); forward {phases['forward_s']:.3f} s, backward "
                  f"{phases['backward_s']:.3f} s", flush=True)
    finally:
        mm._set_decode_blocks(before)
    return results


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


def run_mode(args, mode: str, device: torch.device) -> dict:
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

    t0 = time.perf_counter()
    model = build_model(cfg, args.checkpointing, seed=args.seed + 2)
    if args.quantize:
        quantize_model(model, args.quantize)
    build_s = time.perf_counter() - t0
    print(f"[{mode}] built {weight_bytes / GiB:.2f} GiB of bf16 weights"
          f"{f', quantized to {args.quantize}' if args.quantize else ''} in {build_s:.1f} s", flush=True)

    if mode == "layerstream" and args.host_dtype:
        os.environ["LAYERSTREAM_HOST_DTYPE"] = args.host_dtype  # read when attach creates the device state
    if mode == "layerstream":
        # How long compute waits for copies (two event records per fetch: well under 1% of a step).
        os.environ.setdefault("LAYERSTREAM_TIME_WAITS", "1")
    stock_counter = StockCopyCounter(package.manager_modules) if mode == "stock" else None
    # Cumulative counters of the bytes copied (layerstream's engine, or stock's staging calls), diffed over
    # the timed steps.
    counters = stock_counter.stats if stock_counter is not None else (
        layerstream_stats if mode == "layerstream" else None)
    t0 = time.perf_counter()
    if args.aitk_flow and device.type == "cuda":
        # AI-Toolkit's flow (extensions_built_in/diffusion_models/flux2/flux2_model.py): the transformer goes to
        # the GPU before MemoryManager.attach, and a text encoder comes to the GPU to cache the prompts' embeddings
        # and goes again; both leave their mark on the process's peak and on torch's cache.
        model.to(device)
        encoder = torch.empty(int(args.encoder_gb * GiB), dtype=torch.uint8, device=device)
        del encoder
    if package is None:
        model.to(device)
    else:
        print(f"[{mode}] attaching AI-Toolkit's MemoryManager to the model ...", flush=True)
        attach_manager(package, model, device, args.offload_percent, args.seed)
    network = apply_lora(model, args.rank, args.lora_init_nonzero, device, seed=args.seed + 1)
    place_s = time.perf_counter() - t0
    print(f"[{mode}] placed the model and applied LoRA in {place_s:.1f} s", flush=True)
    if cap is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    if args.aitk_flow and device.type == "cuda":
        # The table's peak is the training run's (the model's placement and the encoder are before it);
        # layerstream's budget measures its own window and reads none of torch's peak statistics.
        torch.cuda.reset_peak_memory_stats(device)

    inputs_gen = torch.Generator().manual_seed(args.seed)
    img, txt, vec = (torch.randn(shape, generator=inputs_gen, dtype=DTYPE).to(device)
                     for shape in ((1, cfg.img_tokens, cfg.hidden), (1, cfg.txt_tokens, cfg.hidden), (1, cfg.hidden)))
    # --aitk-flow: buckets of several resolutions, one after the other (AI-Toolkit's default 512/768/1024 is
    # 1/4, 9/16 and all of the image tokens).
    bucket_imgs = [img[:, :max(1, int(cfg.img_tokens * f))] for f in args.buckets] if args.aitk_flow else [img]
    current = [img]
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    # AI-Toolkit's trainer joins the manager's gradient copies once per step, before the optimizer; do the same
    # (here only the LoRA trains and it lives on the device, so there is nothing to wait for, but it is called).
    sync_grads = getattr(package, "sync_grad_transfers", None)

    def one_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(current[0], txt, vec).float().pow(2).mean()
        loss.backward()
        if sync_grads is not None:
            sync_grads()
        optimizer.step()
        return loss

    losses, times = [], []
    stats_at_start = None
    nvml = _Nvml(device.index or 0) if device.type == "cuda" else None
    energy_start = None
    user_memory = []  # --user-alloc-gb: what "the user" holds on the device between some steps

    def sample() -> None:  # a sample under no_grad, as AI-Toolkit's sampling between steps
        with torch.no_grad():
            model(bucket_imgs[0], txt, vec)

    if args.aitk_flow:
        sample()  # AI-Toolkit samples before its first step by default
    for step in range(args.warmup + args.steps):
        current[0] = bucket_imgs[step % len(bucket_imgs)]
        if args.user_alloc_gb and device.type == "cuda":
            if step == args.user_alloc_at:
                user_memory.append(torch.empty(int(args.user_alloc_gb * GiB), dtype=torch.uint8, device=device))
                print(f"[{mode}] the user took {args.user_alloc_gb} GiB of the device before step {step}", flush=True)
            elif step == args.user_alloc_at + args.user_alloc_steps:
                user_memory.clear()
        if step == args.warmup and counters is not None:
            stats_at_start = counters()
        _sync(device)
        if step == args.warmup and nvml is not None:
            energy_start = nvml.energy_mj()
        loss, elapsed = _timed(one_step, device)
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(elapsed)
        print(f"[{mode}] step {step}{' (warmup)' if step < args.warmup else ''}: {elapsed:.3f} s, "
              f"loss {losses[-1]:.6g}", flush=True)
        if args.aitk_flow and args.sample_every and (step + 1) % args.sample_every == 0:
            sample()
    user_memory.clear()
    current[0] = img

    energy_end = nvml.energy_mj() if nvml is not None else None
    # The counters at the end of the timed steps: the steps below copy too, and counting them would add a
    # sixth step's bytes to five (seen: FLUX.1's bytes/step and floor read 6/5 of the truth).
    stats_end = counters() if counters is not None else None
    phases = phase_split(model, (img, txt, vec), optimizer, sync_grads, device,
                         counters if stats_end is not None else None)
    sweep = decode_blocks_sweep(args, mode, one_step, device, model, (img, txt, vec), optimizer, sync_grads)
    timeline = None
    if args.timeline_out and device.type == "cuda" and mode != "resident":
        # One more step (not timed) under the profiler: when the bus copied and when the GPU computed.
        out = Path(args.timeline_out)
        try:
            timeline = profile_timeline(one_step, device, out.with_name(f"{out.stem}-{mode}{out.suffix or '.png'}"),
                                        f"{args.preset} {mode}")
        except Exception as exc:  # the profiler is an extra: its failure must not lose the measured row
            timeline = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{mode}] timeline failed: {timeline['error']}", flush=True)
    joules_per_step = ((energy_end - energy_start) / 1e3 / len(times)
                       if energy_start is not None and energy_end is not None else None)
    managed = managed_tensors(model)
    managed_bytes = sum(t.nbytes for t in managed)
    row = {
        "mode": mode, "status": "ok", "device": str(device),
        "s_per_step_mean": sum(times) / len(times), "s_per_step_min": min(times), "step_times_s": times,
        "losses": losses, "weight_bytes": weight_bytes, "managed_bytes": managed_bytes,
        "lora_params": sum(p.numel() for p in network.parameters()), "build_s": build_s, "place_s": place_s,
        "peak_vram_allocated_bytes": None, "peak_vram_reserved_bytes": None, "peak_rss_bytes": peak_rss_bytes(),
        "pinned_bytes": None, "pinned_bytes_exact": None, "bytes_per_step": None, "engine_stats": None,
        "joules_per_step": joules_per_step, "timeline": timeline, "phases": phases,
        "aitk_flow": bool(args.aitk_flow),
    }
    if sweep is not None:
        row["decode_blocks_sweep"] = sweep
    if device.type == "cuda":
        row["peak_vram_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_vram_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if mode == "resident":
        row["pinned_bytes"] = row["pinned_bytes_exact"] = row["bytes_per_step"] = 0
        row["phases"]["forward_bytes"] = row["phases"]["backward_bytes"] = 0
    elif mode == "stock":
        row["pinned_bytes"], row["pinned_bytes_exact"] = stock_pinned_bytes(managed)
        # Counted at stock's own staging calls over the timed steps (see StockCopyCounter).
        row["bytes_per_step"] = (stats_end["bytes_h2d"] - stats_at_start["bytes_h2d"]) / len(times)
        stock_counter.close()
    else:
        stats = stats_end
        row["engine_stats"] = stats
        if stats is not None:
            row["pinned_bytes"] = stats.get("pinned_bytes")
            if stats_at_start is not None and "bytes_h2d" in stats:
                row["bytes_per_step"] = (stats["bytes_h2d"] - stats_at_start["bytes_h2d"]) / len(times)
            if stats_at_start is not None and stats.get("copy_waits_timed"):
                row["copy_wait_ms_per_step"] = (stats["copy_wait_us"] - stats_at_start["copy_wait_us"]) / 1e3 / len(times)
    return row
