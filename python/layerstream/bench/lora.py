"""LoRA, wrapping the layers the way AI-Toolkit's LoRA network does."""

from __future__ import annotations

import math

import torch
from torch import nn

from .presets import DTYPE, _init_parallel
from .shaped import ShapedTransformer


class LoRAModule(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.lora_down = nn.Linear(base.in_features, rank, bias=False, dtype=DTYPE)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False, dtype=DTYPE)
        self.scale = alpha / rank
        self.org_forward = None

    def init_weights(self, generator: torch.Generator, nonzero_up: bool) -> None:
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5), generator=generator)
        if nonzero_up:
            # Small, so the adapted model stays close to the base one, but nonzero, so that lora_down gets a
            # gradient too and the step exercises every backward path.
            self.lora_up.weight.normal_(0.0, 1e-3, generator=generator)
        else:
            nn.init.zeros_(self.lora_up.weight)

    def apply_to(self, base: nn.Linear) -> None:
        # Whatever forward the layer has now is wrapped: with a memory manager attached, that is the
        # manager's bouncing forward. The base layer is not registered as a submodule (nor is the LoRA in the
        # model), so the manager never sees the LoRA's linears and they stay on the device.
        self.org_forward = base.forward
        base.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.scale


def apply_lora(model: ShapedTransformer, rank: int, nonzero_up: bool, device: torch.device,
               seed: int) -> nn.ModuleList:
    """A LoRA on every linear inside the blocks; returns the network (the trainable parameters)."""
    targets = [m for blocks in model.block_lists() for m in blocks.modules() if isinstance(m, nn.Linear)]
    with torch.device("meta"):
        network = nn.ModuleList(LoRAModule(base, rank, alpha=float(rank)) for base in targets)
    network.to_empty(device="cpu")
    # Initialised on the CPU with CPU generators, so every mode and device starts from the same LoRA.
    _init_parallel([lambda g, lora=lora: lora.init_weights(g, nonzero_up) for lora in network], seed)
    network.to(device)
    for lora, base in zip(network, targets):
        lora.apply_to(base)
    return network
