// Which layers stream how: the recognisers, one per source library (torch, optimum-quanto, torchao,
// AI-Toolkit's OstrisLinear, ...), each mapping a module and its weight to a stored form (layerstream/
// stored_form.h) and what that form's packing needs; everything downstream takes the stored form. Libraries
// are matched by module and class name, never imported. Every function here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layerstream/stored_form.h"
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
  const StoredForm* form = nullptr;
  py::object holder;
  std::string holder_attr, codes_attr, scale_attr;
  at::Tensor codes, scale;
  std::vector<std::int64_t> scale_sizes;
  at::ScalarType math = at::kFloat, result = at::kBFloat16;
};

// One tensor a module's own forward reads (a kModuleTensors form), and where it lives on the module.
// kBuffer: module._buffers[name]. kParameterData: the Parameter at `name` (a dotted path from the module),
// whose data is set (the Parameter object stays: LoRA and optimizers hold it, autograd gives it gradients).
// kFrozenParameter: module._parameters[name], a Parameter that takes no gradient, whose host data is set at
// packing and which a call replaces by a Parameter of the same class and attributes over the staged data
// (what the call keeps of it, as a library's autograd function keeps its weight, keeps the staged data).
// kAttribute: the attribute at `name` of the object at `owner` (both dotted paths from the module); a call's
// staged tensors are set on shallow copies of the owner (and of the objects between it and the tensor), put
// in the owner's place for the call, so whatever the call keeps (autograd's saved state) keeps the staged
// tensors, never the host ones. Slots are listed in block order; an owner path may go through an earlier
// kFrozenParameter slot (it then resolves to the call's replacement).
struct TensorSlot {
  enum class Kind { kBuffer, kParameterData, kFrozenParameter, kAttribute };
  Kind kind = Kind::kBuffer;
  std::string owner;
  std::string name;
  bool operator==(const TensorSlot& o) const { return kind == o.kind && owner == o.owner && name == o.name; }
};
// The module's tensor in `slot` (None when the slot holds none).
py::object read_slot(const py::object& module, const TensorSlot& slot);

struct LayerManager;

// What a recogniser saw in a layer: its stored form and what packing that form needs.
struct Recognised {
  const StoredForm* form = nullptr;
  // kModuleTensors forms: the tensors the module's own forward reads, as the module holds them now (called
  // again at each call: a different set means the layer is packed again).
  std::vector<TensorSlot> (*slots_of)(const py::object& module) = nullptr;
  // Runs after each packing of module tensors (OstrisLinear: which of its backends layerstream decodes).
  void (*after_pack)(const py::object& module, LayerManager& core) = nullptr;
};

// The stored form of a Linear or Conv2d layer's weight: each library's recogniser is asked in turn;
// "generic" when none takes it (a zero-size or meta weight is generic too).
Recognised recognise_weighted(const py::object& module, bool conv);
// AI-Toolkit's OstrisLinear (attached through OstrisLinearLayerMemoryManager): its buffers, then its bias.
Recognised recognise_ostris_layer(const py::object& module);

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
