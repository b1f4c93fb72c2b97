// OstrisLinear layers whose weight layerstream decodes itself: AI-Toolkit's uintx (uint2..uint8), orbit
// (orbit2..4) and orbit-VQ (orbitvq2..4) backends build their weight in each forward from a chain of torch
// operations (unpacking, casts, gathers, products: each a pass over the whole weight, twice per step under
// checkpointing). Here one fused kernel (core/ostris_decode.h) builds the same tensor, then the call is the
// backend's own: F.linear on the input (rotated by the backend's own rpbh_forward for orbit and orbit-VQ).
//
// The backend is recognised by its class and module (toolkit.util.<name>_quant) and its buffers; the layer's
// first call in each input type proves the decoded weight equal, bit for bit, to the one the backend's own
// dequantization builds from the same staged buffers. A layer whose proof fails, or whose backend is not one
// of these, runs its own forward (INFO once per backend class, with the reason). Every function here needs the
// GIL and runs with the layer's staged buffers swapped in (ostris_layer.cc).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "layerstream/dequant.h"

#include <optional>
#include <string>
#include <vector>

namespace layerstream::torchglue {

namespace py = pybind11;

struct OstrisFast {
  enum class Format : std::uint8_t { kNone, kUintx, kCodebook };
  Format format = Format::kNone;
  std::string backend;  // the quantizer's class name, for the log
  int bits = 0;
  std::int64_t vec_dim = 1, group = 0, block = 0;
  std::int64_t entries = 0;  // orbit-VQ: the lattice codebook's rows (orbit's come from its codebook buffer)
  RealType orig = RealType::kBFloat16;  // uintx: the scale's type (the layer's original one)
  // Positions in LayerManager::buffer_names (-1: none).
  int packed = -1, scale = -1, zero = -1, codebook = -1, perm = -1, signs = -1;
  py::object rotate;     // codebook formats: the backend module's rpbh_forward(x, perm, signs, block)
  py::object vq_tables;  // orbit-VQ: the backend module's get_vq_tables(lattice, size, device)
  py::object lattice;
  std::vector<c10::ScalarType> proven;  // input types whose decode equals the backend's own
  bool refused = false;                 // a proof failed: this layer runs its own forward from now on
};

// What this layer's backend is, from its class, attributes and buffers (in the packed order `names`).
OstrisFast recognise_ostris(const py::object& module, const std::vector<std::string>& names);

// The layer's output with the weight decoded here, or nullopt when this call must run the layer's own forward
// (not a recognised backend, an input this decoder does not take, a failed proof). `staged` are the layer's
// buffers on the device in the packed order, then its bias; `bias` is the layer's bias Parameter or None.
// `decoded_on_cuda`: whether the CUDA kernels (else the host reference, for the simulator) decode.
std::optional<py::object> ostris_fast_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& bias,
                                              const py::object& x, bool decoded_on_cuda);

}  // namespace layerstream::torchglue
