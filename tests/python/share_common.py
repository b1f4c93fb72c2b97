"""What the single-rank reference and the ranks of test_shared_host.py share: the LoRA network, wired so
that DDP can wrap the LoRA parameters alone (the frozen base stays outside it), and the data."""

from __future__ import annotations

import torch

from models import LoRA

GLOBAL_BATCH = 4


class LoRANet(torch.nn.Module):
    """A LoRA on every linear of `model` (models.LoRA: forward = base(x) + up(down(x))). Only the LoRA
    parameters are registered: DDP wraps this module and must not see the frozen base (it would broadcast
    into it, and a shared host copy is read-only)."""

    def __init__(self, model: torch.nn.Module, rank: int = 4):
        super().__init__()
        object.__setattr__(self, "model", model)
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.loras = torch.nn.ModuleList(LoRA(layer, rank, seed=1000 + i) for i, layer in enumerate(layers))

    def forward(self, x):
        return self.model(x)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, 64, generator=g), torch.randn(GLOBAL_BATCH, 8, 64, generator=g)
