#include "ostris_fast.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>

#include "layerstream/log.h"
#include "layerstream/ostris_decode.h"
#include "settings.h"
#include "streamed_layer.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

void own_forward(const std::string& backend, const std::string& why) {
  log_once("ostris-own-forward-" + backend, LogLevel::kInfo,
           "layerstream: AI-Toolkit's " + backend + " layers run their own forward (" + why +
               "); their buffers still stream as stored");
}

// The formats' parameters, read off the backend and the layer; throws py::error_already_set (or returns a
// reason) where they are not what the format needs.
std::string fill(OstrisFast& f, const py::object& module, const py::object& q, const py::dict& helpers,
                 const std::vector<std::string>& names) {
  auto pos = [&](const char* name) {
    auto it = std::find(names.begin(), names.end(), name);
    return it == names.end() ? -1 : static_cast<int>(it - names.begin());
  };
  if (f.backend == "UIntXQuantizer") {
    f.format = OstrisFast::Format::kUintx;
    f.bits = q.attr("nbits").cast<int>();
    f.group = q.attr("group_size").cast<std::int64_t>();
    const auto orig = real_type_of(module.attr("ostris_orig_dtype").cast<at::ScalarType>());
    if (!orig) return "an original dtype other than float32, float16 or bfloat16";
    f.orig = *orig;
    f.packed = pos("uintx_packed"), f.scale = pos("uintx_scale"), f.zero = pos("uintx_zero_point");
    if (f.packed < 0 || f.scale < 0 || f.zero < 0) return "buffers other than uintx_packed/_scale/_zero_point";
    if (f.bits < 2 || f.bits > 8) return std::to_string(f.bits) + " bits";
  } else {
    f.format = OstrisFast::Format::kCodebook;
    const bool vq = f.backend == "OrbitVQQuantizer";
    const char* prefix = vq ? "ovq_" : "orbit_";
    f.packed = pos(vq ? "ovq_packed" : "orbit_packed");
    f.scale = pos(vq ? "ovq_scales" : "orbit_row_norms");
    f.perm = pos(vq ? "ovq_perm" : "orbit_perm");
    f.signs = pos(vq ? "ovq_signs" : "orbit_signs");
    if (f.packed < 0 || f.scale < 0 || f.perm < 0 || f.signs < 0) {
      return std::string("buffers other than the ") + prefix + "* ones of this AI-Toolkit version";
    }
    f.block = module.attr(vq ? "ovq_block" : "orbit_block").cast<std::int64_t>();
    if (!helpers.contains("rpbh_forward")) return "no rpbh_forward beside its forward";
    f.rotate = helpers["rpbh_forward"];
    if (vq) {
      f.bits = q.attr("index_bits").cast<int>();
      f.vec_dim = q.attr("vec_dim").cast<std::int64_t>();
      f.group = module.attr("ovq_group").cast<std::int64_t>();
      f.entries = q.attr("codebook_size").cast<std::int64_t>();
      f.lattice = q.attr("lattice");
      if (!helpers.contains("get_vq_tables")) return "no get_vq_tables beside its forward";
      f.vq_tables = helpers["get_vq_tables"];
    } else {
      f.bits = module.attr("orbit_bits").cast<int>();
      f.group = module.attr("in_features").cast<std::int64_t>();
      f.codebook = pos("orbit_codebook");
      if (f.codebook < 0) return "no orbit_codebook buffer";
    }
    if (f.bits < 1 || f.bits > 16) return std::to_string(f.bits) + " index bits";
  }
  if (f.group <= 0 || module.attr("in_features").cast<std::int64_t>() % f.group != 0) return "groups that do not divide a row";
  return "";
}

}  // namespace

OstrisFast recognise_ostris(const py::object& module, const std::vector<std::string>& names) {
  OstrisFast f;
  const py::object q = py::getattr(module, "ostris_quantizer", py::none());
  if (q.is_none()) return f;
  const py::handle cls = py::type::handle_of(q);
  f.backend = py::str(cls.attr("__name__"));
  const std::string where = py::str(cls.attr("__module__"));
  const bool known = (f.backend == "UIntXQuantizer" && ends_with(where, "uintx_quant")) ||
                     (f.backend == "OrbitQuantizer" && ends_with(where, "orbit_quant")) ||
                     (f.backend == "OrbitVQQuantizer" && ends_with(where, "orbit_vq_quant"));
  if (!known) {
    own_forward(f.backend, "a backend layerstream does not decode");
    return OstrisFast{};
  }
  if (!Settings::current()->ostris_decode) {
    own_forward(f.backend, "LAYERSTREAM_OSTRIS_DECODE=0");
    return OstrisFast{};
  }
  // The forward the format is known for: the backend class's own, called by OstrisLinear's own. The backend's
  // helpers (rpbh_forward, get_vq_tables) are those its forward sees: its module's globals.
  const bool own_class = std::string(py::str(py::type::handle_of(module).attr("__name__"))) == "OstrisLinear";
  const bool patched = py::hasattr(q, "__dict__") && py::dict(q.attr("__dict__")).contains("forward");
  if (!own_class || patched) {
    own_forward(f.backend, !own_class ? "a subclass of OstrisLinear" : "a replaced forward");
    return OstrisFast{};
  }
  std::string why;
  try {
    const py::dict helpers = cls.attr("forward").attr("__globals__");
    why = fill(f, module, q, helpers, names);
  } catch (const std::exception& e) {  // py::error_already_set, py::cast_error
    why = std::string("attributes of another AI-Toolkit version: ") + e.what();
  }
  if (!why.empty()) {
    own_forward(f.backend, why);
    return OstrisFast{};
  }
  return f;
}

namespace {

#ifdef LAYERSTREAM_TORCH_CUDA
void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// Each decodes the staged buffers into `w` ([rows, cols] of the input's type), or returns why it cannot
// (buffers whose sizes or types are not the format's).
std::string decode_uintx_into(const OstrisFast& f, const std::vector<at::Tensor>& staged, at::Tensor& w,
                              RealType out, [[maybe_unused]] bool on_cuda) {
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.packed)];
  const at::Tensor& scale = staged[static_cast<std::size_t>(f.scale)];
  const at::Tensor& zero = staged[static_cast<std::size_t>(f.zero)];
  const UintxSpec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), f.bits,
                       static_cast<std::size_t>(f.group), f.orig, out};
  const std::size_t groups = spec.rows * (spec.cols / spec.group);
  if (static_cast<std::size_t>(packed.numel()) != uintx_packed_bytes(spec) || scale.nbytes() != real_size(spec.orig) * groups ||
      zero.scalar_type() != at::kByte || static_cast<std::size_t>(zero.numel()) != groups || !zero.is_contiguous()) {
    return "buffers whose sizes are not uintx's for this layer";
  }
  const auto* p = static_cast<const std::uint8_t*>(packed.data_ptr());
  const auto* z = static_cast<const std::uint8_t*>(zero.data_ptr());
#ifdef LAYERSTREAM_TORCH_CUDA
  if (on_cuda) {
    decode_uintx_cuda(spec, p, scale.data_ptr(), z, w.data_ptr(), stream_of(packed));
    return "";
  }
#endif
  decode_uintx_host(spec, p, scale.data_ptr(), z, w.data_ptr());
  return "";
}

std::string decode_codebook_into(const OstrisFast& f, const std::vector<at::Tensor>& staged, at::Tensor& w, RealType out,
                                 const py::object& x, [[maybe_unused]] bool on_cuda) {
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.packed)];
  const at::Tensor& scale = staged[static_cast<std::size_t>(f.scale)];
  at::Tensor cb;
  std::int64_t entries = f.entries;
  if (f.codebook >= 0) {  // orbit: the float32 codebook kept as bytes
    cb = staged[static_cast<std::size_t>(f.codebook)];
    if (cb.scalar_type() != at::kByte || cb.nbytes() % 4 != 0 || !cb.is_contiguous()) return "a codebook not of float32 bytes";
    entries = static_cast<std::int64_t>(cb.nbytes() / 4);
  } else {  // orbit-VQ: the backend's per-device lattice table
    cb = f.vq_tables(f.lattice, f.entries, x.attr("device")).attr("codebook").cast<at::Tensor>();
    if (cb.scalar_type() != at::kFloat || !cb.is_contiguous() || cb.device() != packed.device() ||
        cb.numel() != f.entries * f.vec_dim) {
      return "a lattice codebook not of float32 [codebook_size, vec_dim] on the layer's device";
    }
  }
  const auto scale_type = real_type_of(scale.scalar_type());
  const CodebookSpec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), f.bits,
                          static_cast<std::size_t>(f.vec_dim), static_cast<std::size_t>(entries),
                          static_cast<std::size_t>(f.group), scale_type.value_or(RealType::kFloat32), out};
  if (!scale_type || static_cast<std::size_t>(scale.numel()) != spec.rows * (spec.cols / spec.group) ||
      (spec.rows * spec.cols) % spec.vec_dim != 0 || static_cast<std::size_t>(packed.numel()) != codebook_packed_bytes(spec) ||
      reinterpret_cast<std::uintptr_t>(cb.data_ptr()) % 4 != 0) {
    return "buffers whose sizes are not the codebook format's for this layer";
  }
  const auto* p = static_cast<const std::uint8_t*>(packed.data_ptr());
  const auto* c = static_cast<const float*>(cb.data_ptr());
#ifdef LAYERSTREAM_TORCH_CUDA
  if (on_cuda) {
    decode_codebook_cuda(spec, p, c, scale.data_ptr(), w.data_ptr(), stream_of(packed));
    return "";
  }
#endif
  decode_codebook_host(spec, p, c, scale.data_ptr(), w.data_ptr());
  return "";
}

// The proof, once per input type: `w` against the backend's own dequantization of the same staged buffers
// (swapped into the layer); why they are not the same, or "".
std::string differs_from_backend(const py::object& module, const OstrisFast& f, const at::Tensor& w, const py::object& x) {
  try {
    const py::object q = module.attr("ostris_quantizer");
    const py::object want = f.format == OstrisFast::Format::kUintx
                                ? q.attr("_dequantize_native")(module).attr("to")(x.attr("dtype"))
                                : q.attr("_dequantize_rotated")(module, x.attr("dtype"));
    if (!at::equal(w, want.cast<at::Tensor>())) return "its weight decoded by layerstream differed from its own dequantization";
  } catch (py::error_already_set& e) {
    return std::string("its own dequantization could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

}  // namespace

std::optional<py::object> ostris_fast_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& bias,
                                              const py::object& x, bool decoded_on_cuda) {
  if (fast.format == OstrisFast::Format::kNone || fast.refused || !THPVariable_Check(x.ptr())) return std::nullopt;
  const at::Tensor xt = x.cast<at::Tensor>();
  const auto out_type = real_type_of(xt.scalar_type());
  const at::Tensor& packed = staged[static_cast<std::size_t>(fast.packed)];
  if (!out_type || xt.device() != packed.device()) return std::nullopt;  // (the backend's own call decides)
  const auto rows = module.attr("out_features").cast<std::int64_t>();
  const auto cols = module.attr("in_features").cast<std::int64_t>();
  std::string why;
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() ||
      !staged[static_cast<std::size_t>(fast.scale)].is_contiguous()) {
    why = "packed codes that are not contiguous bytes";
  } else if (decoded_on_cuda && (cols % 8 != 0 || fast.group % 8 != 0)) {
    why = "rows or groups that are not multiples of 8 values (the device kernels take eight at a time)";
  }
  at::Tensor w = at::empty({rows, cols}, packed.options().dtype(xt.scalar_type()));
  if (why.empty()) {
    why = fast.format == OstrisFast::Format::kUintx ? decode_uintx_into(fast, staged, w, *out_type, decoded_on_cuda)
                                                    : decode_codebook_into(fast, staged, w, *out_type, x, decoded_on_cuda);
  }
  const c10::ScalarType dtype = xt.scalar_type();
  if (why.empty() && std::find(fast.proven.begin(), fast.proven.end(), dtype) == fast.proven.end()) {
    why = differs_from_backend(module, fast, w, x);
    if (why.empty()) fast.proven.push_back(dtype);
  }
  if (!why.empty()) {
    fast.refused = true;
    own_forward(fast.backend, why);
    return std::nullopt;
  }
  const at::Tensor b = bias.is_none() ? at::Tensor() : bias.cast<at::Tensor>();
  if (fast.format == OstrisFast::Format::kUintx) return py::cast(at::linear(xt, w, b));
  const py::object x_rot = fast.rotate(x, staged[static_cast<std::size_t>(fast.perm)],
                                       staged[static_cast<std::size_t>(fast.signs)], fast.block);
  return py::cast(at::linear(x_rot.cast<at::Tensor>(), w, b));
}

}  // namespace layerstream::torchglue
