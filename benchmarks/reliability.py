#!/usr/bin/env python3
"""Reliability figures that are timings or trends, so they belong here and not in the unit tests:

  * cycles: N times attach -> train S steps -> free in one process; per cycle the first-step latency, and
    after the free the host RSS, layerstream's host bytes and the device memory (all must return to the
    baseline; the first-step latency of every cycle should stay within 1.2x of the first cycle's);
  * long run: L steps with a checkpoint (LoRA + optimizer state, torch.save) every K steps; per window the
    mean step time, RSS, host bytes and device memory (all flat).

    python benchmarks/reliability.py [--cycles 50] [--steps 5] [--long-steps 1000] [--save-every 100]
                                     [--hidden 1024] [--layers 8] [--json-out FILE]

On a machine without a GPU it runs on the CPU through the simulator backend (LAYERSTREAM_BACKEND=sim).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if torch.is_grad_enabled() else block(x)
        return x


class LoRA(torch.nn.Module):
    def __init__(self, layer: torch.nn.Linear, rank: int = 16):
        super().__init__()
        self.down = torch.nn.Parameter(torch.randn(rank, layer.in_features) * 0.01)
        self.up = torch.nn.Parameter(torch.zeros(layer.out_features, rank))
        self.org_forward = layer.forward
        layer.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + F.linear(F.linear(x, self.down.to(x.dtype)), self.up.to(x.dtype))


class Managed:
    """Attach every Linear the way AI-Toolkit's manager does (layer by layer), and free it again."""

    def __init__(self, mm, model: torch.nn.Module, device: torch.device):
        class Owner:
            process_device = device

        self.mm, self.model = mm, model
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                mm.LinearLayerMemoryManager.attach(m, Owner())
            elif not any(True for _ in m.children()):
                m.to(device)

    def free(self):
        for m in self.model.modules():
            lmm = getattr(m, "_layer_memory_manager", None)
            if lmm is not None:
                m.forward = lmm._original_forward
                del m._layer_memory_manager
        torch.nn.Module.to(self.model, "meta")
        for key in list(self.mm._DEVICE_STATE):
            del self.mm._DEVICE_STATE[key]


def rss_bytes() -> int | None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError):
        return None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_bytes(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("LAYERSTREAM_BACKEND", "sim")
    from layerstream import manager_modules as mm

    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    base = Model(args.hidden, args.layers).to(dtype).requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    x_host = torch.randn(4, 256, args.hidden, generator=gen).to(dtype)

    def session(steps: int, save_every: int = 0, on_window=None):
        model = copy.deepcopy(base)
        managed = Managed(mm, model, device)
        loras = [LoRA(m).to(device) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        opt = torch.optim.AdamW([p for lo in loras for p in lo.parameters()], lr=1e-3)
        x = x_host.to(device)
        times = []
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                model(x).float().pow(2).mean().backward()
                mm.sync_grad_transfers()
                opt.step()
                sync(device)
                times.append(time.perf_counter() - t0)
                if save_every and (step + 1) % save_every == 0:
                    torch.save({"loras": [lo.state_dict() for lo in loras], "opt": opt.state_dict()},
                               os.path.join(tmp, "ckpt.pt"))
                    if on_window:
                        on_window(step + 1, times[-save_every:])
        managed.free()
        del model, managed, loras, opt, x
        gc.collect()
        return times

    # One all-resident step first: torch's own one-time device allocations (cuBLAS/cuBLASLt workspaces,
    # kept per handle and stream for the life of the process) then sit in the baseline, not in cycle 0.
    warm_model = copy.deepcopy(base).to(device)
    warm_loras = [LoRA(m).to(device) for m in warm_model.modules() if isinstance(m, torch.nn.Linear)]
    warm_model(x_host.to(device)).float().pow(2).mean().backward()
    sync(device)
    del warm_model, warm_loras
    gc.collect()

    # --- cycles
    base_rss, base_dev = rss_bytes(), device_bytes(device)
    cycles = []
    for cycle in range(args.cycles):
        times = session(args.steps)
        stats = mm.stats()
        cycles.append({"cycle": cycle, "first_step_s": times[0], "rss": rss_bytes(), "host_bytes_held":
                       stats["host_bytes_held"], "pinned_bytes": stats["pinned_bytes"],
                       "device_bytes": device_bytes(device), "live_states": mm.live_device_states()})
    first = cycles[0]["first_step_s"]
    worst = max(c["first_step_s"] for c in cycles[1:]) if len(cycles) > 1 else first
    print(f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'CPU, sim backend'}), "
          f"{args.layers} blocks of hidden {args.hidden}, {weight_bytes / 2**20:.1f} MiB of {dtype} weights")
    print(f"cycles: {args.cycles} x (attach, {args.steps} steps, free)")
    print(f"  first-step latency: cycle 0 {first * 1e3:.1f} ms, worst later cycle {worst * 1e3:.1f} ms "
          f"({worst / first:.2f}x), median {statistics.median(c['first_step_s'] for c in cycles) * 1e3:.1f} ms")
    last = cycles[-1]
    warm = statistics.median(c["rss"] for c in cycles[5:15]) if base_rss and len(cycles) >= 15 else None
    print(f"  after the last free: host bytes held {last['host_bytes_held']}, pinned {last['pinned_bytes']}, "
          f"device bytes {last['device_bytes']} (baseline {base_dev}), live engines {last['live_states']}")
    dev = [c["device_bytes"] for c in cycles]
    print(f"  device bytes after each free: min {min(dev)}, max {max(dev)} (baseline {base_dev})")
    if warm:
        print(f"  host RSS: baseline {base_rss / 2**20:.1f} MiB, warm (median of cycles 5-14) {warm / 2**20:.1f} MiB, "
              f"last {last['rss'] / 2**20:.1f} MiB ({last['rss'] / warm:.4f}x warm)")

    # --- long run
    windows = []

    def on_window(step, window_times):
        stats = mm.stats()
        windows.append({"step": step, "mean_step_s": statistics.mean(window_times), "rss": rss_bytes(),
                        "host_bytes_held": stats["host_bytes_held"], "device_bytes": device_bytes(device)})

    if args.long_steps:
        session(args.long_steps, args.save_every, on_window)
        print(f"long run: {args.long_steps} steps, a checkpoint every {args.save_every}")
        print("| steps | mean s/step | host RSS MiB | host bytes held | device bytes |")
        print("|---|---|---|---|---|")
        for w in windows:
            rss = f"{w['rss'] / 2**20:.1f}" if w["rss"] else "-"
            print(f"| {w['step']} | {w['mean_step_s']:.4f} | {rss} | {w['host_bytes_held']} | {w['device_bytes']} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "device": str(device), "weight_bytes": weight_bytes, "cycles": cycles,
                       "long_run": windows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
