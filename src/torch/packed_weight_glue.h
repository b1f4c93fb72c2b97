// The native half of layerstream.packed_weight (a losslessly packed frozen weight whose Parameter holds only
// the packed bytes; docs/ai-toolkit.md, "Host RAM with lossless"): recognising a PackedWeight, keeping a
// layer's Parameter in step with what the layer holds, and the decode the Python half calls. Every function
// here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// layerstream.packed_weight, imported at its first use.
py::module_& packed_weight_module();

// Whether `obj` is a layerstream.packed_weight.PackedWeight.
bool is_packed_weight(const py::handle& obj);

// At attach and before each use of a layer whose weight LAYERSTREAM_HOST_DTYPE=lossless takes: a PackedWeight
// Parameter that was unfrozen or written (or is not this layer's) is made plain again (exact, in place); the
// layer is brought up to date (packed again where needed); and a weight the layer now holds packed gets a
// PackedWeight Parameter (in place), so that the process keeps no plain copy. No at::Tensor of the Parameter
// may be held across the swaps (torch.utils.swap_tensors refuses). Returns the layer's refresh() when no
// Python code ran after it (nothing was wrapped), for the caller's forward to skip its own (a caller that
// runs Python code or lets go of the GIL before that forward drops it); nullopt otherwise.
std::optional<StreamedLayer::Refreshed> sync_packed_weight(const py::object& module, StreamedLayer& layer);

// The bfloat16 tensor of `shape` rebuilt from lossless bytes and their spec as Python gives it
// ((count, exceptions, exponent table)); on the bytes' device, at most `max_blocks` thread blocks (0: no limit).
at::Tensor lossless_unpack_from_python(const at::Tensor& codes, const py::tuple& spec,
                                       const std::vector<std::int64_t>& shape, unsigned max_blocks);

// manager_modules._packed: what layerstream.packed_weight calls (not AI-Toolkit's surface).
void bind_packed(py::module_& m);

}  // namespace layerstream::torchglue
