"""Library-quantized weights, as AI-Toolkit makes them."""

from __future__ import annotations

from torch import nn


def quantize_model(model: nn.Module, qtype: str) -> None:
    """optimum-quanto weights (AI-Toolkit's `quantize: true` default is qfloat8) on every linear, frozen."""
    import optimum.quanto as quanto

    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    model.requires_grad_(False)
