// Layers whose stored form is the module's own tensors (ArenaParts::kModuleTensors: AI-Toolkit's OstrisLinear,
// bitsandbytes' Linear4bit): the tensors its recogniser lists (layer_kinds.h, TensorSlot) are packed into one
// arena block at attach (the module's tensors become host views of it); each call stages them onto the device
// through the engine (pinned, prefetched), puts the staged tensors in their slots for the module's own forward
// (its library decodes them), then puts the host views back. Every function here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <vector>

#include "device_state.h"
#include "layer_manager.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// At attach: the module's tensors moved to the host, then packed (core.form, core.slots_of set by the caller).
void attach_module_tensors(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state);
// One call: the tensors staged on the device around the layer's own forward (`original`).
py::object module_tensors_forward(const py::object& module, LayerManager& core, const py::object& original,
                                  const py::object& x, const std::shared_ptr<DeviceState>& state);

}  // namespace layerstream::torchglue
