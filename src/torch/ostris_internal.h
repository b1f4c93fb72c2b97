// What ostris_fast.cc, ostris_nvfp4.cc and ostris_int.cc share (not part of the glue's interface; see ostris_fast.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "ostris_fast.h"

namespace layerstream::torchglue::ostris_detail {

// The INFO line, once per backend class, that its layers run their own forward, and why.
void own_forward(const std::string& backend, const std::string& why);
// Whether a and b are the same type, shape and bits (NaNs included).
bool same_bits(const at::Tensor& a, const at::Tensor& b);
#ifdef LAYERSTREAM_TORCH_CUDA
// torch's current stream on t's device.
void* stream_of(const at::Tensor& t);
#endif

// A convrot int8-matmul layer's call (ostris_int.cc): its training call with layerstream's backward, or nullopt
// for its own forward. `staged` as for ostris_fast_forward; rows and cols are the layer's out and in features.
std::optional<py::object> convrot_int_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& x,
                                              const at::Tensor& xt, std::int64_t rows, std::int64_t cols,
                                              bool on_cuda);

// convrot4 without fp4 matmuls (ostris_nvfp4.cc), with `w` its rotated weight decoded: the backend's rotation,
// its straight-through training activation (proved on the layer's first training call in each input type), and
// F.linear; nullopt (the layer then runs its own forward) where the proof fails.
std::optional<py::object> convrot4_forward(OstrisFast& fast, const py::object& x, const at::Tensor& xt,
                                           const at::Tensor& w, const at::Tensor& b, std::int64_t rows,
                                           std::int64_t cols, bool on_cuda);

}  // namespace layerstream::torchglue::ostris_detail
