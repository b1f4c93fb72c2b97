"""What the single-rank reference and the ranks of test_shared_host.py share: the LoRA network, wired so
that DDP can wrap the LoRA parameters alone (the frozen base stays outside it), and the data."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GLOBAL_BATCH = 4


class _LoRA(torch.nn.Module):
    def __init__(self, layer: torch.nn.Linear, rank: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.down = torch.nn.Parameter(torch.randn(rank, layer.in_features, generator=g) / math.sqrt(layer.in_features))
        self.up = torch.nn.Parameter(torch.randn(layer.out_features, rank, generator=g) * 0.01)


class LoRANet(torch.nn.Module):
    """Patches every linear of `model`: forward = base(x) + up(down(x)). Only the LoRA parameters are
    registered: DDP wraps this module and must not see the frozen base (it would broadcast into it, and a
    shared host copy is read-only)."""

    def __init__(self, model: torch.nn.Module, rank: int = 4):
        super().__init__()
        object.__setattr__(self, "model", model)
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.loras = torch.nn.ModuleList(_LoRA(layer, rank, seed=1000 + i) for i, layer in enumerate(layers))
        for layer, lora in zip(layers, self.loras):
            base = layer.forward
            layer.forward = lambda x, base=base, lora=lora: base(x) + F.linear(F.linear(x, lora.down), lora.up)

    def forward(self, x):
        return self.model(x)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, 64, generator=g), torch.randn(GLOBAL_BATCH, 8, 64, generator=g)
