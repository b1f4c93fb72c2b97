"""One rank of the shared-host-copy tests (tests/python/test_shared_host.py): joins a gloo process group,
attaches a TinyTransformer (the same weights on every rank unless told otherwise), trains its LoRA under
DistributedDataParallel on its share of a global batch, and writes what it saw as JSON.

    python share_worker.py RANK WORLD INIT_FILE OUT_JSON BACKEND(cpu|sim|cuda) [--other-weights] [--quantized] [--lossless]
                           [--steps N]

cuda: rank r computes on cuda:r with NCCL (NCCL_NVLS_ENABLE=0: no NVLink multicast).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyTransformer  # noqa: E402
from share_common import GLOBAL_BATCH, LoRANet, batch  # noqa: E402


class Manager:
    def __init__(self, device):
        self.process_device = torch.device(device)


def shm_mappings() -> int:
    """Distinct shared segments of layerstream mapped in this process (/proc/self/maps)."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/ls-" in line:
                names.add(line.split("/dev/shm/")[1].split()[0])
    return len(names)


def main() -> int:
    rank, world, init_file, out, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 5
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if backend == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ["LAYERSTREAM_BACKEND"] = backend
        device = torch.device("cpu")
    dist.init_process_group("nccl" if backend == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    from layerstream import manager_modules as mm

    torch.manual_seed(0)
    model = TinyTransformer(checkpointing="non_reentrant").requires_grad_(False)
    if "--quantized" in sys.argv:  # optimum-quanto qfloat8 weights: their codes and scales are shared
        import optimum.quanto as quanto

        quanto.quantize(model, weights=quanto.qfloat8)
        quanto.freeze(model)
        model.requires_grad_(False)
    if "--lossless" in sys.argv:  # bf16 linears, packed losslessly (LAYERSTREAM_HOST_DTYPE=lossless): the packed
        # bytes are shared, and each rank's Parameters are PackedWeights of the shared bytes
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.to(torch.bfloat16)
    if "--other-weights" in sys.argv and rank == 1:
        with torch.no_grad():
            model.blocks[1].up.weight.add_(1.0)
    result = {"rank": rank}
    try:
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                mm.LinearLayerMemoryManager.attach(layer, Manager(device))
    except Exception as exc:  # the mismatch test expects this on rank 1
        result["attach_error"] = f"{type(exc).__name__}: {exc}"
    failed = torch.tensor([int("attach_error" in result)], device=device)
    dist.all_reduce(failed)  # every rank stops when one could not attach
    if failed.item():
        json.dump(result, open(out, "w"))
        dist.destroy_process_group()
        return 0
    stats = mm.stats()
    result.update(host_shared_bytes=stats["host_shared_bytes"], host_shared_blocks=stats["host_shared_blocks"],
                  arena_bytes=stats["host_bytes_requested"], mappings=shm_mappings(),
                  packed=sum(m._layer_memory_manager.packed_bytes for m in model.modules()
                             if hasattr(m, "_layer_memory_manager")),
                  packed_weights=sum(type(m.weight).__name__ == "PackedWeight" for m in model.modules()
                                     if hasattr(m, "_layer_memory_manager")),
                  host_pageable_bytes=stats["host_pageable_bytes"])
    for name, module in model.named_modules():  # the unmanaged parts (norms) go to the device
        if not hasattr(module, "_layer_memory_manager"):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(device)
    net = LoRANet(model).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank] if backend == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        x, target = (t.to(device) for t in batch(step))
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad(set_to_none=True)
        loss = (ddp(x[mine]) - target[mine]).pow(2).mean()
        loss.backward()
        mm.sync_grad_transfers()
        opt.step()
        losses.append(loss.item())
    result["losses"] = losses
    result["lora"] = [p.detach().tolist() for p in net.loras.parameters()]
    json.dump(result, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
