#!/usr/bin/env python3
"""Data-parallel LoRA training with layerstream on every rank (one process per GPU, torch.distributed),
with and without the host copy the ranks of a host share (LAYERSTREAM_SHARE_HOST), against one process
training on the whole global batch.

    python benchmarks/ddp_bench.py --preset flux1 --world 2 [--steps 5] [--json-out FILE] [--md-out FILE]

Each configuration runs in fresh processes: `share` (one host copy), `private` (LAYERSTREAM_SHARE_HOST=0)
and `single` (one rank, batch = world). Reported per configuration: s/step (mean over ranks of the timed
steps), host memory after attach and at the end - RSS of each rank (shared pages count in every rank that
maps them), PSS (shared pages split between the ranks that map them: the honest per-rank figure) and the
host's Shmem - and the final LoRA's distance to the single-process run. Without GPUs it runs the simulator
with gloo (a smoke run; `--preset small`). NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_pss() -> tuple[int, int]:
    rss = pss = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


class _Manager:
    def __init__(self, device):
        self.process_device = device


def rank_main(args) -> int:
    """One rank (or the single process): build, attach, train, report."""
    import torch.distributed as dist

    from layerstream import bench
    from layerstream import manager_modules as mm

    rank, world = args.rank, args.world_of_run
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("LAYERSTREAM_BACKEND", "sim")
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    cfg = bench.PRESETS[args.preset]
    model = bench.build_model(cfg, checkpointing=True, seed=args.seed + 2)
    t0 = time.perf_counter()
    blocks = [m for b in model.block_lists() for m in b.modules() if isinstance(m, torch.nn.Linear)]
    for layer in blocks:
        mm.LinearLayerMemoryManager.attach(layer, _Manager(device))
    for module in model.modules():  # what is not managed (modulation, norms) lives on the device
        if not hasattr(module, "_layer_memory_manager"):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(device)
    attach_s = time.perf_counter() - t0
    rss_attach, pss_attach = _rss_pss()
    network = bench.apply_lora(model, args.rank_lora, nonzero_up=True, device=device, seed=args.seed + 1)

    class Trainable(torch.nn.Module):  # DDP sees the LoRA only: the frozen base may be a read-only shared copy
        def __init__(self):
            super().__init__()
            self.network = network
            object.__setattr__(self, "model", model)

        def forward(self, img, txt, vec):
            return self.model(img, txt, vec)

    trainable = Trainable()
    wrapped = torch.nn.parallel.DistributedDataParallel(trainable, device_ids=[rank] if cuda else None) \
        if world > 1 else trainable
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(args.seed)
    global_batch = args.world
    shapes = ((global_batch, cfg.img_tokens, cfg.hidden), (global_batch, cfg.txt_tokens, cfg.hidden),
              (global_batch, cfg.hidden))
    img, txt, vec = (torch.randn(s, generator=gen, dtype=bench.DTYPE) for s in shapes)
    per = global_batch // world
    mine = slice(rank * per, (rank + 1) * per)
    img, txt, vec = (t[mine].to(device) for t in (img, txt, vec))
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = wrapped(img, txt, vec).float().pow(2).mean()
        loss.backward()
        mm.sync_grad_transfers()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    rss_end, pss_end = _rss_pss()
    stats = mm.stats()
    lora = torch.cat([p.detach().float().flatten().cpu() for p in network.parameters()])
    out = Path(args.out_dir) / f"rank{rank}.json"
    torch.save(lora, Path(args.out_dir) / f"lora{rank}.pt")
    out.write_text(json.dumps({
        "rank": rank, "world": world, "s_per_step_mean": sum(times) / len(times), "losses": losses,
        "attach_s": attach_s, "rss_after_attach": rss_attach, "pss_after_attach": pss_attach,
        "rss_end": rss_end, "pss_end": pss_end, "shmem_host": _meminfo("Shmem"),
        "host_shared_bytes": stats["host_shared_bytes"], "arena_bytes": stats["host_bytes_requested"],
        "pinned_bytes": stats["pinned_bytes"],
    }))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def run_config(args, name: str, world: int, share: bool, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NCCL_NVLS_ENABLE="0", LAYERSTREAM_SHARE_HOST="auto" if share else "0")
        cmd = [sys.executable, __file__, "--child", "--rank", str(rank), "--world-of-run", str(world),
               "--world", str(args.world), "--preset", args.preset, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--rank-lora", str(args.rank_lora), "--seed", str(args.seed),
               "--out-dir", str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        return {"config": name, "status": "failed", "exit_codes": codes}
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return {"config": name, "status": "ok", "world": world, "share": share, "ranks": ranks,
            "s_per_step_mean": sum(r["s_per_step_mean"] for r in ranks) / world,
            "rss_after_attach_total": sum(r["rss_after_attach"] for r in ranks),
            "pss_after_attach_total": sum(r["pss_after_attach"] for r in ranks),
            "pss_end_total": sum(r["pss_end"] for r in ranks),
            "host_shared_bytes": ranks[0]["host_shared_bytes"], "out_dir": str(out_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="flux1")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank-lora", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out")
    parser.add_argument("--md-out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world-of-run", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return rank_main(args)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    GiB = 1 << 30
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp_bench_") as tmp:
        for name, world, share in (("share", args.world, True), ("private", args.world, False), ("single", 1, False)):
            print(f"== {name}: {world} rank(s), shared host copy {share}", flush=True)
            rows.append(run_config(args, name, world, share, Path(tmp) / name))
            if args.json_out:  # what has run so far survives a run cut short
                Path(args.json_out).write_text(json.dumps({"preset": args.preset, "world": args.world,
                                                           "rows": rows, "partial": True}, indent=1))
        single = next(r for r in rows if r["config"] == "single" and r["status"] == "ok")
        ref = torch.load(Path(single["out_dir"]) / "lora0.pt")
        for row in rows:
            if row["status"] == "ok":
                lora = torch.load(Path(row["out_dir"]) / "lora0.pt")
                row["lora_max_abs_diff_vs_single"] = (lora - ref).abs().max().item()
                row["lora_rel_diff_vs_single"] = ((lora - ref).norm() / ref.norm()).item()
    lines = ["| config | ranks | s/step | RSS GiB after attach (sum) | PSS GiB after attach (sum) | PSS GiB at end (sum) "
             "| shared GiB | LoRA rel. diff vs single |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | failed: {r['exit_codes']} | | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['world']} | {r['s_per_step_mean']:.3f} | {r['rss_after_attach_total'] / GiB:.2f} "
                     f"| {r['pss_after_attach_total'] / GiB:.2f} | {r['pss_end_total'] / GiB:.2f} "
                     f"| {r['host_shared_bytes'] / GiB:.2f} | {r['lora_rel_diff_vs_single']:.2e} |")
    table = "\n".join(lines)
    print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "world": args.world, "rows": rows}, indent=1))
    if args.md_out:
        Path(args.md_out).write_text(f"# ddp_bench: {args.preset}, {args.world} ranks\n\n- command: "
                                     f"`{' '.join([sys.executable, *sys.argv])}`\n- date: "
                                     f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n\n{table}\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
