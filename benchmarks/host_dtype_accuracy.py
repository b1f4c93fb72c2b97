#!/usr/bin/env python3
"""What LAYERSTREAM_HOST_DTYPE costs in accuracy: the same LoRA training (a FLUX-shaped model from
layerstream.bench, random N(0, 0.02) weights, checkpointing, every linear managed) with bf16 weights and
with float8 host storage, side by side, on the simulator (CPU) or a GPU. Reports the relative error of
every managed layer's output on the first step's inputs and the two loss curves.

    python benchmarks/host_dtype_accuracy.py [--preset small] [--steps 30] [--json-out FILE]

Random weights have no outliers; real checkpoints do, and per-channel scales then lose more on the
channels that hold them. Treat the figures as a lower bound of the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

HOST_DTYPES = ("", "float8_e4m3fn", "float8_e5m2")


class _Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def train(preset: str, steps: int, rank: int, seed: int) -> dict:
    """One run in this process (LAYERSTREAM_HOST_DTYPE as the environment has it)."""
    from layerstream import bench
    from layerstream import manager_modules as mm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("LAYERSTREAM_BACKEND", "sim")
    cfg = bench.PRESETS[preset]
    model = bench.build_model(cfg, checkpointing=True, seed=seed + 2)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # Each layer's output error against its bf16 weight, on an input of the layer's width.
    gen = torch.Generator().manual_seed(seed)
    probes = [torch.randn(64, m.in_features, generator=gen, dtype=bench.DTYPE) for m in linears]
    exact = [torch.nn.functional.linear(x, m.weight, m.bias) for x, m in zip(probes, linears)]
    for m in linears:
        mm.LinearLayerMemoryManager.attach(m, _Manager(device))
    model.to(device)
    errors = []
    with torch.no_grad():
        for x, m, e in zip(probes, linears, exact):
            y = m(x.to(device)).cpu().float()
            errors.append(((y - e.float()).norm() / e.float().norm()).item())
    stored = sorted({m._layer_memory_manager.stored_as for m in linears})
    network = bench.apply_lora(model, rank, nonzero_up=True, device=device, seed=seed + 1)
    inputs = torch.Generator().manual_seed(seed)
    img, txt, vec = (torch.randn(shape, generator=inputs, dtype=bench.DTYPE).to(device)
                     for shape in ((1, cfg.img_tokens, cfg.hidden), (1, cfg.txt_tokens, cfg.hidden), (1, cfg.hidden)))
    target = torch.randn((1, cfg.img_tokens, cfg.hidden), generator=inputs, dtype=bench.DTYPE).to(device)
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = (model(img, txt, vec).float() - target.float()).pow(2).mean()
        loss.backward()
        mm.sync_grad_transfers()
        optimizer.step()
        losses.append(loss.item())
    return {"stored_as": stored, "layer_rel_errors": errors, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(train(args.preset, args.steps, args.rank, args.seed)))
        return 0
    runs = {}
    for host_dtype in HOST_DTYPES:
        env = dict(os.environ, LAYERSTREAM_HOST_DTYPE=host_dtype)
        cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--steps", str(args.steps),
               "--rank", str(args.rank), "--seed", str(args.seed)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        runs[host_dtype or "bf16"] = json.loads(out.strip().splitlines()[-1])
    base = runs["bf16"]["losses"]
    print(f"preset {args.preset}, {args.steps} LoRA steps (rank {args.rank}), device "
          f"{'cuda' if torch.cuda.is_available() else 'sim'}")
    print(f"{'weights':15} {'stored as':16} {'layer err mean':>14} {'max':>8} {'loss[0]':>10} {'loss[-1]':>10} "
          f"{'max |dloss|/loss':>16}")
    summary = {}
    for name, run in runs.items():
        errs = run["layer_rel_errors"]
        dloss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], base))
        summary[name] = {"stored_as": run["stored_as"], "layer_err_mean": sum(errs) / len(errs),
                         "layer_err_max": max(errs), "loss_first": run["losses"][0], "loss_last": run["losses"][-1],
                         "max_rel_loss_diff_vs_bf16": dloss, "losses": run["losses"]}
        print(f"{name:15} {','.join(run['stored_as']):16} {sum(errs) / len(errs):>14.4f} {max(errs):>8.4f} "
              f"{run['losses'][0]:>10.5f} {run['losses'][-1]:>10.5f} {dloss:>16.4f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"preset": args.preset, "steps": args.steps, "rank": args.rank, "runs": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
