"""Library-quantized weights, as AI-Toolkit makes them: optimum-quanto's (``qfloat8``, ``qint8``; AI-Toolkit's
``quantize: true`` default without layer offloading) or torchao's weight-only ``float8``, which AI-Toolkit's
config turns qfloat8 into when ``layer_offloading`` is on (toolkit/config_modules.py)."""

from __future__ import annotations

import torch
from torch import nn

QTYPES = ("qfloat8", "qint8", "float8")


def quantize_model(model: nn.Module, qtype: str, device: torch.device | None = None) -> None:
    """Every linear's weight quantized and frozen, the model left on the CPU."""
    if qtype == "float8":
        _torchao_float8(model, device)
        return
    import optimum.quanto as quanto

    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    model.requires_grad_(False)


def _torchao_float8(model, device: torch.device | None) -> None:
    """torchao's Float8WeightOnlyConfig, the config AI-Toolkit's get_qtype("float8") holds, applied the way its
    quantize_model (toolkit/util/quantize.py) applies it without an accuracy-recovery adapter: each block on the
    device, quantized there and back to the CPU, then the rest of the model where it is."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    for block in (b for blocks in model.block_lists() for b in blocks):
        if device is not None:
            block.to(device)
        quantize_(block, Float8WeightOnlyConfig())
        if device is not None:
            block.to("cpu")
    quantize_(model, Float8WeightOnlyConfig())  # what is outside the blocks (quantized ones are passed over)
    model.requires_grad_(False)
