"""The Qwen-Image-shaped transformer (diffusers' QwenImageTransformer2DModel): an MMDiT of dual-stream blocks.
Each block has an image and a text stream with weights of their own (a modulation linear fed by the timestep,
q, k and v linears with an RMSNorm over each head of q and k, an output linear, and a GELU-tanh MLP), and
attends jointly over the text and image tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .shaped import ShapedTransformer, attention, gelu_mlp, modulate


@dataclass(frozen=True)
class QwenImageConfig:
    hidden: int
    heads: int
    blocks: int
    mlp_ratio: int
    img_tokens: int
    txt_tokens: int

    def model(self, checkpointing: bool) -> QwenImageShapedTransformer:
        return QwenImageShapedTransformer(self, checkpointing)


class _Stream(nn.Module):
    """One stream's weights (image or text) in a dual-stream block."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        h, head_dim = cfg.hidden, cfg.hidden // cfg.heads
        self.mod = nn.Linear(h, 6 * h)
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.out = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = gelu_mlp(h, h * cfg.mlp_ratio)

    def qkv(self, x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k normalized per head, as (B, L, H) like v."""
        def per_head(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
            return norm(t.unflatten(-1, (heads, -1))).flatten(2)

        return per_head(self.norm_q, self.q(x)), per_head(self.norm_k, self.k(x)), self.v(x)


class DualStreamBlock(nn.Module):
    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        self.heads = cfg.heads
        self.img = _Stream(cfg)
        self.txt = _Stream(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor):
        cond = F.silu(vec)
        img_mod = self.img.mod(cond).unsqueeze(1).chunk(6, dim=-1)  # shift, scale, gate; twice
        txt_mod = self.txt.mod(cond).unsqueeze(1).chunk(6, dim=-1)
        img_q, img_k, img_v = self.img.qkv(modulate(self.img.norm1(img), img_mod[0], img_mod[1]), self.heads)
        txt_q, txt_k, txt_v = self.txt.qkv(modulate(self.txt.norm1(txt), txt_mod[0], txt_mod[1]), self.heads)
        joint = attention(torch.cat((txt_q, img_q), dim=1), torch.cat((txt_k, img_k), dim=1),
                          torch.cat((txt_v, img_v), dim=1), self.heads)
        txt_attn, img_attn = joint.split((txt.shape[1], img.shape[1]), dim=1)
        img = img + img_mod[2] * self.img.out(img_attn)
        txt = txt + txt_mod[2] * self.txt.out(txt_attn)
        img = img + img_mod[5] * self.img.mlp(modulate(self.img.norm2(img), img_mod[3], img_mod[4]))
        txt = txt + txt_mod[5] * self.txt.mlp(modulate(self.txt.norm2(txt), txt_mod[3], txt_mod[4]))
        return img, txt


class QwenImageShapedTransformer(ShapedTransformer):
    def __init__(self, cfg: QwenImageConfig, checkpointing: bool):
        super().__init__(checkpointing)
        self.blocks = nn.ModuleList(DualStreamBlock(cfg) for _ in range(cfg.blocks))

    def block_lists(self) -> tuple[nn.ModuleList, ...]:
        return (self.blocks,)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            img, txt = self._run(block, img, txt, vec)
        return img
