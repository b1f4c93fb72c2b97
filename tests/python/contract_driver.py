"""Drives a ``manager_modules`` implementation the way AI-Toolkit's ``manager.py`` does.

Written here from the contract (docs/ai-toolkit.md, shared/docs/ai-toolkit-contract.md), not copied:
attach walks ``named_modules()`` and hands each Linear/Conv2d-named layer to the layer managers, patches
the root's ``.to``; ``detach`` restores forwards, swaps pinned weights for unpinned clones with
``object.__setattr__`` (leaving ``_parameters`` pointing at the old pinned tensor, as upstream does),
deletes the attributes and every CUDA key of ``_DEVICE_STATE``; ``free`` does the same without the
unpinning, then moves the module to ``meta``. Tests that have a real AI-Toolkit checkout run its
``manager.py`` instead (see test_aitk_real.py).
"""

from __future__ import annotations

import torch

LINEAR_NAMES = ("Linear", "LoRACompatibleLinear", "QLinear", "OstrisLinear")
CONV_NAMES = ("Conv2d", "LoRACompatibleConv", "QConv2d")


class ContractManager:
    def __init__(self, mm, module: torch.nn.Module, device):
        self.mm = mm
        self.module = module
        self.process_device = torch.device(device)
        self.unmanaged = []

    @classmethod
    def attach(cls, mm, module: torch.nn.Module, device) -> "ContractManager":
        manager = cls(mm, module, device)
        module._memory_manager = manager
        for _, child in module.named_modules():
            name = type(child).__name__
            if name in LINEAR_NAMES:
                if getattr(child, "is_ostris_quantized", False):
                    mm.OstrisLinearLayerMemoryManager.attach(child, manager)
                else:
                    mm.LinearLayerMemoryManager.attach(child, manager)
            elif name in CONV_NAMES:
                mm.ConvLayerMemoryManager.attach(child, manager)
            elif child is not module and not any(True for _ in child.children()):
                manager.unmanaged.append(child)
        return manager

    def to_device(self):
        """What manager.py's patched ``.to`` does: move only what is not managed."""
        for m in self.unmanaged:
            m.to(self.process_device)
        return self.module

    def _unpatch_layers(self, unpin: bool):
        for child in self.module.modules():
            lmm = getattr(child, "_layer_memory_manager", None)
            if lmm is None:
                continue
            ara = child.ara_lora_ref() if hasattr(child, "ara_lora_ref") else None
            if ara is not None:
                ara.org_forward = lmm._original_forward
            else:
                child.forward = lmm._original_forward
            if unpin:
                for pname in ("weight", "bias"):
                    param = child._parameters.get(pname)
                    if param is not None and param.is_pinned():
                        object.__setattr__(
                            child, pname, torch.nn.Parameter(param.data.clone(), requires_grad=param.requires_grad)
                        )
            del child._layer_memory_manager
            del child._memory_management_device
        for key in [k for k in self.mm._DEVICE_STATE if torch.device(k).type == "cuda"]:
            del self.mm._DEVICE_STATE[key]

    def detach(self):
        self._unpatch_layers(unpin=True)
        del self.module._memory_manager

    def free(self):
        self._unpatch_layers(unpin=False)
        del self.module._memory_manager
        torch.nn.Module.to(self.module, "meta")
