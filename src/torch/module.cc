// manager_modules: the drop-in replacement of AI-Toolkit's toolkit/memory_management/manager_modules.py.
//
// The surface (names, attributes, side effects) is the one AI-Toolkit's manager.py relies on, for the
// 2025-11 and 2026-08 versions alike; see docs/ai-toolkit.md. What is done per call runs in C++: the
// forward installed on a managed layer is a C++ callable that reads the layer's weight and bias, checks
// them against the packed copy, and calls the StreamedLayer's autograd function. Python code runs only at
// attach time, on the generic path for tensor-subclass weights layerstream does not know, and in the
// layer's own forward on the OstrisLinear path.
//
// Lifetime: the installed forward holds the StreamedLayer (C++) and weak references to the layer and to
// its `_layer_memory_manager` object, so no reference cycle hides from Python's garbage collector.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <cctype>
#include <functional>
#ifndef _WIN32
#include <unistd.h>
#endif
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include "cuda_memory.h"
#include "device_state.h"
#include "host_share.h"
#include "settings.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/sim_backend.h"
#include "streamed_layer.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace py = pybind11;
using namespace layerstream;

namespace layerstream::torchglue {
void bind_settings(py::module_& m);  // settings_binding.cc
}  // namespace layerstream::torchglue

using namespace layerstream::torchglue;

namespace {

// The object a managed layer gets as `_layer_memory_manager`. Python attributes (module, manager,
// _original_forward) live in its __dict__, which the garbage collector can traverse.
struct LayerManager {
  c10::intrusive_ptr<StreamedLayer> layer;  // null on the generic path
  std::string path;                          // "streamed", "cpu", "quantized", "generic" or "ostris"
  // Quantized path: the weight object whose codes were packed, the attribute of it that holds the codes
  // and scale ("" when the weight holds them itself; torchao's AffineQuantizedTensor keeps them in its
  // `tensor_impl`), and the attribute names of its codes and scale (they differ between libraries).
  py::object quant_weight;
  std::string holder_attr, codes_attr, scale_attr;
  // OstrisLinear path: the names of the packed buffers, in block order (then the bias, when it has one).
  std::vector<std::string> buffer_names;
  bool ostris_bias = false;
  virtual ~LayerManager() = default;
};
struct LinearManager : LayerManager {};
struct ConvManager : LayerManager {};
struct OstrisManager : LayerManager {};

struct DeviceStateHandle {
  std::shared_ptr<DeviceState> state;
};

// The simulator behind a device state, for the test hooks (`what`: the hook's name, for the message).
SimBackend& simulator_of(DeviceStateHandle& h, const char* what) {
  auto* sim = dynamic_cast<SimBackend*>(&h.state->backend());
  LS_CHECK_ARG(sim != nullptr, what, ": this device state does not run on the simulator (LAYERSTREAM_BACKEND=sim)");
  return *sim;
}

py::dict& device_state_dict() {
  static py::dict* d = nullptr;
  if (d == nullptr) d = new py::dict();  // lives as long as the interpreter (module attribute too)
  return *d;
}

py::module_& torch_module() {
  static py::module_* t = new py::module_(py::module_::import("torch"));
  return *t;
}

std::shared_ptr<DeviceState> state_for(const py::object& device_obj) {
  py::object key = torch_module().attr("device")(device_obj);
  py::dict& states = device_state_dict();
  if (states.contains(key)) {
    py::object entry = states[key];
    if (py::isinstance<DeviceStateHandle>(entry)) return entry.cast<DeviceStateHandle&>().state;
  }
  at::Device device = key.cast<at::Device>();
  // A new device state reads the environment again (tests change it between states); a bad value fails here.
  Settings::refresh();
  Mode mode;
  if (device.is_cuda()) {
#ifdef LAYERSTREAM_TORCH_CUDA
    if (!device.has_index()) device.set_index(c10::cuda::current_device());
    const int count = static_cast<int>(c10::cuda::device_count());
    if (device.index() >= count) {
      throw py::value_error("the process device is " + device.str() + ", but this process sees " +
                            std::to_string(count) + " CUDA device(s)" +
                            (count > 0 ? " (cuda:0 to cuda:" + std::to_string(count - 1) + ")" : "") +
                            "; pass an existing device (check CUDA_VISIBLE_DEVICES)");
    }
    mode = Mode::kCuda;
#else
    throw py::value_error("layerstream was built against a torch without CUDA, but the process device is " +
                          device.str() + "; rebuild layerstream in the environment that has the CUDA torch");
#endif
  } else {
    mode = Settings::current()->backend == CpuBackend::kSim ? Mode::kSim : Mode::kCpu;
  }
  auto state = DeviceState::create(device, mode);
  states[key] = py::cast(DeviceStateHandle{state});
  log_once("engine-" + state->describe(), LogLevel::kInfo,
           "layerstream manager_modules active on " + state->describe());
  return state;
}

// layerstream.packed_weight (PackedWeight: a lossless frozen weight's Parameter holding only the packed
// bytes), imported at its first use.
py::module_& packed_weight_module() {
  static py::module_* m = new py::module_(py::module_::import("layerstream.packed_weight"));
  return *m;
}

bool is_packed_weight(const py::handle& obj) {
  static py::object* type = new py::object(packed_weight_module().attr("PackedWeight"));
  return !obj.is_none() && py::type::of(obj).is(*type);
}

// A plain dense tensor (Parameter or Tensor, not a subclass, not quantized) can be packed; so can a
// PackedWeight (its exact values, decoded).
bool is_plain(const py::handle& obj) {
  if (obj.is_none()) return true;
  py::object type = py::type::of(obj);
  const py::object parameter_type = torch_module().attr("nn").attr("Parameter");
  const py::object tensor_type = torch_module().attr("Tensor");
  if (is_packed_weight(obj)) return true;
  if (!type.is(parameter_type) && !type.is(tensor_type)) {
    return false;
  }
  const at::Tensor t = obj.cast<at::Tensor>();
  return t.layout() == at::kStrided && !t.is_quantized() && (t.is_cpu() || t.is_cuda());
}

at::Tensor tensor_or_undefined(const py::object& obj) {
  return obj.is_none() ? at::Tensor() : obj.cast<at::Tensor>();
}

std::vector<std::int64_t> pair_of(const py::object& v) {
  if (py::isinstance<py::int_>(v)) {
    const auto i = v.cast<std::int64_t>();
    return {i, i};
  }
  return v.cast<std::vector<std::int64_t>>();
}

// Conv layers whose padding is a string or whose padding_mode is not "zeros" take the generic path
// (their own _conv_forward handles those).
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

// Upstream moved tensor-subclass weights to the CPU by replacing the whole Parameter (`.data =` does
// not move a subclass's inner tensors). The generic path does the same.
void move_params_to_cpu(const py::object& module) {
  py::dict params = module.attr("_parameters");
  for (const char* name : {"weight", "bias"}) {
    if (!params.contains(name) || params[name].is_none()) continue;
    py::object p = params[name];
    if (p.attr("device").attr("type").cast<std::string>() == "cpu") continue;
    py::object moved = p.attr("detach")().attr("to")("cpu");
    py::object param = torch_module().attr("nn").attr("Parameter")(moved, py::arg("requires_grad") = p.attr("requires_grad"));
    py::setattr(module, name, param);
  }
}

bool needs_dequantize(const py::object& w) {
  if (py::getattr(w, "is_quantized", py::bool_(false)).cast<bool>()) return true;
  const std::string mod = py::type::of(w).attr("__module__").cast<std::string>();
  if (mod.rfind("torchao", 0) == 0) return true;
  return !w.attr("dtype").attr("is_floating_point").cast<bool>();
}

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

std::string type_name_of(const py::handle& obj) {
  const py::object type = py::type::of(obj);
  return type.attr("__module__").cast<std::string>() + "." + type.attr("__name__").cast<std::string>();
}

// What a weight is, for the line that says it takes the generic path: its type, and for torchao's
// AffineQuantizedTensor the tensor_impl (the layout) and block size that decide how it dequantizes.
std::string describe_weight(const py::object& w) {
  std::string kind = type_name_of(w);
  if (py::hasattr(w, "tensor_impl")) kind += " with " + type_name_of(w.attr("tensor_impl"));
  if (py::hasattr(w, "block_size")) kind += ", block_size " + py::str(w.attr("block_size")).cast<std::string>();
  if (py::hasattr(w, "dtype")) kind += ", dtype " + py::str(w.attr("dtype")).cast<std::string>();
  return kind;
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
  q.library = "torchao";
  q.holder = impl;
  q.holder_attr = "tensor_impl";
  q.codes_attr = "float8_data";
  q.scale_attr = "scale";
  return true;
}

// optimum-quanto WeightQBytesTensor (0.2.5 on) or QBytesTensor (0.2.4, AI-Toolkit's pin), qfloat8
// e4m3/e5m2 and qint8: dequantize() = scale * codes.to(scale dtype). torchao Float8Tensor, weight-only:
// dequantize() = (codes.to(float32) * scale).to(dtype); torchao's AffineQuantizedTensor float8 above.
std::optional<QuantSource> quant_source_of(const py::object& w) {
  if (w.is_none()) return std::nullopt;
  const py::object type = py::type::of(w);
  const std::string name = type.attr("__name__").cast<std::string>();
  const std::string mod = type.attr("__module__").cast<std::string>();
  QuantSource q;
  if (mod.rfind("optimum.quanto", 0) == 0 && (name == "WeightQBytesTensor" || name == "QBytesTensor")) {
    const py::object axis = py::getattr(w, "axis", py::int_(0));
    if (!axis.is_none() && axis.cast<int>() != 0) return std::nullopt;
    q.library = "optimum-quanto";
    q.holder = w;
    q.codes_attr = "_data";
    q.scale_attr = "_scale";
  } else if (mod.rfind("torchao", 0) == 0 && name == "Float8Tensor") {
    if (!py::getattr(w, "act_quant_kwargs", py::none()).is_none()) return std::nullopt;  // not weight-only
    q.library = "torchao";
    q.holder = w;
    q.codes_attr = "qdata";
    q.scale_attr = "scale";
  } else if (mod.rfind("torchao", 0) == 0 && name == "AffineQuantizedTensor") {
    if (!torchao_affine_float8(w, q)) return std::nullopt;
  } else {
    return std::nullopt;
  }
  if (!py::hasattr(q.holder, q.codes_attr.c_str()) || !py::hasattr(q.holder, q.scale_attr.c_str())) return std::nullopt;
  q.codes = q.holder.attr(q.codes_attr.c_str()).cast<at::Tensor>();
  q.scale = q.holder.attr(q.scale_attr.c_str()).cast<at::Tensor>();
  q.scale_sizes = q.scale.sizes().vec();
  if (q.codes.dim() > 1 && q.scale.dim() == 1 && q.scale.numel() == q.codes.size(0) && q.scale.numel() > 1) {
    std::vector<std::int64_t> per_row(q.codes.dim(), 1);
    per_row[0] = q.codes.size(0);
    q.scale = q.scale.view(per_row);  // [out] as [out, 1, ...]
  }
  // Other groupings (block-wise scales) and code types take the generic path.
  if (!quantized_layout_supported(q.codes, q.scale)) return std::nullopt;
  if (q.library == "torchao") {
    q.math = at::kFloat;
    q.result = w.cast<at::Tensor>().scalar_type();
  } else {
    q.math = q.result = q.scale.scalar_type();
  }
  if (!is_real_dtype(q.result)) return std::nullopt;
  return q;
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

// Weight on the compute device in a form F.linear/F.conv2d accept (generic path).
py::object materialize(const py::object& w, const py::object& device, const py::object& dtype) {
  if (w.is_none()) return w;
  py::object moved = w.attr("to")(device, py::arg("non_blocking") = true);
  if (needs_dequantize(w)) {
    moved = py::hasattr(moved, "dequantize") ? moved.attr("dequantize")() : moved.attr("to")(dtype);
    if (!py::object(moved.attr("dtype")).is(dtype)) moved = moved.attr("to")(dtype);
  }
  return moved;
}

py::object compute_dtype_of(const py::object& x) {
  py::object dt = x.attr("dtype");
  py::module_& t = torch_module();
  for (const char* name : {"float32", "float16", "bfloat16"}) {
    if (dt.is(py::object(t.attr(name)))) return dt;
  }
  return t.attr("bfloat16");
}

py::object generic_forward(const py::object& module, const py::object& x, bool conv,
                           const std::shared_ptr<DeviceState>& state) {
  const bool on_cpu = state->mode() != Mode::kCuda;
  py::object device = on_cpu ? torch_module().attr("device")("cpu") : py::cast(state->device());
  py::object xin = on_cpu ? x.attr("to")("cpu") : x;
  py::object dtype = compute_dtype_of(xin);
  py::object w = materialize(module.attr("weight"), device, dtype);
  py::object b = materialize(py::getattr(module, "bias", py::none()), device, dtype);
  py::object out;
  if (conv) {
    out = module.attr("_conv_forward")(xin, w, b);
  } else {
    out = torch_module().attr("nn").attr("functional").attr("linear")(xin, w, b);
  }
  return on_cpu ? out.attr("to")(x.attr("device")) : out;
}

// OstrisLinear: the quantized state is in `_buffers` (plus the bias). They are packed into one arena block
// at attach (the layer's buffers and bias become host views of it); each call stages copies of them onto the
// device through the engine (pinned, prefetched, out of the ring into torch's allocator), swaps them into
// the layer for its own forward (its quantizer), then puts the host views back.
//
// The layer's buffers (then the bias) in the packed order; nullopt when the layer's set of buffers or its
// bias is not the one packed (a buffer registered, dropped or renamed since: a re-quantization into another
// backend, a loaded checkpoint's extra state), so the caller packs again.
std::optional<std::vector<at::Tensor>> ostris_tensors(const py::object& module, const LayerManager& core) {
  std::vector<at::Tensor> out;
  py::dict buffers = module.attr("_buffers");
  for (auto item : buffers) {
    if (item.second.is_none()) continue;
    if (out.size() == core.buffer_names.size() || item.first.cast<std::string>() != core.buffer_names[out.size()]) {
      return std::nullopt;
    }
    out.push_back(item.second.cast<at::Tensor>());
  }
  if (out.size() != core.buffer_names.size()) return std::nullopt;
  py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
  if (bias.is_none() == core.ostris_bias) return std::nullopt;
  if (core.ostris_bias) out.push_back(bias.cast<at::Tensor>());
  return out;
}

void ostris_pack(const py::object& module, LayerManager& core) {
  py::dict buffers = module.attr("_buffers");
  core.buffer_names.clear();
  std::vector<at::Tensor> tensors;
  for (auto item : buffers) {
    if (item.second.is_none()) continue;
    core.buffer_names.push_back(item.first.cast<std::string>());
    tensors.push_back(item.second.cast<at::Tensor>());
  }
  py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
  core.ostris_bias = !bias.is_none();
  if (core.ostris_bias) tensors.push_back(bias.cast<at::Tensor>());
  if (tensors.empty()) return;
  std::vector<at::Tensor> views = core.layer->pack_tensors(tensors);
  for (std::size_t i = 0; i < core.buffer_names.size(); ++i) buffers[core.buffer_names[i].c_str()] = py::cast(views[i]);
  if (core.ostris_bias) {
    // The bias stays the Parameter (LoRA and the optimizer hold it), its data set to its view.
    at::Tensor param = bias.cast<at::Tensor>();
    param.set_data(views.back());
    core.layer->adopt_tensor(views.size() - 1, param);
  }
}

py::object ostris_forward(const py::object& module, LayerManager& core, const py::object& original,
                          const py::object& x, const std::shared_ptr<DeviceState>& state) {
  if (state->mode() == Mode::kCpu || core.layer->packed_bytes() == 0) return original(x);
  std::optional<std::vector<at::Tensor>> host = ostris_tensors(module, core);
  if (!host || !core.layer->tensors_current(*host)) {
    // Buffers replaced (a requantize, a load) or a different set of them: pack what the layer holds now.
    ostris_pack(module, core);
    host = ostris_tensors(module, core);
  }
#ifdef LAYERSTREAM_TORCH_CUDA
  // The layer's own forward runs with the process device current, as stock runs it: the quantizers' Triton
  // kernels launch on the current device (a model on cuda:1 while cuda:0 is current would launch there).
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state->mode() == Mode::kCuda) guard.emplace(state->device().index());
#endif
  std::vector<at::Tensor> staged = core.layer->stage_tensors();
  py::dict buffers = module.attr("_buffers");
  py::object bias = core.ostris_bias ? py::object(py::dict(module.attr("_parameters"))["bias"]) : py::none();
  auto swap_in = [&](const std::vector<at::Tensor>& tensors) {
    for (std::size_t i = 0; i < core.buffer_names.size(); ++i) buffers[core.buffer_names[i].c_str()] = py::cast(tensors[i]);
    if (core.ostris_bias) at::Tensor(bias.cast<at::Tensor>()).set_data(tensors.back());
  };
  // The bias in `host` is the Parameter itself: swapping the staged copy in changes what it holds, so the
  // host data to put back is taken now, as a tensor of its own over the same (arena) storage.
  if (core.ostris_bias) host->back() = host->back().detach();
  swap_in(staged);
  try {
    py::object out = original(x);
    swap_in(*host);
    return out;
  } catch (...) {
    swap_in(*host);
    throw;
  }
}

// Packs the layer's quantized weight (moved to the host first if it is elsewhere) and its bias; the
// weight object's codes and scale become views of the arena block.
void pack_quantized(const py::object& module, LayerManager& core) {
  move_params_to_cpu(module);
  py::object w = module.attr("weight");
  std::optional<QuantSource> q = quant_source_of(w);
  LS_CHECK(q.has_value(), "the quantized weight of this layer changed to a kind layerstream does not stream natively");
  const at::Tensor bias = tensor_or_undefined(py::getattr(module, "bias", py::none()));
  const bool frozen = !w.cast<at::Tensor>().requires_grad();
  auto views = core.layer->pack_quantized(q->codes, q->scale, q->math, q->result, bias, frozen);
  py::setattr(q->holder, q->codes_attr.c_str(), py::cast(views[0]));
  py::setattr(q->holder, q->scale_attr.c_str(), py::cast(views[1].view(q->scale_sizes)));
  core.quant_weight = w;
  core.holder_attr = q->holder_attr;
  core.codes_attr = q->codes_attr;
  core.scale_attr = q->scale_attr;
}

// The layer's `name` Parameter (None when absent) read from its `_parameters` dict: nn.Module's
// __getattr__ is Python code, a dict lookup is not (about a microsecond less per read, on every call).
// Assigning a Parameter or None to the attribute goes into that dict, so it is the one to read; anything
// else (an attribute outside it) is read the slow way.
py::object param_of(const py::object& module, const char* name) {
  PyObject* dict = PyObject_GenericGetAttr(module.ptr(), py::str("__dict__").ptr());
  if (dict != nullptr) {
    py::object d = py::reinterpret_steal<py::object>(dict);
    PyObject* params = PyDict_GetItemString(d.ptr(), "_parameters");  // borrowed
    if (params != nullptr && PyDict_Check(params)) {
      if (PyObject* p = PyDict_GetItemString(params, name)) return py::reinterpret_borrow<py::object>(p);
    }
  } else {
    PyErr_Clear();
  }
  return py::getattr(module, name, py::none());
}

// LAYERSTREAM_HOST_DTYPE=lossless, at attach and before each use of a layer whose weight the setting
// takes: a PackedWeight Parameter that was unfrozen or written (or is not this layer's) is made plain
// again (exact, in place); the layer is brought up to date (packed again where needed); and a weight the
// layer now holds packed gets a PackedWeight Parameter (in place), so that the process keeps no plain copy.
// No at::Tensor of the Parameter may be held across the swaps (torch.utils.swap_tensors refuses).
void sync_packed_weight(const py::object& module, StreamedLayer& layer) {
  py::module_& pw = packed_weight_module();
  py::object w = param_of(module, "weight");
  if (is_packed_weight(w)) {
    bool keep = false;
    {
      const at::Tensor t = w.cast<at::Tensor>();
      keep = !t.requires_grad() && layer.holds_packed_parameter(t);
    }
    if (!keep || w.attr("_ls_packed").attr("writes").cast<std::int64_t>() != 0) {
      layer.forget_weight_parameter();  // packed again below, from the plain values
      pw.attr("unwrap")(w);
    }
  }
  {
    const at::Tensor t = w.cast<at::Tensor>();
    layer.refresh(t, tensor_or_undefined(param_of(module, "bias")));
  }
  if (const auto bytes = layer.packed_weight_to_wrap()) {
    const std::vector<int> table(bytes->spec.exponent.begin(), bytes->spec.exponent.end());
    const py::tuple spec = py::make_tuple(bytes->spec.count, bytes->spec.exceptions, table);
    layer.forget_weight_parameter();
    pw.attr("wrap")(w, bytes->codes, spec, bytes->sizes);  // false: it keeps its plain values
    layer.adopt_weight_parameter(w.cast<at::Tensor>());
  }
}

// Per call on the quantized path: a weight that takes a gradient goes through the library (generic
// path: its autograd is right); a replaced weight, swapped codes or a replaced bias are packed again.
py::object quantized_forward(const py::object& module, LayerManager& core, const py::object& x, bool conv,
                             const std::shared_ptr<DeviceState>& state) {
  py::object w = param_of(module, "weight");
  if (at::GradMode::is_enabled() && w.cast<at::Tensor>().requires_grad()) {
    log_once("quantized-trainable", LogLevel::kInfo,
             "a quantized weight that requires grad runs through its library's own dequantize (no fast path); "
             "freeze the base model (requires_grad_(False)) to stream it as stored");
    return generic_forward(module, x, conv, state);
  }
  const at::Tensor bias = tensor_or_undefined(param_of(module, "bias"));
  bool current = w.is(core.quant_weight);
  if (current) {
    const py::object holder = core.holder_attr.empty() ? w : py::getattr(w, core.holder_attr.c_str(), py::none());
    current = py::hasattr(holder, core.codes_attr.c_str()) &&
              core.layer->is_current(holder.attr(core.codes_attr.c_str()).cast<at::Tensor>(), bias);
  }
  if (!current) {
    if (!streams_quantized(w)) {
      throw py::value_error("layerstream: this layer's weight was replaced by one it cannot stream (" +
                            py::str(py::type::of(w)).cast<std::string>() +
                            "); detach the layer (MemoryManager.detach) before replacing its weight with another kind");
    }
    pack_quantized(module, core);
  }
  // `bias` is the Parameter itself: a re-pack swaps its data, not its identity.
  return py::cast(core.layer->forward_frozen(x.cast<at::Tensor>(), bias));
}

py::cpp_function make_forward(const py::object& module, const py::object& manager_obj,
                              c10::intrusive_ptr<StreamedLayer> layer, std::shared_ptr<DeviceState> state,
                              std::string path, bool conv) {
  py::object weakref = py::module_::import("weakref").attr("ref");
  py::object module_ref = weakref(module);
  py::object manager_ref = weakref(manager_obj);
  return py::cpp_function([module_ref, manager_ref, layer, state, path, conv](py::args args, py::kwargs kwargs) -> py::object {
    py::object mgr = manager_ref();
    py::object module = module_ref();
    if (mgr.is_none() || module.is_none()) {
      throw std::runtime_error("layerstream: this forward belongs to a layer that was detached or freed; "
                               "attach it again with MemoryManager.attach");
    }
    if (args.size() != 1 || kwargs.size() != 0) {
      // Upstream contract: any extra argument goes to the original forward unchanged.
      return mgr.attr("_original_forward")(*args, **kwargs);
    }
    py::object x = args[0];
    if (path == "ostris") return ostris_forward(module, mgr.cast<LayerManager&>(), mgr.attr("_original_forward"), x, state);
    if (path == "generic") return generic_forward(module, x, conv, state);
    if (path == "quantized") return quantized_forward(module, mgr.cast<LayerManager&>(), x, conv, state);
    if (layer->lossless_takes_weight() || is_packed_weight(param_of(module, "weight"))) {
      sync_packed_weight(module, *layer);
    }
    const at::Tensor weight = param_of(module, "weight").cast<at::Tensor>();
    const at::Tensor bias = tensor_or_undefined(param_of(module, "bias"));
    return py::cast(layer->forward(x.cast<at::Tensor>(), weight, bias));
  });
}

enum class Which { kLinear, kConv, kOstris };

// The manager classes as this module defined them (it may be imported under another name, e.g. as
// toolkit.memory_management.manager_modules in copy mode).
py::handle& class_of(Which which) {
  static py::handle classes[3];
  return classes[static_cast<int>(which)];
}

void attach(const py::object& module, const py::object& manager, Which which) {
  if (py::hasattr(module, "_layer_memory_manager")) return;  // second attach: a no-op, as upstream
  py::object device = torch_module().attr("device")(manager.attr("process_device"));
  std::shared_ptr<DeviceState> state = state_for(device);

  py::object manager_obj = class_of(which)();
  LayerManager& core = manager_obj.cast<LayerManager&>();
  manager_obj.attr("module") = module;
  manager_obj.attr("manager") = manager;
  py::object ara = py::hasattr(module, "ara_lora_ref") ? module.attr("ara_lora_ref")() : py::none();
  manager_obj.attr("_original_forward") = ara.is_none() ? module.attr("forward") : ara.attr("org_forward");

  if (which == Which::kOstris) {
    core.path = "ostris";
    // The quantized buffers and the bias go into one arena block, as stored (moved off the device first).
    py::dict buffers = module.attr("_buffers");
    for (auto item : buffers) {
      if (item.second.is_none()) continue;
      buffers[item.first] = py::reinterpret_borrow<py::object>(item.second).attr("to")("cpu");
    }
    py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
    if (!bias.is_none()) bias.attr("data") = bias.attr("data").attr("to")("cpu");
    core.layer = c10::make_intrusive<StreamedLayer>(state, LayerKind::kLinear);
    ostris_pack(module, core);
  } else {
    const bool conv = which == Which::kConv;
    py::object weight = py::dict(module.attr("_parameters")).attr("get")("weight");
    py::object bias = py::getattr(module, "bias", py::none());
    for (const py::object& t : {weight, bias}) {
      if (!t.is_none() && py::hasattr(t, "is_meta") && t.attr("is_meta").cast<bool>()) {
        const std::string name = py::str(module.attr("__class__").attr("__name__")).cast<std::string>() + "(" +
                                 py::str(module.attr("extra_repr")()).cast<std::string>() + ")";
        throw py::value_error(
            "cannot manage " + name + ": its weights are on the meta device (shapes without data); load real weights into the model "
            "(load_state_dict(..., assign=True), or to_empty() then load) before MemoryManager.attach");
      }
    }
    // Zero-size layers have nothing to stream: they take the generic path (moved per call, for free).
    const bool empty = !weight.is_none() && weight.attr("numel")().cast<std::int64_t>() == 0;
    const bool plain = !weight.is_none() && !empty && is_plain(weight) && is_plain(bias) &&
                       (!conv || conv_is_plain(module));
    if (plain) {
      core.layer = c10::make_intrusive<StreamedLayer>(state, conv ? LayerKind::kConv2d : LayerKind::kLinear,
                                                      conv ? conv_params_of(module) : ConvParams{});
      if (is_packed_weight(weight)) {
        // A PackedWeight (of a layer managed before): plain again, packed below as this layer's. One that
        // another live layer holds (tied weights) cannot be swapped; it stays as it is.
        try {
          packed_weight_module().attr("unwrap")(weight);
        } catch (const py::error_already_set&) {
        }
      }
      // A Parameter another managed layer already packed (tied weights): that layer's block keeps it.
      const bool tied = py::hasattr(weight, "_is_memory_managed");
      const at::Tensor values =
          is_packed_weight(weight) ? weight.attr("_ls_packed").attr("values")().cast<at::Tensor>() : at::Tensor();
      core.layer->pack(weight.cast<at::Tensor>(), tensor_or_undefined(bias), tied, values);
      if (core.layer->lossless_takes_weight()) sync_packed_weight(module, *core.layer);
      core.path = state->mode() == Mode::kCpu ? "cpu" : "streamed";
    } else if (!empty && (!conv || conv_is_plain(module)) && is_plain(bias) && streams_quantized(weight)) {
      core.layer = c10::make_intrusive<StreamedLayer>(state, conv ? LayerKind::kConv2d : LayerKind::kLinear,
                                                      conv ? conv_params_of(module) : ConvParams{});
      pack_quantized(module, core);
      core.path = "quantized";
    } else {
      if (!empty && !is_plain(weight)) {
        const std::string kind = describe_weight(weight);
        log_once("generic-weight-" + kind, LogLevel::kInfo,
                 "weights of type " + kind + " take the generic path (moved as stored and dequantized by their "
                 "library at every call, no prefetch): not a layout layerstream streams natively (docs/ai-toolkit.md, "
                 "Quantized weights)");
      }
      move_params_to_cpu(module);
      core.path = "generic";
    }
  }

  module.attr("_layer_memory_manager") = manager_obj;
  for (auto p : module.attr("parameters")(py::arg("recurse") = false)) {
    py::setattr(p, "_is_memory_managed", py::bool_(true));
  }
  module.attr("_memory_management_device") = manager.attr("process_device");
  py::cpp_function forward =
      make_forward(module, manager_obj, core.layer, state, core.path, which == Which::kConv);
  if (ara.is_none()) {
    module.attr("forward") = forward;
  } else {
    ara.attr("org_forward") = forward;
  }
}

py::dict stats_dict(const StateStats& s) {
  py::dict d;
  d["fetches"] = s.engine.fetches;
  d["copies_h2d"] = s.engine.copies_h2d;
  d["bytes_h2d"] = s.engine.bytes_h2d;
  d["reuse_hits"] = s.engine.reuse_hits;
  d["downloads"] = s.engine.downloads;
  d["bytes_d2h"] = s.engine.bytes_d2h;
  d["pinned_bytes"] = s.engine.arena.bytes_pinned;
  d["host_bytes_held"] = s.engine.arena.bytes_held;
  d["host_bytes_requested"] = s.engine.arena.bytes_requested;
  d["ring_bytes"] = s.engine.ring_capacity;
  d["leases_outstanding"] = s.engine.leases_outstanding;
  d["downloads_pending"] = s.engine.downloads_pending;  // gradient copies not yet joined
  d["engines_built"] = s.engines_built;
  d["prefetches"] = s.engine.prefetches;
  d["prefetch_hits"] = s.engine.prefetch_hits;
  d["prefetch_wasted"] = s.engine.prefetch_wasted;
  d["predicted_uses"] = s.predictor.predicted;
  d["predicted_correctly"] = s.predictor.correct;
  d["sim_races"] = s.sim_races;
  // Quantized layers: dequantized into the ring region's scratch, found there again, or into memory of
  // their own (resident layers, layouts the kernel does not take); losslessly packed layers: found
  // decoded in the scratch, by the engine's derive stream after the copy.
  d["dequant_into_scratch"] = s.dequant_into_scratch;
  d["dequant_reused"] = s.dequant_reused;
  d["dequant_own_memory"] = s.dequant_own_memory;
  d["dequant_on_copy"] = s.dequant_on_copy;
  d["resident_hits"] = s.engine.resident_hits;
  d["resident_layers"] = s.engine.resident_layers;
  d["resident_bytes"] = s.engine.resident_bytes;
  d["vram_budget_planned"] = static_cast<std::uint64_t>(s.vram_budget_planned);
  d["vram_budget_room"] = s.vram_budget_room;
  d["vram_budget_estimate"] = s.vram_budget_estimate;
  d["pressure_yields"] = s.pressure_yields;  // times resident layers gave memory back to an allocation
  d["pressure_yielded_bytes"] = s.pressure_yielded_bytes;
  d["device_bytes"] = s.engine.ring_capacity + s.engine.resident_bytes;  // what layerstream holds on the device
  d["copy_wait_us"] = s.engine.copy_wait_us;  // LAYERSTREAM_TIME_WAITS=1: compute waiting for copies
  d["copy_waits_timed"] = s.engine.copy_waits_timed;
  return d;
}


py::dict stats() {
  // Every counter summed over the live device states, plus how many there are and which.
  py::dict total = stats_dict(StateStats{});
  py::list devices;
  for (const auto& state : DeviceState::live()) {
    for (auto item : stats_dict(state->stats())) {
      const std::string key = item.first.cast<std::string>();
      const std::uint64_t value = item.second.cast<std::uint64_t>();
      total[key.c_str()] = total[key.c_str()].cast<std::uint64_t>() + value;
    }
    devices.append(state->describe());
  }
  total["device_states"] = devices.size();
  total["devices"] = devices;
  // Host memory this process holds through the copy the host's ranks share (in no arena's counts).
  total["host_shared_bytes"] = HostShare::bytes_live();
  total["host_shared_blocks"] = HostShare::blocks_live();
  // Host memory the managed layers hold (streamed_layer.h, HostMemoryCounts): pinned arena bytes of packed
  // weights, pinned arena bytes stored as they are, pageable bytes (unpinned blocks, plain copies kept
  // beside packed weights).
  const HostMemoryCounts host = host_memory_counts();
  total["host_pinned_packed_bytes"] = host.pinned_packed;
  total["host_pinned_plain_bytes"] = host.pinned_plain;
  total["host_pageable_bytes"] = host.pageable;
  return total;
}

// LAYERSTREAM_SHARE_HOST (host_share.h): one host copy for the ranks of a host.
std::optional<ShareConfig> resolve_share() {
  const std::shared_ptr<const Settings> settings = Settings::current();
  if (settings->share_host == ShareHost::kOff) return std::nullopt;
  const char* world = settings->local_world_size ? settings->local_world_size->c_str() : nullptr;
  const char* rank = settings->local_rank ? settings->local_rank->c_str() : nullptr;
  if (world == nullptr || rank == nullptr || std::atoi(world) <= 1) {
    if (settings->share_host == ShareHost::kOn) {
      log_once("share-no-ranks", LogLevel::kWarning,
               "LAYERSTREAM_SHARE_HOST is on but LOCAL_RANK / LOCAL_WORLD_SIZE (set by torchrun and accelerate) "
               "do not name several ranks on this host: nothing to share");
    }
    return std::nullopt;
  }
  ShareConfig config;
  config.local_world = std::atoi(world);
  config.local_rank = std::atoi(rank);
  LS_CHECK_ARG(config.local_rank >= 0 && config.local_rank < config.local_world, "LOCAL_RANK=", rank,
               " is not below LOCAL_WORLD_SIZE=", world);
  config.timeout_s = settings->share_timeout_s;
  const char* run_id = settings->torchelastic_run_id ? settings->torchelastic_run_id->c_str() : nullptr;
  if (settings->share_token) {
    config.token = *settings->share_token;
  } else if (run_id != nullptr) {
    // torchrun (and accelerate, which uses it) starts the local ranks from one agent process, with the
    // same run id and master port: the name follows from those without any collective call, so a rank
    // that attaches alone (or late) never blocks the others.
    const char* port = settings->master_port ? settings->master_port->c_str() : nullptr;
    const std::string key = std::string(run_id) + "/" + (port ? port : "") + "/" + std::to_string(::getppid());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(std::hash<std::string>{}(key)));
    config.token = hex;
  } else {
    // Other launchers: the ranks agree on a fresh name through torch.distributed (global rank 0 draws it;
    // a collective call, so every rank must attach): segments of another job never collide with this one's.
    py::gil_scoped_acquire gil;
    py::module_ dist = py::module_::import("torch.distributed");
    if (!dist.attr("is_available")().cast<bool>() || !dist.attr("is_initialized")().cast<bool>()) {
      log_once("share-no-dist", LogLevel::kWarning,
               "LOCAL_WORLD_SIZE > 1 but torch.distributed is not initialized (and LAYERSTREAM_SHARE_TOKEN is "
               "unset): each rank keeps its own host copy of the weights; initialize the process group before "
               "attaching to share one");
      return std::nullopt;
    }
    py::list box;
    if (dist.attr("get_rank")().cast<int>() == 0) {
      box.append(py::module_::import("os").attr("urandom")(8).attr("hex")());
    } else {
      box.append(py::none());
    }
    dist.attr("broadcast_object_list")(box, py::arg("src") = 0);
    config.token = box[0].cast<std::string>();
  }
  return config;
}

// Core messages go to Python's `logging` (logger "layerstream"), from any thread; during interpreter
// shutdown, to stderr.
void route_log_to_python() {
  set_log_sink([](LogLevel level, const std::string& message) {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      std::fprintf(stderr, "layerstream: %s\n", message.c_str());
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::module_::import("logging").attr("getLogger")("layerstream").attr("log")(static_cast<int>(level), message);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("layerstream log sink");
    }
  });
}

// Once every LAYERSTREAM_LOG_EVERY optimizer steps (default 100; 0: never), an INFO line with what the
// steps since the last one moved. AI-Toolkit calls sync_grad_transfers() once per optimizer step.
void log_step_telemetry() {
  static std::uint64_t steps = 0;
  static py::dict* last = nullptr;
  static auto last_time = std::chrono::steady_clock::now();
  const std::uint64_t every = Settings::current()->log_every;
  if (every == 0 || ++steps % every != 0) return;
  py::dict now = stats();
  const auto now_time = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now_time - last_time).count();
  if (last == nullptr) last = new py::dict(stats_dict(StateStats{}));
  auto delta = [&](const char* key) {
    return (now[key].cast<double>() - (*last)[key].cast<double>()) / static_cast<double>(every);
  };
  // Bytes over the wall-clock time of the interval: what the step achieved on the bus, overlap included
  // (not the bus's own rate, which `layerstream doctor` measures).
  const double gb_per_s = seconds > 0 ? delta("bytes_h2d") * static_cast<double>(every) / seconds / 1e9 : 0.0;
  log(LogLevel::kInfo,
      layerstream::detail::concat("layerstream, per step over the last ", every, " steps (", seconds / every,
                     " s/step): ", delta("fetches"), " layer calls, ", delta("copies_h2d"), " copies (",
                     delta("bytes_h2d") / 1e9, " GB, ", gb_per_s, " GB/s over the steps), ", delta("reuse_hits"),
                     " served from the ring, ", delta("prefetch_hits"), " prefetch hits, ", delta("resident_hits"),
                     " resident, ", delta("bytes_d2h") / 1e9, " GB of gradients back",
                     now["copy_waits_timed"].cast<double>() > 0
                         ? layerstream::detail::concat(", compute waited ", delta("copy_wait_us") / 1e3, " ms for copies")
                         : std::string(),
                     "; pinned ",
                     now["pinned_bytes"].cast<double>() / 1e9, " GB, device ",
                     now["device_bytes"].cast<double>() / 1e9, " GB (ring + resident)"));
  *last = now;
  last_time = now_time;
}

void check_torch_version() {
  const std::string running = torch_module().attr("__version__").cast<std::string>();
  const std::string built = LAYERSTREAM_TORCH_BUILT_WITH;
  if (running != built) {
    throw py::import_error("layerstream.manager_modules was built against torch " + built +
                           " but this process runs torch " + running +
                           "; rebuild it in this environment: pip install --no-build-isolation --force-reinstall "
                           "layerstream (from its source directory)");
  }
}

}  // namespace

PYBIND11_MODULE(manager_modules, m) {
  check_torch_version();
  route_log_to_python();
  // The settings are read and checked now: a bad value fails the import (its ValueError the cause of the
  // ImportError), not the first layer call minutes into a run.
  try {
    Settings::refresh();
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    throw py::error_already_set();
  }
  m.doc() = "layerstream's drop-in replacement for AI-Toolkit's toolkit/memory_management/manager_modules.py";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OutOfDeviceMemory& e) {
      // torch.OutOfMemoryError (a RuntimeError), so that trainers' OOM handling sees it as one.
      py::object oom = torch_module().attr("OutOfMemoryError");
      PyErr_SetString(oom.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<LayerManager>(m, "BaseLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_readonly("path", &LayerManager::path, "How calls run: streamed, cpu, quantized, generic or ostris.")
      .def_property_readonly(
          "stored_as", [](const LayerManager& m) -> py::object {
            return m.layer ? py::cast(m.layer->stored_as()) : py::none();
          },
          "The dtype of the weight bytes in the arena (float8/int8 codes when quantized or compressed).")
      .def_property_readonly("packed_bytes", [](const LayerManager& lm) -> std::size_t {
        return lm.layer ? lm.layer->packed_bytes() : 0;
      });
  py::class_<LinearManager, LayerManager>(m, "LinearLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kLinear);
      }, py::arg("module"), py::arg("manager"));
  py::class_<ConvManager, LayerManager>(m, "ConvLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kConv);
      }, py::arg("module"), py::arg("manager"));
  py::class_<OstrisManager, LayerManager>(m, "OstrisLinearLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kOstris);
      }, py::arg("module"), py::arg("manager"));

  py::class_<DeviceStateHandle>(m, "DeviceState")
      .def_property_readonly("description", [](const DeviceStateHandle& h) { return h.state->describe(); })
      .def("stats", [](DeviceStateHandle& h) { return stats_dict(h.state->stats()); },
           "This device's counters: bytes moved, reuse, host memory, leases outstanding.")
      .def("_sim_fail_next_copies",
           [](DeviceStateHandle& h, int count) { simulator_of(h, "_sim_fail_next_copies").fail_next_h2d_copies(count); },
           py::arg("count"),
           "Simulator only: the next `count` host-to-device copies fail to be issued (as a failed CUDA call "
           "would). For tests.")
      .def("_sim_device_alloc",
           [](DeviceStateHandle& h, std::size_t bytes) {
             void* p = simulator_of(h, "_sim_device_alloc").device_alloc(bytes);
             LS_CHECK(p != nullptr, "out of memory on the simulated device: ", bytes, " bytes did not fit");
             return reinterpret_cast<std::uintptr_t>(p);
           },
           py::arg("bytes"),
           "Simulator only: takes `bytes` of the simulated device as another allocation of the process would "
           "(memory pressure gives resident layers back first); returns a handle for _sim_device_free. For tests.")
      .def("_sim_device_free",
           [](DeviceStateHandle& h, std::uintptr_t handle) {
             simulator_of(h, "_sim_device_free").device_free(reinterpret_cast<void*>(handle));
           },
           py::arg("handle"), "Simulator only: frees what _sim_device_alloc took. For tests.")
      .def("__repr__", [](const DeviceStateHandle& h) { return "<layerstream DeviceState " + h.state->describe() + ">"; });

  class_of(Which::kLinear) = m.attr("LinearLayerMemoryManager");
  class_of(Which::kConv) = m.attr("ConvLayerMemoryManager");
  class_of(Which::kOstris) = m.attr("OstrisLinearLayerMemoryManager");

  m.attr("_DEVICE_STATE") = device_state_dict();
  HostShare::set_resolver(&resolve_share);
  install_cuda_memory_probe();
  m.def(
      "_dequantize",
      [](const at::Tensor& codes, const at::Tensor& scale, const std::string& out, const std::string& math,
         bool use_core) {
        auto dtype_of = [](const std::string& name) {
          if (name == "float32") return at::kFloat;
          if (name == "float16") return at::kHalf;
          if (name == "bfloat16") return at::kBFloat16;
          throw py::value_error("dtype must be float32, float16 or bfloat16, not '" + name + "'");
        };
        return dequantize_codes(codes, scale, dtype_of(math), dtype_of(out), use_core);
      },
      py::arg("codes"), py::arg("scale"), py::arg("out") = "bfloat16", py::arg("math") = "float32",
      py::arg("use_core") = true,
      "Codes (int8/float8) times a per-row (or single) scale, rounded to `math` then to `out`: the fused "
      "CUDA kernel for CUDA tensors, its host reference for CPU ones (use_core=False: torch operations). "
      "For tests and benchmarks.");
  m.def(
      "_lossless_pack",
      [](const at::Tensor& weight) {
        LS_CHECK_ARG(weight.scalar_type() == at::kBFloat16 && weight.numel() > 0,
                     "_lossless_pack takes a non-empty bfloat16 tensor, not ", weight.scalar_type(), " of shape ",
                     weight.sizes());
        auto [codes, spec] = *lossless_pack(weight, /*only_if_smaller=*/false);
        const std::vector<int> table(spec.exponent.begin(), spec.exponent.end());
        return py::make_tuple(codes, py::make_tuple(spec.count, spec.exceptions, table));
      },
      py::arg("weight"),
      "Packs a bfloat16 tensor losslessly (layerstream/lossless.h) on the host: (uint8 bytes, spec). For "
      "tests and benchmarks.");
  m.def(
      "_lossless_unpack",
      [](const at::Tensor& codes, const py::tuple& spec_tuple, const std::vector<std::int64_t>& shape,
         unsigned max_blocks) {
        LosslessSpec spec;
        spec.count = spec_tuple[0].cast<std::size_t>();
        spec.exceptions = spec_tuple[1].cast<std::size_t>();
        const auto table = spec_tuple[2].cast<std::vector<int>>();
        LS_CHECK_ARG(table.size() == spec.exponent.size(), "_lossless_unpack: a table of 16 exponents, not ",
                     table.size());
        for (std::size_t k = 0; k < table.size(); ++k) {
          LS_CHECK_ARG(table[k] >= 0 && table[k] <= 255, "_lossless_unpack: exponent ", table[k], " of the table");
          spec.exponent[k] = static_cast<std::uint8_t>(table[k]);
        }
        return lossless_unpack(codes, spec, shape, max_blocks);
      },
      py::arg("codes"), py::arg("spec"), py::arg("shape"), py::arg("max_blocks") = 0u,
      "The bfloat16 tensor of `shape` rebuilt from _lossless_pack's bytes (on their device: the CUDA kernels "
      "on torch's current stream, at most `max_blocks` thread blocks, 0 for no limit; or the host reference). "
      "For tests and benchmarks: the bytes are trusted (the CUDA path does not check the exception list's "
      "indices).");
  m.def("_lossless_threads", &lossless_threads,
        "How many threads the host's lossless encoder runs on (0 was set: one per core).");
  m.def("_set_lossless_threads", &lossless_set_threads, py::arg("threads"),
        "Sets how many threads the host's lossless encoder runs on (0: one per core, the default); its output "
        "is the same for any number. For benchmarks and tests.");
  m.def("_decode_blocks", &decode_blocks,
        "The most thread blocks a lossless decode on the derive stream uses (LAYERSTREAM_DECODE_BLOCKS; 0: no "
        "limit).");
  m.def("_set_decode_blocks", &set_decode_blocks, py::arg("blocks"),
        "Sets the most thread blocks for the lossless decodes enqueued from now on (0: no limit). For "
        "benchmarks.");
  m.def("sync_grad_transfers", [] {
    {
      auto states = DeviceState::live();
      py::gil_scoped_release nogil;
      for (const auto& s : states) s->sync_downloads();
    }
    log_step_telemetry();
  }, "Joins every pending device-to-host gradient copy (call before reading .grad or stepping).");
  bind_settings(m);
  m.def("_reset_log_once", &reset_log_once,
        "Forgets which once-only messages this module logged (its own log state, not _native's). For tests.");
  m.def("stats", &stats, "Totals over every live device state: bytes moved, reuse, host memory.");
  m.def("live_device_states", [] { return DeviceState::live().size(); },
        "How many device states are alive (each holds streams, events and a ring).");
  m.attr("__torch_version__") = LAYERSTREAM_TORCH_BUILT_WITH;
}
