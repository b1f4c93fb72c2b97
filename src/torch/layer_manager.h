// LayerManager: the object a managed layer gets as `_layer_memory_manager`, and the forward path its
// calls take. Python attributes (module, manager, _original_forward) live in its __dict__, which the
// garbage collector can traverse; the C++ members below are what the installed forward reads.
//
// The path is chosen at attach (forward_paths.cc, attach_weighted) from the layer and its weight
// (layer_kinds.h), and chosen again at the first call after the weight changed kind (a plain weight quantized
// after attach, as AI-Toolkit quantizes its text encoders; a quantized one given a plain weight back):
//   kStreamed   a plain dense weight, packed into the arena and fetched through the engine per call;
//   kCpu        the same on a CPU device state (nothing to move);
//   kQuantized  a library-quantized weight streamed as stored (codes and scale), dequantized on the device;
//   kGeneric    anything else: moved as stored and dequantized by its library at every call;
//   kOstris     AI-Toolkit's OstrisLinear: its quantized buffers packed, staged around its own forward.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "ostris_fast.h"
#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace py = pybind11;

enum class ForwardPath { kUnset, kStreamed, kCpu, kQuantized, kGeneric, kOstris };

// The name Python reads as `path` ("" before attach).
inline const char* path_name(ForwardPath path) {
  switch (path) {
    case ForwardPath::kStreamed: return "streamed";
    case ForwardPath::kCpu: return "cpu";
    case ForwardPath::kQuantized: return "quantized";
    case ForwardPath::kGeneric: return "generic";
    case ForwardPath::kOstris: return "ostris";
    case ForwardPath::kUnset: break;
  }
  return "";
}

struct LayerManager {
  c10::intrusive_ptr<StreamedLayer> layer;  // null on the generic path
  ForwardPath path = ForwardPath::kUnset;
  // Quantized path: the weight object whose codes were packed, the attribute of it that holds the codes
  // and scale ("" when the weight holds them itself; torchao's AffineQuantizedTensor keeps them in its
  // `tensor_impl`), and the attribute names of its codes and scale (they differ between libraries).
  py::object quant_weight;
  std::string holder_attr, codes_attr, scale_attr;
  // Streamed and cpu paths: where the weight's data lay after the last call (or the packing at attach). A call
  // that finds it elsewhere (swapped storage, a new Parameter) asks whether an unmanaged module of the model holds
  // the weight before it is packed again (forward_paths.cc, unmanaged_holder); in-place writes do not move it.
  const void* packed_data = nullptr;
  // OstrisLinear path: the names of the packed buffers, in block order (then the bias, when it has one).
  std::vector<std::string> buffer_names;
  bool ostris_bias = false;
  // OstrisLinear path: the backend's weight decoded by layerstream where it is one of the formats it knows.
  OstrisFast ostris_fast;
  virtual ~LayerManager() = default;
};

}  // namespace layerstream::torchglue
