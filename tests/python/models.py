"""Small models for the tests, written here: a pre-norm transformer like AI-Toolkit's memory-manager test
model (at toy size), and a LoRA wrapper that patches a layer's forward after the memory manager has
attached, as AI-Toolkit's LoRA networks do."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, d, bias=False)
        self.v = torch.nn.Linear(d, d, bias=False)
        self.o = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, ff)
        self.down = torch.nn.Linear(ff, d)

    def forward(self, x):
        b, n, d = x.shape
        h = self.ln1(x)
        q, k, v = (t(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyTransformer(torch.nn.Module):
    def __init__(self, d=64, heads=4, ff=128, layers=3, checkpointing=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.checkpointing = checkpointing  # None, "reentrant" or "non_reentrant"

    def forward(self, x):
        if self.checkpointing == "reentrant" and torch.is_grad_enabled() and not x.requires_grad:
            # Reentrant checkpointing only tracks gradients that flow through its inputs.
            x = x.detach().requires_grad_(True)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = block(x)
        return self.norm(x)


class LoRA(torch.nn.Module):
    """Adds up(down(x)) * scale to a layer by replacing its forward (kept as org_forward)."""

    def __init__(self, layer: torch.nn.Linear, rank: int, seed: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        down = torch.randn(rank, layer.in_features, generator=g) / math.sqrt(layer.in_features)
        self.down = torch.nn.Parameter(down.to(dtype))
        self.up = torch.nn.Parameter((torch.randn(layer.out_features, rank, generator=g) * 0.01).to(dtype))
        self.scale = 1.0
        self.org_forward = layer.forward
        layer.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + F.linear(F.linear(x, self.down), self.up) * self.scale


def apply_lora(model: torch.nn.Module, rank: int = 4, dtype: torch.dtype = torch.float32) -> list[LoRA]:
    loras = []
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        loras.append(LoRA(layer, rank, seed=1000 + i, dtype=dtype))
    return loras


def train_lora(model, loras, device, steps, sync=lambda: None, seed=10, dtype=torch.float32) -> list[float]:
    """AdamW on the LoRA parameters; `sync` is called where AI-Toolkit's trainer joins gradient copies; the
    inputs are `dtype` (the model's)."""
    opt = torch.optim.AdamW([p for lo in loras for p in lo.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    width = model.norm.normalized_shape[0]
    for _ in range(steps):
        x = torch.randn(2, 6, width, generator=g).to(device, dtype)
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        sync()
        opt.step()
        losses.append(loss.item())
    return losses
