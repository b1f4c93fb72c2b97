// OstrisLinear layers whose weight layerstream decodes itself: AI-Toolkit's uintx (uint2..uint8), orbit
// (orbit2..4) and orbit-VQ (orbitvq2..4) backends build their weight in each forward from a chain of torch
// operations (unpacking, casts, gathers, products: each a pass over the whole weight, twice per step under
// checkpointing). Here one fused kernel (core/ostris_decode.h) builds the same tensor, then the call is the
// backend's own: F.linear on the input (rotated by the backend's own rpbh_forward for orbit and orbit-VQ).
// nvfp4 and convrot4 (where the GPU has no fp4 matmul, as the backend itself decides) dequantize with a Triton
// kernel of AI-Toolkit's; here the weight is decoded straight from the staged buffers (nothing of them is
// kept past the call), and convrot4's training activation, which the backend quantizes to nvfp4 and back
// through a chain of about fifteen torch passes, is one kernel plus torch's amax and add.
// The ConvRot backends whose forward is an int8 matmul (convrot8, convrotint2..8, convrotbitnet,
// convrotcomfyw4a4) keep their forward; in training their straight-through backward, grad @ (code8 * scale),
// builds that weight from the saved codes in one kernel (IntSteFn in ostris_int.cc) instead of the backend's
// unpack, cast and multiply.
//
// The backend is recognised by its class and module (toolkit.util.<name>_quant) and its buffers; the layer's
// first call in each input type proves the decoded weight equal, bit for bit, to the one the backend's own
// dequantization builds from the same staged buffers (for the int8-matmul ones, also a probe's gradient through
// the backend's own training linear). A layer whose proof fails, or whose backend is not one
// of these, runs its own forward (INFO once per backend class, with the reason). Every function here needs the
// GIL and runs with the layer's staged buffers swapped in (module_tensors.cc).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "layerstream/dequant.h"
#include "layerstream/ostris_decode.h"

#include <optional>
#include <string>
#include <vector>

namespace layerstream::torchglue {

namespace py = pybind11;

// The OstrisLinear layouts layerstream decodes, one entry each in ostris_fast.cc's table (uintx, orbit's and
// orbit-VQ's codebooks, nvfp4, convrot4, the convrot int8-matmul family): which backends have it, how its
// slots, shape and hooks are read off the backend, how the staged buffers decode, which dequantization of the
// backend's own proves the decode, and the layer's call after it. Nothing outside that table asks which
// layout a layer has.
struct OstrisLayout;

// Where each of the layout's buffers sits in LayerManager::buffer_names (-1: none).
struct OstrisSlots {
  int packed = -1, scale = -1, zero = -1, codebook = -1, perm = -1, signs = -1;
  int pts = -1, pre_scale = -1;  // nvfp4 and convrot4: the tensor scale; nvfp4's optional AWQ input scale
  int ratio = -1;                // convrot int: the group ratios (none for 8 bits)
};

// The layout's numbers, read off the backend and the layer.
struct OstrisShape {
  int bits = 0;
  std::int64_t vec_dim = 1, group = 0, block = 0;
  std::int64_t entries = 0;  // orbit-VQ: the lattice codebook's rows (orbit's come from its codebook buffer)
  RealType orig = RealType::kBFloat16;  // uintx: the scale's type (the layer's original one)
  std::int64_t rot = 0;                 // convrot4 and the convrot int backends: the rotation's block
  IntRowsSpec::Codes codes = IntRowsSpec::Codes::kInt8;  // convrot int: how the codes are stored
  std::int64_t ratio_group = 0;                          // convrot int: columns per ratio (0: none)
};

// The functions of the backend's module that its forward calls, called here as it would call them.
struct OstrisHooks {
  py::object int8_gemm;                        // convrot int: _int8_gemm_supported
  py::object quantize, dequantize, fp4_gemm;   // convrot4: quantize_nvfp4, dequantize_nvfp4, _fp4_gemm_supported
  py::object rotate;     // codebook layouts: rpbh_forward(x, perm, signs, block); convrot: rotate(x, rot)
  py::object vq_tables;  // orbit-VQ: get_vq_tables(lattice, size, device)
  py::object lattice;
};

// What the layer's calls have settled so far.
struct OstrisProof {
  // nvfp4 and convrot4: whether code 8 decodes as +0 (the backend's Triton kernel) or -0 (its torch path);
  // first guessed from the device, settled by the first proof (ostris_decode.h, Nvfp4Spec).
  std::optional<bool> plus_zero;
  std::vector<c10::ScalarType> proven;  // input types whose decode equals the backend's own, bit for bit
  std::vector<c10::ScalarType> proven_activation;  // convrot4: input types whose activation equals its own
  bool refused = false;                 // a proof failed: this layer runs its own forward from now on
  int int8_gemm_device = -2;  // convrot int: the device index _int8_gemm_supported was last asked for (-2:
  bool int8_gemm_here = false;  // never), and its answer
};

// One OstrisLinear layer's decoder: its layout (none: the layer runs its own forward) and the rest.
struct OstrisFast {
  const OstrisLayout* layout = nullptr;
  std::string backend;  // the quantizer's class name, for the log
  OstrisSlots slot;
  OstrisShape shape;
  OstrisHooks hooks;
  OstrisProof proof;
};

// What this layer's backend is, from its class, attributes and buffers (in the packed order `names`).
OstrisFast recognise_ostris(const py::object& module, const std::vector<std::string>& names);

// The layer's output with the weight decoded here, or nullopt when this call must run the layer's own forward
// (not a recognised backend, an input this decoder does not take, a failed proof). `staged` are the layer's
// buffers on the device in the packed order, then its bias, as StreamedLayer::with_staged_tensors hands them; `bias` is the layer's bias Parameter or None.
// `decoded_on_cuda`: whether the CUDA kernels (else the host reference, for the simulator) decode.
std::optional<py::object> ostris_fast_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& bias,
                                              const py::object& x, bool decoded_on_cuda);

// The kernels on their own, for the tests (manager_modules._testing), on the tensors' device (CUDA kernels on
// torch's current stream, or the host references): convrot4's activation quantization of x ([rows, cols],
// cols a multiple of 16) as (tensor scale, delta = x_dq - x), with torch's e4m3 conversion as it behaves on
// that device; and an nvfp4 weight ([rows, cols] of `out`).
std::pair<at::Tensor, at::Tensor> nvfp4_fake_quantize(const at::Tensor& x);
at::Tensor nvfp4_decode(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& pts, std::int64_t rows,
                        std::int64_t cols, c10::ScalarType out, bool plus_zero);
// A convrot int weight ([rows, cols] of `out`): `codes` "int8", "bitfield" (`bits` 2..8) or "ternary"; float32
// row scales and optional float32 group ratios (their count per row gives the group), any dtype of those bytes.
at::Tensor int_rows_decode(const at::Tensor& packed, const std::optional<at::Tensor>& ratio, const at::Tensor& scales,
                           std::int64_t rows, std::int64_t cols, const std::string& codes, int bits, c10::ScalarType out);

}  // namespace layerstream::torchglue
