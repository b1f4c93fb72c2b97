"""The Wan-shaped video transformer (diffusers' WanTransformer3DModel, Wan 2.1 and 2.2 14B): blocks of
self-attention over the video tokens, cross-attention to the text tokens and a GELU-tanh FFN. The q and k of
both attentions pass an RMSNorm across all heads; the timestep's modulation is one linear shared by all
blocks, plus a learned table per block; norms, modulation and residuals run in float32 as Wan's do. Video
makes the sequences long (81 frames at 480x832: 21 x 30 x 52 = 32,760 tokens), so compute, not the bus,
dominates a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .shaped import ShapedTransformer, attention, gelu_mlp


@dataclass(frozen=True)
class WanConfig:
    hidden: int
    heads: int
    blocks: int
    ffn: int
    img_tokens: int  # the video's tokens
    txt_tokens: int

    def model(self, checkpointing: bool) -> WanShapedTransformer:
        return WanShapedTransformer(self, checkpointing)


class _Float32LayerNorm(nn.LayerNorm):
    """A LayerNorm computed in float32 whatever the input's and the weights' dtype; the output is float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


class _Attention(nn.Module):
    """Self-attention (context None) or cross-attention to ``context``."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.norm_q = nn.RMSNorm(h, eps=1e-6)
        self.norm_k = nn.RMSNorm(h, eps=1e-6)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        q, k = self.norm_q(self.q(x)), self.norm_k(self.k(context))
        return self.out(attention(q, k, self.v(context), self.heads))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        h = cfg.hidden
        self.norm1 = _Float32LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.self_attn = _Attention(h, cfg.heads)
        self.norm2 = _Float32LayerNorm(h, elementwise_affine=True, eps=1e-6)  # Wan 14B's cross_attn_norm
        self.cross_attn = _Attention(h, cfg.heads)
        self.norm3 = _Float32LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.ffn = gelu_mlp(h, cfg.ffn)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, h))

    def forward(self, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
        attn = self.self_attn((self.norm1(x) * (1 + scale) + shift).type_as(x))
        x = (x.float() + attn * gate).type_as(x)
        x = x + self.cross_attn(self.norm2(x).type_as(x), context)
        ffn = self.ffn((self.norm3(x) * (1 + ffn_scale) + ffn_shift).type_as(x))
        return (x.float() + ffn.float() * ffn_gate).type_as(x)


class WanShapedTransformer(ShapedTransformer):
    def __init__(self, cfg: WanConfig, checkpointing: bool):
        super().__init__(checkpointing)
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.blocks))
        self.time_projection = nn.Linear(cfg.hidden, 6 * cfg.hidden)  # shared by every block

    def block_lists(self) -> tuple[nn.ModuleList, ...]:
        return (self.blocks,)

    def loose_parameters(self) -> list[nn.Parameter]:
        return [block.scale_shift_table for block in self.blocks]

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        temb = self.time_projection(F.silu(vec)).unflatten(-1, (6, -1))  # (1, 6, hidden)
        for block in self.blocks:
            img = self._run(block, img, txt, temb)
        return img
