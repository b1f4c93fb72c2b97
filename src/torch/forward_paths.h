// The forward a managed layer gets, and the paths it dispatches to (layer_manager.h names them): the
// streamed and cpu paths call the StreamedLayer's autograd function; the quantized path checks the packed
// codes are current and calls its frozen forward; the generic path moves the weight as stored and lets its
// library dequantize it; the module-tensor path (OstrisLinear, ...) is in module_tensors.h. Every function here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "device_state.h"
#include "layer_manager.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// Upstream moved tensor-subclass weights to the CPU by replacing the whole Parameter (`.data =` does
// not move a subclass's inner tensors). The generic path does the same.
void move_params_to_cpu(const py::object& module);

// Packs the layer's quantized weight (moved to the host first if it is elsewhere) and its bias; the
// weight object's codes and scale become views of the arena block.
void pack_quantized(const py::object& module, LayerManager& core);

// Attaches the layer in the stored form its recogniser saw (layer_kinds.h): packs what the form puts in the arena
// and sets core.layer, core.form and what the form's calls need.
void attach_form(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state, bool conv,
                 const Recognised& recognised);

// Linear and Conv2d at attach: attach_form on what recognise_weighted sees (a plain weight: the streamed path, or
// cpu on a CPU state; a quantized one the engine streams as stored: codes and scale; ...; anything else the
// generic path). Also when a weight changed kind after attach (the forward calls it again).
void attach_weighted(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                     bool conv);

// Marks the layer's own parameters `_is_memory_managed`, as upstream does.
void mark_params_managed(const py::object& module);

// The callable installed as the layer's forward (or as its ARA LoRA's org_forward). It holds the state and weak
// references to the layer and to its manager object (no cycle); the manager object holds the StreamedLayer
// and the path, which a weight that changed kind changes.
py::cpp_function make_forward(const py::object& module, const py::object& manager_obj,
                              std::shared_ptr<DeviceState> state, bool conv);

}  // namespace layerstream::torchglue
