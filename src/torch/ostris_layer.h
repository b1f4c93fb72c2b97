// AI-Toolkit's OstrisLinear layers (its own quantizers): the quantized state is in `_buffers` (plus the
// bias). They are packed into one arena block at attach (the layer's buffers and bias become host views of
// it); each call stages copies of them onto the device through the engine (pinned, prefetched, out of the
// ring into torch's allocator), swaps them into the layer for its own forward (its quantizer), then puts
// the host views back. Every function here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <vector>

#include "device_state.h"
#include "layer_manager.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// The layer's buffers (then the bias) in the packed order; nullopt when the layer's set of buffers or its
// bias is not the one packed, so the caller packs again.
std::optional<std::vector<at::Tensor>> ostris_tensors(const py::object& module, const LayerManager& core);
// Packs the layer's buffers and bias into one arena block; they become host views of it.
void ostris_pack(const py::object& module, LayerManager& core);
// One call: the buffers staged on the device around the layer's own forward (`original`).
py::object ostris_forward(const py::object& module, LayerManager& core, const py::object& original,
                          const py::object& x, const std::shared_ptr<DeviceState>& state);

}  // namespace layerstream::torchglue
