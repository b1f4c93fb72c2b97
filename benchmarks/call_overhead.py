#!/usr/bin/env python3
"""Per-call host overhead of a managed layer: many small Linear layers called in a loop, so that the time
is the host's (Python, checks, stream and event calls), not the GPU's. Reports microseconds per call for a
plain resident layer, AI-Toolkit's stock manager (with --aitk-dir or AI_TOOLKIT_DIR) and layerstream.
The target is at most 30 us per call for layerstream.

  python benchmarks/call_overhead.py [--layers 200] [--calls 20] [--aitk-dir PATH]
"""

from __future__ import annotations

import argparse
import os
import time

import torch


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def _time_calls(layers, x, rounds: int) -> float:
    """Seconds per layer call, best of `rounds` passes over all layers (no grad: the forward path only)."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(rounds):
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for layer in layers:
                layer(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / len(layers))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--calls", type=int, default=20, help="passes over all layers; the best is reported")
    parser.add_argument("--aitk-dir", default=os.environ.get("AI_TOOLKIT_DIR", "").split(os.pathsep)[0] or None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)

    def make():
        torch.manual_seed(0)
        return [torch.nn.Linear(64, 64).to(torch.bfloat16) for _ in range(args.layers)]

    rows = [("resident", _time_calls([layer.to(device) for layer in make()], x, args.calls))]
    if args.aitk_dir:
        from layerstream.aitk import load_memory_management

        stock = load_memory_management(args.aitk_dir, engine="stock")
        from importlib import import_module

        stock_mm = import_module(stock.__name__ + ".manager_modules")
        layers = make()
        for layer in layers:
            stock_mm.LinearLayerMemoryManager.attach(layer, Manager(device))
        rows.append(("stock AI-Toolkit", _time_calls(layers, x, args.calls)))
    from layerstream import manager_modules

    layers = make()
    for layer in layers:
        manager_modules.LinearLayerMemoryManager.attach(layer, Manager(device))
    rows.append(("layerstream", _time_calls(layers, x, args.calls)))

    print(f"per-call host time, {args.layers} Linear(64, 64) bf16 layers on {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), best of {args.calls} passes")
    print("| mode | us per call |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
