#include "layer_kinds.h"

#include <torch/csrc/autograd/python_variable.h>

#include "layer_manager.h"
#include "packed_weight_glue.h"
#include "py_torch.h"

namespace layerstream::torchglue {

bool has_plain_type(const py::handle& obj) {
  static const py::object* parameter_type = new py::object(torch_module().attr("nn").attr("Parameter"));
  static const py::object* tensor_type = new py::object(torch_module().attr("Tensor"));
  const py::handle type = py::type::of(obj);
  return type.is(*parameter_type) || type.is(*tensor_type) || is_packed_weight(obj);
}

bool is_plain(const py::handle& obj) {
  if (obj.is_none()) return true;
  if (!has_plain_type(obj)) return false;
  if (is_packed_weight(obj)) return true;  // its exact values, decoded
  const at::Tensor t = obj.cast<at::Tensor>();
  return t.layout() == at::kStrided && !t.is_quantized() && (t.is_cpu() || t.is_cuda());
}

namespace {

std::vector<std::int64_t> pair_of(const py::object& v) {
  if (py::isinstance<py::int_>(v)) {
    const auto i = v.cast<std::int64_t>();
    return {i, i};
  }
  return v.cast<std::vector<std::int64_t>>();
}

std::string type_name_of(const py::handle& obj) {
  const py::object type = py::type::of(obj);
  return type.attr("__module__").cast<std::string>() + "." + type.attr("__name__").cast<std::string>();
}

// torchao 0.10 to 0.1x's float8 weight-only layout (Float8WeightOnlyConfig, which AI-Toolkit's quantize()
// applies for qtype float8): an AffineQuantizedTensor whose Float8AQTTensorImpl holds `float8_data` (out,
// in) and `scale`, one per row ([out], block_size (1, in)) or one for the tensor (block_size the shape),
// no zero point. Its dequantize() is codes.to(dtype) * scale in the promoted dtype (0.10), later
// (codes.to(float32) * scale).to(dtype); a float8 code (at most 4 significant bits) times a float32,
// float16 or bfloat16 scale is exact in float32, so both round once to the same value as float32 math.
bool torchao_affine_float8(const py::object& w, QuantSource& q) {
  if (!py::hasattr(w, "tensor_impl") || !py::hasattr(w, "block_size")) return false;
  const py::object impl = w.attr("tensor_impl");
  const py::object impl_type = py::type::of(impl);
  if (impl_type.attr("__name__").cast<std::string>() != "Float8AQTTensorImpl") return false;
  const py::object transposed = py::getattr(impl, "transposed", py::none());
  if (!transposed.is_none() && transposed.cast<bool>()) return false;  // codes stored (in, out)
  const py::object domain = py::getattr(w, "zero_point_domain", py::none());
  if (!domain.is_none() && py::str(py::getattr(domain, "name", domain)).cast<std::string>() != "NONE") return false;
  if (!py::hasattr(impl, "float8_data") || !py::hasattr(impl, "scale")) return false;
  const at::Tensor codes = impl.attr("float8_data").cast<at::Tensor>();
  const auto block = w.attr("block_size").cast<std::vector<std::int64_t>>();
  if (codes.dim() < 1 || block.size() != static_cast<std::size_t>(codes.dim())) return false;
  for (std::int64_t d = 1; d < codes.dim(); ++d) {
    if (block[d] != codes.size(d)) return false;  // block-wise scales within a row
  }
  if (block[0] != 1 && block[0] != codes.size(0)) return false;
  q.form = &stored_form("torchao-affine-float8");
  q.holder = impl;
  q.holder_attr = "tensor_impl";
  q.codes_attr = "float8_data";
  q.scale_attr = "scale";
  return true;
}

}  // namespace

bool conv_is_plain(const py::object& module) {
  return !py::isinstance<py::str>(module.attr("padding")) &&
         py::getattr(module, "padding_mode", py::str("zeros")).cast<std::string>() == "zeros";
}

ConvParams conv_params_of(const py::object& module) {
  ConvParams p;
  p.stride = pair_of(module.attr("stride"));
  p.padding = pair_of(module.attr("padding"));
  p.dilation = pair_of(module.attr("dilation"));
  p.groups = module.attr("groups").cast<std::int64_t>();
  return p;
}

bool needs_dequantize(const py::object& w) {
  if (py::getattr(w, "is_quantized", py::bool_(false)).cast<bool>()) return true;
  const std::string mod = py::type::of(w).attr("__module__").cast<std::string>();
  if (mod.rfind("torchao", 0) == 0) return true;
  return !w.attr("dtype").attr("is_floating_point").cast<bool>();
}

namespace {

// The codes and scale of a weight one of the recognisers below found, checked against the layouts the
// core dequantizes: nullopt for other groupings (block-wise scales) and code types (the generic path).
std::optional<QuantSource> finish_quant(const py::object& w, QuantSource q) {
  if (!py::hasattr(q.holder, q.codes_attr.c_str()) || !py::hasattr(q.holder, q.scale_attr.c_str())) return std::nullopt;
  q.codes = q.holder.attr(q.codes_attr.c_str()).cast<at::Tensor>();
  q.scale = q.holder.attr(q.scale_attr.c_str()).cast<at::Tensor>();
  q.scale_sizes = q.scale.sizes().vec();
  if (q.codes.dim() > 1 && q.scale.dim() == 1 && q.scale.numel() == q.codes.size(0) && q.scale.numel() > 1) {
    std::vector<std::int64_t> per_row(q.codes.dim(), 1);
    per_row[0] = q.codes.size(0);
    q.scale = q.scale.view(per_row);  // [out] as [out, 1, ...]
  }
  if (!quantized_layout_supported(q.codes, q.scale)) return std::nullopt;
  if (q.form->library == "torchao") {
    q.math = at::kFloat;
    q.result = w.cast<at::Tensor>().scalar_type();
  } else {
    q.math = q.result = q.scale.scalar_type();
  }
  if (!is_real_dtype(q.result)) return std::nullopt;
  return q;
}

bool type_is(const py::object& w, const char* module_prefix, const std::string& name) {
  const py::object type = py::type::of(w);
  return type.attr("__module__").cast<std::string>().rfind(module_prefix, 0) == 0 &&
         type.attr("__name__").cast<std::string>() == name;
}

// optimum-quanto WeightQBytesTensor (0.2.5 on) or QBytesTensor (0.2.4, AI-Toolkit's pin), qfloat8
// e4m3/e5m2 and qint8: dequantize() = scale * codes.to(scale dtype).
std::optional<QuantSource> quanto_source(const py::object& w) {
  if (!type_is(w, "optimum.quanto", "WeightQBytesTensor") && !type_is(w, "optimum.quanto", "QBytesTensor")) {
    return std::nullopt;
  }
  const py::object axis = py::getattr(w, "axis", py::int_(0));
  if (!axis.is_none() && axis.cast<int>() != 0) return std::nullopt;
  QuantSource q;
  q.form = &stored_form("quanto-qbytes");
  q.holder = w;
  q.codes_attr = "_data";
  q.scale_attr = "_scale";
  return finish_quant(w, std::move(q));
}

// torchao Float8Tensor, weight-only: dequantize() = (codes.to(float32) * scale).to(dtype); torchao's
// AffineQuantizedTensor float8 above.
std::optional<QuantSource> torchao_source(const py::object& w) {
  QuantSource q;
  if (type_is(w, "torchao", "Float8Tensor")) {
    if (!py::getattr(w, "act_quant_kwargs", py::none()).is_none()) return std::nullopt;  // not weight-only
    q.form = &stored_form("torchao-float8");
    q.holder = w;
    q.codes_attr = "qdata";
    q.scale_attr = "scale";
  } else if (!type_is(w, "torchao", "AffineQuantizedTensor") || !torchao_affine_float8(w, q)) {
    return std::nullopt;
  }
  return finish_quant(w, std::move(q));
}

// The recognisers, one per source library: the layer's stored form when the library's weight is one
// layerstream streams, else nullopt (the next one is asked). The layer's weight is not None, not empty and
// not on the meta device; the bias, when quantized or packed, takes the layer to the generic path.
using Recogniser = std::optional<Recognised> (*)(const py::object& module, const py::object& weight, bool conv);

bool plain_around(const py::object& module, bool conv) {
  return is_plain(py::getattr(module, "bias", py::none())) && (!conv || conv_is_plain(module));
}

std::optional<Recognised> recognise_torch(const py::object& module, const py::object& weight, bool conv) {
  if (!is_plain(weight) || !plain_around(module, conv)) return std::nullopt;
  return Recognised{&stored_form("plain")};
}

std::optional<Recognised> recognise_quanto(const py::object& module, const py::object& weight, bool conv) {
  if (!plain_around(module, conv) || !(quanto_source(weight) || is_quanto_marlin(weight))) return std::nullopt;
  return Recognised{&stored_form("quanto-qbytes")};
}

std::optional<Recognised> recognise_torchao(const py::object& module, const py::object& weight, bool conv) {
  if (!plain_around(module, conv)) return std::nullopt;
  const std::optional<QuantSource> q = torchao_source(weight);
  if (!q) return std::nullopt;
  return Recognised{q->form};
}

// bitsandbytes' Linear4bit (nf4, fp4): the weight is a Params4bit of packed 4-bit codes (uint8, two a byte)
// whose quant_state holds `absmax` (one per block of values; with nested statistics the uint8 codes of a
// second quantization, whose `offset`, `state2.absmax` and `state2.code` come with it) and the 16-entry
// `code` table. bitsandbytes' own forward decodes them (DeviceDecode::kOwnForward): they stream as stored.
// A weight repacked for bitsandbytes' AVX512-BF16 CPU kernel is refused (it is rewritten at its first call).
std::vector<TensorSlot> bnb_slots(const py::object& module) {
  using K = TensorSlot::Kind;
  std::vector<TensorSlot> slots{{K::kFrozenParameter, "", "weight"}};
  for (const char* name : {"absmax", "code", "offset", "state2.absmax", "state2.code"}) {
    const TensorSlot slot{K::kAttribute, "weight.quant_state", name};
    if (THPVariable_Check(read_slot(module, slot).ptr())) slots.push_back(slot);
  }
  if (!py::dict(module.attr("_parameters")).attr("get")("bias").is_none()) slots.push_back({K::kParameterData, "", "bias"});
  return slots;
}

std::optional<Recognised> recognise_bnb(const py::object& module, const py::object& weight, bool conv) {
  if (conv || !type_is(weight, "bitsandbytes", "Params4bit") || !plain_around(module, conv)) return std::nullopt;
  const py::object qs = py::getattr(weight, "quant_state", py::none());
  if (qs.is_none() || py::getattr(qs, "packing_format_for_cpu", py::bool_(false)).cast<bool>()) return std::nullopt;
  const at::Tensor codes = weight.cast<at::Tensor>();
  if (codes.scalar_type() != at::kByte || codes.requires_grad() || !py::hasattr(module, "compute_dtype")) return std::nullopt;
  return Recognised{&stored_form("bnb-4bit"), bnb_slots};
}

struct LibraryRecogniser {
  const char* library;
  Recogniser recognise;
};
const LibraryRecogniser kRecognisers[] = {
    {"torch", recognise_torch},
    {"optimum-quanto", recognise_quanto},
    {"torchao", recognise_torchao},
    {"bitsandbytes", recognise_bnb},
};

std::vector<TensorSlot> ostris_slots(const py::object& module) {
  std::vector<TensorSlot> slots;
  for (auto item : py::dict(module.attr("_buffers"))) {
    if (!item.second.is_none()) slots.push_back({TensorSlot::Kind::kBuffer, "", item.first.cast<std::string>()});
  }
  if (!py::dict(module.attr("_parameters")).attr("get")("bias").is_none()) {
    slots.push_back({TensorSlot::Kind::kParameterData, "", "bias"});
  }
  return slots;
}

py::object attribute_at(py::object obj, const std::string& dotted) {
  std::size_t start = 0;
  while (start < dotted.size() && !obj.is_none()) {
    const std::size_t dot = dotted.find('.', start);
    const std::string part = dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    obj = py::getattr(obj, part.c_str(), py::none());
    start = dot == std::string::npos ? dotted.size() : dot + 1;
  }
  return obj;
}

}  // namespace

py::object read_slot(const py::object& module, const TensorSlot& slot) {
  switch (slot.kind) {
    case TensorSlot::Kind::kBuffer: return py::dict(module.attr("_buffers")).attr("get")(slot.name);
    case TensorSlot::Kind::kParameterData:
    case TensorSlot::Kind::kFrozenParameter: return attribute_at(module, slot.name);
    case TensorSlot::Kind::kAttribute: return attribute_at(attribute_at(module, slot.owner), slot.name);
  }
  return py::none();
}

Recognised recognise_weighted(const py::object& module, bool conv) {
  const py::object weight = py::dict(module.attr("_parameters")).attr("get")("weight");
  const bool empty = weight.is_none() || weight.attr("numel")().cast<std::int64_t>() == 0;
  if (!empty) {
    for (const LibraryRecogniser& r : kRecognisers) {
      if (std::optional<Recognised> found = r.recognise(module, weight, conv)) return *found;
    }
  }
  return Recognised{&stored_form("generic")};
}

namespace {

void ostris_after_pack(const py::object& module, LayerManager& core) {
  std::vector<std::string> buffer_names;
  for (const TensorSlot& slot : core.slots) {
    if (slot.kind == TensorSlot::Kind::kBuffer) buffer_names.push_back(slot.name);
  }
  core.ostris_fast = recognise_ostris(module, buffer_names);
}

}  // namespace

Recognised recognise_ostris_layer(const py::object&) {
  return Recognised{&stored_form("ostris"), ostris_slots, ostris_after_pack};
}

// The weight's codes and scale, for the quantized path (the library that recognised it).
std::optional<QuantSource> quant_source_of(const py::object& w) {
  if (w.is_none()) return std::nullopt;
  if (std::optional<QuantSource> q = quanto_source(w)) return q;
  return torchao_source(w);
}

// optimum-quanto turns a frozen qfloat8 (e4m3) weight that reaches a GPU of compute capability 8 or more
// into a MarlinF8QBytesTensor: its codes packed into int32 and reordered, its scale permuted, for the
// Marlin kernel. Moved to the host, as attach does with every weight (quanto's own `.to`), it becomes the
// WeightQBytesTensor it came from: codes (out, in) and a scale per row, which stream natively. Its
// dequantize() is the same product as that one's, element by element.
bool is_quanto_marlin(const py::object& w) {
  if (w.is_none()) return false;
  const py::object type = py::type::of(w);
  return type.attr("__name__").cast<std::string>() == "MarlinF8QBytesTensor" &&
         type.attr("__module__").cast<std::string>().rfind("optimum.quanto", 0) == 0;
}

// Whether the weight streams natively once it is on the host.
bool streams_quantized(const py::object& w) { return quant_source_of(w).has_value() || is_quanto_marlin(w); }

std::string describe_weight(const py::object& w) {
  std::string kind = type_name_of(w);
  if (py::hasattr(w, "tensor_impl")) kind += " with " + type_name_of(w.attr("tensor_impl"));
  if (py::hasattr(w, "block_size")) kind += ", block_size " + py::str(w.attr("block_size")).cast<std::string>();
  if (py::hasattr(w, "dtype")) kind += ", dtype " + py::str(w.attr("dtype")).cast<std::string>();
  return kind;
}

}  // namespace layerstream::torchglue
