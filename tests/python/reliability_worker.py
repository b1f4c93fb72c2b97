"""A training process for the reliability tests that need separate processes (resume, processes in a row).

    python reliability_worker.py train --device cpu --steps 50 [--load CKPT] [--save CKPT] [--engine resident]

Prints one line `LOSSES <repr> ...` and one line `MEMORY <host_bytes_held> <live_device_states>
<leases_outstanding>` measured after the model was freed, and exits 0. The checkpoint holds the LoRA and
optimizer state and the input generator's state, so a resumed run continues exactly where the first stopped.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from contract_driver import ContractManager  # noqa: E402
from models import TinyTransformer, apply_lora  # noqa: E402


class Trainer:
    """LoRA training of a TinyTransformer with checkpoint save/load (used in-process by the tests too)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, sync=lambda: None, seed: int = 10):
        self.model = model
        self.device = device
        self.sync = sync
        self.loras = [lo.to(device) for lo in apply_lora(model)]
        self.opt = torch.optim.AdamW([p for lo in self.loras for p in lo.parameters()], lr=1e-2)
        self.gen = torch.Generator().manual_seed(seed)
        self.width = model.norm.normalized_shape[0]

    def step(self) -> float:
        x = torch.randn(2, 6, self.width, generator=self.gen).to(self.device)
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(x).float().pow(2).mean()
        loss.backward()
        self.sync()
        self.opt.step()
        return loss.item()

    def state(self) -> dict:
        return {"loras": [lo.state_dict() for lo in self.loras], "opt": self.opt.state_dict(),
                "gen": self.gen.get_state()}

    def save(self, path) -> None:
        torch.save(self.state(), path)

    def load(self, path) -> None:
        state = torch.load(path, weights_only=True)
        for lo, sd in zip(self.loras, state["loras"]):
            lo.load_state_dict(sd)
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])


def base_model() -> torch.nn.Module:
    torch.manual_seed(21)
    return TinyTransformer(d=64, ff=256, layers=2, checkpointing="non_reentrant").requires_grad_(False)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", choices=["layerstream", "resident"], default="layerstream")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--load")
    parser.add_argument("--save")
    args = parser.parse_args()
    from layerstream import manager_modules as mm

    device = torch.device(args.device)
    model = copy.deepcopy(base_model())
    driver = None
    if args.engine == "layerstream":
        driver = ContractManager.attach(mm, model, device)
        driver.to_device()
    else:
        model.to(device)
    trainer = Trainer(model, device, mm.sync_grad_transfers if driver else (lambda: None))
    if args.load:
        trainer.load(args.load)
    losses = [trainer.step() for _ in range(args.steps)]
    if args.save:
        trainer.save(args.save)
    if driver is not None:
        driver.free()
    for key in list(mm._DEVICE_STATE):
        del mm._DEVICE_STATE[key]
    del trainer, model, driver
    import gc

    gc.collect()
    stats = mm.stats()
    print("LOSSES", " ".join(map(repr, losses)))
    print("MEMORY", stats["host_bytes_held"], mm.live_device_states(), stats["leases_outstanding"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
