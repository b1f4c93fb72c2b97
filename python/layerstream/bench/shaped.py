"""What the shaped transformers share. Each has a real model's block layout and layer shapes with random weights
and no embedders, RoPE or final layer: only the block linears matter for what is measured, how long a training
step takes when those weights stream over the bus. Every streamed layer is an ``nn.Linear``, the class AI-Toolkit's
MemoryManager takes over (and so layerstream)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class ShapedTransformer(nn.Module):
    """``forward(img, txt, vec)``: image (or video) tokens (1, img_tokens, hidden), text tokens (1, txt_tokens,
    hidden) and the timestep embedding (1, hidden) in; the image tokens out. A config names its model class in
    ``model(checkpointing)`` and has ``hidden``, ``img_tokens`` and ``txt_tokens``."""

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing

    def _run(self, block: nn.Module, *inputs):
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *inputs, use_reentrant=False)
        return block(*inputs)

    def block_lists(self) -> tuple[nn.ModuleList, ...]:
        """The transformer blocks, in order: LoRA goes on every linear inside them (as AI-Toolkit's networks
        target the blocks)."""
        raise NotImplementedError

    def loose_parameters(self) -> list[nn.Parameter]:
        """Parameters held by a block itself rather than by a layer in it: AI-Toolkit's MemoryManager moves them
        only when attach() is given them as ``ignore_modules`` (its Wan models pass their ``scale_shift_table``)."""
        return []


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q (B, Lq, H), k and v (B, Lk, H) -> attention output (B, Lq, H) over ``heads`` heads."""
    def split(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).flatten(2)


def gelu_mlp(hidden: int, inner: int, bias: bool = True) -> nn.Sequential:
    """Linear, GELU (tanh approximation), Linear: the MLP of FLUX.1, Qwen-Image and Wan."""
    return nn.Sequential(nn.Linear(hidden, inner, bias=bias), nn.GELU(approximate="tanh"),
                         nn.Linear(inner, hidden, bias=bias))
