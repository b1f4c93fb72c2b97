"""The FLUX-shaped transformer: FLUX.1's and FLUX.2's block layout and layer shapes (shaped.py says what is
left out and why)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .shaped import ShapedTransformer, gelu_mlp, modulate


@dataclass(frozen=True)
class FluxConfig:
    hidden: int
    heads: int
    double_blocks: int
    single_blocks: int
    mlp_ratio: int
    img_tokens: int
    txt_tokens: int
    # FLUX.2's changes: a SwiGLU MLP (gate and value in one input linear), no biases, and the modulation
    # computed once for all blocks of a kind instead of by a linear in every block.
    swiglu: bool = False
    bias: bool = True
    shared_modulation: bool = False

    def model(self, checkpointing: bool) -> FluxShapedTransformer:
        return FluxShapedTransformer(self, checkpointing)


def _attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, 3*H) packed q|k|v -> attention output (B, L, H)."""
    batch, tokens, _ = qkv.shape
    q, k, v = qkv.view(batch, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(batch, tokens, -1)


class _SwiGLU(nn.Module):
    """FLUX.2's MLP: one input linear for gate and value, SiLU(gate) * value, one output linear."""

    def __init__(self, h: int, mlp: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(h, 2 * mlp, bias=bias)
        self.down = nn.Linear(mlp, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * value)


def _mlp(cfg: FluxConfig) -> nn.Module:
    h, mlp = cfg.hidden, cfg.hidden * cfg.mlp_ratio
    if cfg.swiglu:
        return _SwiGLU(h, mlp, cfg.bias)
    return gelu_mlp(h, mlp, cfg.bias)


class _Stream(nn.Module):
    """The per-stream (image or text) half of a double-stream block."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h = cfg.hidden
        if not cfg.shared_modulation:
            self.mod = nn.Linear(h, 6 * h, bias=cfg.bias)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.mlp = _mlp(cfg)


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, attending jointly over the concatenated tokens."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.heads = cfg.heads
        self.img = _Stream(cfg)
        self.txt = _Stream(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, img_m=None, txt_m=None):
        if img_m is None:  # modulation of its own (FLUX.1); FLUX.2 passes the shared one
            cond = F.silu(vec)
            img_m, txt_m = self.img.mod(cond), self.txt.mod(cond)
        img_mod = img_m.unsqueeze(1).chunk(6, dim=-1)
        txt_mod = txt_m.unsqueeze(1).chunk(6, dim=-1)
        img_qkv = self.img.qkv(modulate(self.img.norm(img), img_mod[0], img_mod[1]))
        txt_qkv = self.txt.qkv(modulate(self.txt.norm(txt), txt_mod[0], txt_mod[1]))
        attn = _attention(torch.cat((txt_qkv, img_qkv), dim=1), self.heads)
        txt_attn, img_attn = attn.split((txt.shape[1], img.shape[1]), dim=1)
        img = img + img_mod[2] * self.img.proj(img_attn)
        img = img + img_mod[5] * self.img.mlp(modulate(self.img.norm(img), img_mod[3], img_mod[4]))
        txt = txt + txt_mod[2] * self.txt.proj(txt_attn)
        txt = txt + txt_mod[5] * self.txt.mlp(modulate(self.txt.norm(txt), txt_mod[3], txt_mod[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over the concatenated tokens; qkv and the MLP input share one fused linear."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h, mlp = cfg.hidden, cfg.hidden * cfg.mlp_ratio
        self.heads = cfg.heads
        self.swiglu = cfg.swiglu
        self.split = (3 * h, 2 * mlp if cfg.swiglu else mlp)
        if not cfg.shared_modulation:
            self.mod = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.linear1 = nn.Linear(h, sum(self.split), bias=cfg.bias)
        self.linear2 = nn.Linear(h + mlp, h, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor, vec: torch.Tensor, m=None) -> torch.Tensor:
        if m is None:
            m = self.mod(F.silu(vec))
        shift, scale, gate = m.unsqueeze(1).chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(self.norm(x), shift, scale)).split(self.split, dim=-1)
        if self.swiglu:
            g, v = mlp.chunk(2, dim=-1)
            hidden = F.silu(g) * v
        else:
            hidden = self.act(mlp)
        out = self.linear2(torch.cat((_attention(qkv, self.heads), hidden), dim=-1))
        return x + gate * out


class FluxShapedTransformer(ShapedTransformer):
    def __init__(self, cfg: FluxConfig, checkpointing: bool):
        super().__init__(checkpointing)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.double_blocks))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.single_blocks))
        self.shared = cfg.shared_modulation
        if self.shared:  # FLUX.2: one modulation per kind of block, computed once per forward
            h = cfg.hidden
            self.double_mod_img = nn.Linear(h, 6 * h, bias=cfg.bias)
            self.double_mod_txt = nn.Linear(h, 6 * h, bias=cfg.bias)
            self.single_mod = nn.Linear(h, 3 * h, bias=cfg.bias)

    def block_lists(self) -> tuple[nn.ModuleList, ...]:
        return self.double_blocks, self.single_blocks

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        double_mods, single_mods = (), ()
        if self.shared:
            cond = F.silu(vec)
            double_mods = (self.double_mod_img(cond), self.double_mod_txt(cond))
            single_mods = (self.single_mod(cond),)
        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, *double_mods)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = self._run(block, x, vec, *single_mods)
        return x[:, txt.shape[1]:]
