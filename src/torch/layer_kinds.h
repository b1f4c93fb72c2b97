// Which layers stream how: what a layer's weight is (plain dense tensor, a library's quantized tensor
// layerstream streams as stored, or something else), recognised from its Python type and attributes.
// torchao and optimum-quanto are matched by module and class name, never imported. Every function here
// needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// A plain dense tensor (Parameter or Tensor, not a subclass, not quantized) can be packed; so can a
// PackedWeight (its exact values, decoded).
bool is_plain(const py::handle& obj);

// is_plain's type test alone (a Parameter or Tensor, not a subclass, or a PackedWeight), cheap enough for every
// call: a weight that fails it changed kind since a plain one was packed.
bool has_plain_type(const py::handle& obj);

// Conv layers whose padding is a string or whose padding_mode is not "zeros" take the generic path
// (their own _conv_forward handles those).
bool conv_is_plain(const py::object& module);
ConvParams conv_params_of(const py::object& module);

// Whether the generic path must dequantize the weight (a quantized or integer tensor) after moving it.
bool needs_dequantize(const py::object& w);

// A library-quantized weight layerstream streams natively: the object holding its codes and scale (the
// weight, or the attribute `holder_attr` of it), their attribute names, and the dtypes of the library's
// dequantize(): ((codes.to(math) * scale) in math).to(result). `scale` is the library's scale seen with
// one dimension per codes dimension ([out, 1, ...]) where the library keeps it as [out];
// `scale_sizes` is the library's own shape, which the packed view gets back.
struct QuantSource {
  std::string library;
  py::object holder;
  std::string holder_attr, codes_attr, scale_attr;
  at::Tensor codes, scale;
  std::vector<std::int64_t> scale_sizes;
  at::ScalarType math = at::kFloat, result = at::kBFloat16;
};

// The weight as a QuantSource when it is a layout streamed natively (optimum-quanto's qbytes tensors,
// torchao's Float8Tensor and float8 AffineQuantizedTensor); nullopt otherwise.
std::optional<QuantSource> quant_source_of(const py::object& w);

// optimum-quanto's MarlinF8QBytesTensor (a qfloat8 weight prepared for the Marlin kernel): it streams once
// moved to the host, where it becomes the WeightQBytesTensor it came from.
bool is_quanto_marlin(const py::object& w);

// Whether the weight streams natively once it is on the host.
bool streams_quantized(const py::object& w);

// What a weight is, for the line that says it takes the generic path: its type, and for torchao's
// AffineQuantizedTensor the tensor_impl (the layout) and block size that decide how it dequantizes.
std::string describe_weight(const py::object& w);

}  // namespace layerstream::torchglue
