"""What the managers hold and move: the managed tensors as stored, the pinned bytes of the stock manager, the
bytes it stages counted at its own calls, and layerstream's telemetry."""

from __future__ import annotations

import torch
from torch import nn


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """What a weight or bias is stored as: a quantized weight (optimum-quanto's, torchao's: a tensor subclass)
    as the plain tensors inside it, its codes and scale, which are what is pinned and moved, not the dtype it
    dequantizes to (whose size the subclass reports as its own); a losslessly packed weight (PackedWeight) as
    its packed bytes."""
    packed = getattr(t, "_ls_packed", None)
    if packed is not None:  # a PackedWeight (LAYERSTREAM_HOST_DTYPE=lossless): its packed bytes in the arena
        return [packed.codes if packed.plain is None else packed.plain]
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in stored_tensors(getattr(t, name))]


def managed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The weights and biases of the layers a memory manager took over, each storage once."""
    seen, tensors = set(), []
    for module in model.modules():
        if not hasattr(module, "_layer_memory_manager"):
            continue
        # _parameters directly: what the layer holds, whatever properties a subclass puts on top.
        for param in module._parameters.values():
            if param is None:
                continue
            for tensor in stored_tensors(param):
                if tensor.untyped_storage().data_ptr() not in seen:
                    seen.add(tensor.untyped_storage().data_ptr())
                    tensors.append(tensor)
    return tensors


def stock_pinned_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes torch's caching host allocator holds, exact bytes) for the pinned ones among ``tensors``.

    Every pin_memory() goes through that allocator, which rounds each block up to a power of two.
    """
    held = exact = 0
    for tensor in tensors:
        if tensor.is_pinned():
            nbytes = tensor.untyped_storage().nbytes()
            exact += nbytes
            held += 1 << max(nbytes - 1, 0).bit_length()
    return held, exact


def _stored_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else sum(x.nbytes for x in stored_tensors(t))


class StockCopyCounter:
    """The bytes AI-Toolkit's stock manager stages onto the device, counted where it stages them. Its
    bouncing autograd functions (`_BouncingLinearFn`, `_BouncingConv2dFn` in manager_modules.py of 27a03a91
    and 323b4aaf) copy the layer's weight and bias at each forward and the weight at each backward. A
    backward autograd never runs (a frozen layer whose input needs no gradient, such as FLUX's modulation
    linears fed by the timestep embedding) copies nothing: counting calls gets that right where an estimate
    from passes over the weights cannot. On a CPU process device stock copies nothing; the count is what it
    would stage on a GPU."""

    def __init__(self, stock_module) -> None:
        self.bytes = 0
        self._restore: list[tuple[type, str, object]] = []
        for name in ("_BouncingLinearFn", "_BouncingConv2dFn"):
            fn = getattr(stock_module, name, None)
            if fn is None:
                continue
            for method in ("forward", "backward"):
                original = fn.__dict__[method]
                self._restore.append((fn, method, original))
                setattr(fn, method, staticmethod(self._counted(method, original.__func__)))

    def _counted(self, method: str, original):
        counter = self

        def forward(ctx, x, weight, bias, *rest):
            # Kept on ctx for the backward: reading ctx.saved_tensors here too would unpack a checkpointed
            # block's tensors twice, which torch.utils.checkpoint refuses.
            ctx.layerstream_weight_bytes = _stored_bytes(weight)
            counter.bytes += ctx.layerstream_weight_bytes + _stored_bytes(bias)
            return original(ctx, x, weight, bias, *rest)

        def backward(ctx, *grads):
            counter.bytes += getattr(ctx, "layerstream_weight_bytes", 0)  # the weight goes back up
            return original(ctx, *grads)

        return forward if method == "forward" else backward

    def stats(self) -> dict:
        """In the shape of layerstream's stats(), for the code that diffs them."""
        return {"bytes_h2d": self.bytes}

    def close(self) -> None:
        for fn, method, original in self._restore:
            setattr(fn, method, original)
        self._restore.clear()


def layerstream_stats() -> dict | None:
    """layerstream's telemetry, or None while its manager_modules has no stats() yet."""
    try:
        from layerstream import manager_modules

        return dict(manager_modules.stats())
    except Exception:  # the module or its stats() may not exist yet: report None, not a failed run
        return None
