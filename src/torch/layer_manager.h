// LayerManager: the object a managed layer gets as `_layer_memory_manager`, and the forward path its
// calls take. Python attributes (module, manager, _original_forward) live in its __dict__, which the
// garbage collector can traverse; the C++ members below are what the installed forward reads.
//
// The layer's stored form is recognised at attach (layer_kinds.h: one recogniser per source library), and again at
// the first call after the weight changed kind (a plain weight quantized after attach, as AI-Toolkit quantizes its
// text encoders; a quantized one given a plain weight back). The form's arena parts decide what a call does
// (forward_paths.cc): a weight and bias packed and fetched per call (the streamed path, or cpu on a CPU state),
// codes and a scale dequantized on the device (quantized), the module's tensors staged around its own forward
// (module_tensors.cc), or nothing streamed (generic: moved as stored and dequantized by its library per call).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "layer_kinds.h"
#include "ostris_fast.h"
#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace py = pybind11;

struct LayerManager {
  c10::intrusive_ptr<StreamedLayer> layer;  // null on the generic path
  const StoredForm* form = nullptr;           // null before attach; an entry of stored_forms() after
  bool cpu_state = false;                     // attached to a CPU device state (the plain form's "cpu" path)
  // Quantized path: the weight object whose codes were packed, the attribute of it that holds the codes
  // and scale ("" when the weight holds them itself; torchao's AffineQuantizedTensor keeps them in its
  // `tensor_impl`), and the attribute names of its codes and scale (they differ between libraries).
  py::object quant_weight;
  std::string holder_attr, codes_attr, scale_attr;
  // Streamed and cpu paths: where the weight's data lay after the last call (or the packing at attach). A call
  // that finds it elsewhere (swapped storage, a new Parameter) asks whether an unmanaged module of the model holds
  // the weight before it is packed again (forward_paths.cc, unmanaged_holder); in-place writes do not move it.
  const void* packed_data = nullptr;
  // Module-tensor forms: the packed tensors, in block order, and how to list the module's current ones.
  std::vector<TensorSlot> slots;
  std::vector<TensorSlot> (*slots_of)(const py::object& module) = nullptr;
  void (*after_pack)(const py::object& module, LayerManager& core) = nullptr;
  // OstrisLinear: the backend's weight decoded by layerstream where it is one of the formats it knows.
  OstrisFast ostris_fast;
  virtual ~LayerManager() = default;
};

// The name Python reads as `path` ("" before attach): the form's path, "cpu" for a plain one on a CPU state.
inline std::string path_name(const LayerManager& m) {
  if (m.form == nullptr) return "";
  if (m.cpu_state && m.form->parts == ArenaParts::kWeightBias) return "cpu";
  return std::string(m.form->path);
}

}  // namespace layerstream::torchglue
