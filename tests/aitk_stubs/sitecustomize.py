"""Lets the index's torchvision 0.28.0 import beside the CPU build of torch 2.13.0 in the AI-Toolkit job runs
(tests/aitk_stubs/README.md). That wheel is built for CUDA: its operator library (_C.so) needs libtorch_cuda and
cannot load on a CPU build of torch, and `import torchvision` then stops at registering shape functions for two
of its operators (`torchvision::nms`, `torchvision::qnms`) that were never declared. This declares them (schema
only, no kernel: calling them still fails) when, and only when, the library does not load. torchvision's image
transforms, which AI-Toolkit uses, are plain Python over torch and work unchanged."""

import importlib.util
import os

_TORCHVISION_DECLARED = None


def _declare_torchvision_ops() -> None:
    global _TORCHVISION_DECLARED
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    library = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
    if not os.path.isfile(library):
        return
    import torch

    try:
        torch.ops.load_library(library)
        return  # a torchvision that matches this torch: nothing to stand in for
    except (OSError, RuntimeError):
        pass
    _TORCHVISION_DECLARED = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        _TORCHVISION_DECLARED.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_declare_torchvision_ops()
