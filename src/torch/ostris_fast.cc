#include "ostris_fast.h"
#include "ostris_internal.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/ostris_decode.h"
#include "layerstream/settings.h"
#include "streamed_layer.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

namespace ostris_detail {

void own_forward(const std::string& backend, const std::string& why) {
  log_once("ostris-own-forward-" + backend, LogLevel::kInfo,
           "layerstream: AI-Toolkit's " + backend + " layers run their own forward (" + why +
               "); their buffers still stream as stored");
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::ScalarType as = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kByte;
  return at::equal(a.contiguous().view(as), b.contiguous().view(as));
}

#ifdef LAYERSTREAM_TORCH_CUDA
void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

}  // namespace ostris_detail

using namespace ostris_detail;

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

using SlotOf = std::function<int(const char*)>;  // a buffer's position in the packed order (-1: none)

// Each reads its layout's slots, shape and hooks off the backend and the layer; throws py::error_already_set
// (or returns a reason) where they are not what the layout needs.

// Groups of the layout's shape that divide a row (every layout but the convrot int family).
std::string groups_divide_rows(const OstrisFast& f, const py::object& module) {
  if (f.shape.group <= 0 || module.attr("in_features").cast<std::int64_t>() % f.shape.group != 0) {
    return "groups that do not divide a row";
  }
  return "";
}

// The convrot int8-matmul backends: convrot8's int8 codes, or the bitpacked (base-3 for bitnet) codes of the
// others, with group ratios up to 7 bits; the row scales as float32 bytes.
std::string fill_convrot_int(OstrisFast& f, const py::object& module, const py::object&, const py::dict& helpers,
                             const SlotOf& pos) {
  const bool eight = f.backend == "ConvRotInt8Quantizer";
  f.slot.packed = pos(eight ? "cr8_qdata" : "crn_qdata");
  f.slot.scale = pos(eight ? "cr8_scales" : "crn_scales");
  f.slot.ratio = eight ? -1 : pos("crn_gratio");
  if (f.slot.packed < 0 || f.slot.scale < 0) return eight ? "buffers other than cr8_qdata/_scales" : "buffers other than crn_qdata/_scales";
  f.shape.rot = module.attr(eight ? "cr8_rot_size" : "crn_rot_size").cast<std::int64_t>();
  f.shape.bits = eight ? 8 : module.attr("crn_bits").cast<int>();
  f.shape.codes = eight ? IntRowsSpec::Codes::kInt8
                  : f.backend == "ConvRotBitNetQuantizer" ? IntRowsSpec::Codes::kTernary : IntRowsSpec::Codes::kBitfield;
  if (f.shape.codes == IntRowsSpec::Codes::kTernary && (f.slot.ratio < 0 || f.shape.bits != 2)) return "ternary codes without group ratios";
  if (f.shape.bits < 2 || f.shape.bits > 8) return std::to_string(f.shape.bits) + " bits";
  const auto rows = module.attr("out_features").cast<std::int64_t>();
  const auto cols = module.attr("in_features").cast<std::int64_t>();
  if (f.slot.ratio >= 0) {
    const py::object ratio = py::dict(module.attr("_buffers"))["crn_gratio"];
    const auto bytes = ratio.attr("numel")().cast<std::int64_t>();  // (a uint8 view of float32 ratios)
    const std::int64_t per_row = rows > 0 ? bytes / 4 / rows : 0;
    if (per_row <= 0 || per_row * 4 * rows != bytes || cols % per_row != 0) return "group ratios that do not divide a row";
    f.shape.ratio_group = cols / per_row;
  }
  for (const char* name : {"rotate", "_int8_gemm_supported"}) {
    if (!helpers.contains(name)) return std::string("no ") + name + " beside its forward";
  }
  f.hooks.rotate = helpers["rotate"];
  f.hooks.int8_gemm = helpers["_int8_gemm_supported"];
  if (f.shape.rot <= 0 || cols % f.shape.rot != 0) return "a rotation block that does not divide a row";
  return "";
}

// nvfp4 and convrot4: packed e2m1 codes, e4m3 scales per 16 values, a float32 tensor scale.
std::string fill_nvfp4(OstrisFast& f, const py::object& module, const py::object&, const py::dict&, const SlotOf& pos) {
  f.slot.packed = pos("nv4_qdata");
  f.slot.scale = pos("nv4_scales");
  f.slot.pts = pos("nv4_pts");
  f.slot.pre_scale = pos("nv4_pre_scale");
  if (f.slot.packed < 0 || f.slot.scale < 0 || f.slot.pts < 0) return "buffers other than nv4_qdata/_scales/_pts";
  f.shape.group = 16;
  return groups_divide_rows(f, module);
}

std::string fill_convrot4(OstrisFast& f, const py::object& module, const py::object&, const py::dict& helpers,
                          const SlotOf& pos) {
  f.slot.packed = pos("cr_qdata");
  f.slot.scale = pos("cr_scales");
  f.slot.pts = pos("cr_pts");
  if (f.slot.packed < 0 || f.slot.scale < 0 || f.slot.pts < 0) return "buffers other than cr_qdata/_scales/_pts";
  f.shape.group = 16;
  f.shape.rot = module.attr("cr_rot_size").cast<std::int64_t>();
  for (const char* name : {"rotate", "quantize_nvfp4", "dequantize_nvfp4", "_fp4_gemm_supported"}) {
    if (!helpers.contains(name)) return std::string("no ") + name + " beside its forward";
  }
  f.hooks.rotate = helpers["rotate"];
  f.hooks.quantize = helpers["quantize_nvfp4"];
  f.hooks.dequantize = helpers["dequantize_nvfp4"];
  f.hooks.fp4_gemm = helpers["_fp4_gemm_supported"];
  if (f.shape.rot <= 0 || module.attr("in_features").cast<std::int64_t>() % f.shape.rot != 0) return "a rotation block that does not divide a row";
  return groups_divide_rows(f, module);
}

// uintx: bitpacked codes, a scale (in the original dtype) and a uint8 zero point per group.
std::string fill_uintx(OstrisFast& f, const py::object& module, const py::object& q, const py::dict&, const SlotOf& pos) {
  f.shape.bits = q.attr("nbits").cast<int>();
  f.shape.group = q.attr("group_size").cast<std::int64_t>();
  const auto orig = real_type_of(module.attr("ostris_orig_dtype").cast<at::ScalarType>());
  if (!orig) return "an original dtype other than float32, float16 or bfloat16";
  f.shape.orig = *orig;
  f.slot.packed = pos("uintx_packed"), f.slot.scale = pos("uintx_scale"), f.slot.zero = pos("uintx_zero_point");
  if (f.slot.packed < 0 || f.slot.scale < 0 || f.slot.zero < 0) return "buffers other than uintx_packed/_scale/_zero_point";
  if (f.shape.bits < 2 || f.shape.bits > 8) return std::to_string(f.shape.bits) + " bits";
  return groups_divide_rows(f, module);
}

// orbit (a float32 codebook buffer) and orbit-VQ (the backend's lattice tables): packed indices, a scale per
// group, and the randomized Hadamard rotation (perm, signs, block) the forward applies to the input.
std::string fill_codebook(OstrisFast& f, const py::object& module, const py::object& q, const py::dict& helpers,
                          const SlotOf& pos) {
  const bool vq = f.backend == "OrbitVQQuantizer";
  const char* prefix = vq ? "ovq_" : "orbit_";
  f.slot.packed = pos(vq ? "ovq_packed" : "orbit_packed");
  f.slot.scale = pos(vq ? "ovq_scales" : "orbit_row_norms");
  f.slot.perm = pos(vq ? "ovq_perm" : "orbit_perm");
  f.slot.signs = pos(vq ? "ovq_signs" : "orbit_signs");
  if (f.slot.packed < 0 || f.slot.scale < 0 || f.slot.perm < 0 || f.slot.signs < 0) {
    return std::string("buffers other than the ") + prefix + "* ones of this AI-Toolkit version";
  }
  f.shape.block = module.attr(vq ? "ovq_block" : "orbit_block").cast<std::int64_t>();
  if (!helpers.contains("rpbh_forward")) return "no rpbh_forward beside its forward";
  f.hooks.rotate = helpers["rpbh_forward"];
  if (vq) {
    f.shape.bits = q.attr("index_bits").cast<int>();
    f.shape.vec_dim = q.attr("vec_dim").cast<std::int64_t>();
    f.shape.group = module.attr("ovq_group").cast<std::int64_t>();
    f.shape.entries = q.attr("codebook_size").cast<std::int64_t>();
    f.hooks.lattice = q.attr("lattice");
    if (!helpers.contains("get_vq_tables")) return "no get_vq_tables beside its forward";
    f.hooks.vq_tables = helpers["get_vq_tables"];
  } else {
    f.shape.bits = module.attr("orbit_bits").cast<int>();
    f.shape.group = module.attr("in_features").cast<std::int64_t>();
    f.slot.codebook = pos("orbit_codebook");
    if (f.slot.codebook < 0) return "no orbit_codebook buffer";
  }
  if (f.shape.bits < 1 || f.shape.bits > 16) return std::to_string(f.shape.bits) + " index bits";
  return groups_divide_rows(f, module);
}

// Each decodes the staged buffers into `w` ([rows, cols] of the input's type), or returns why it cannot
// (buffers whose sizes or types are not the format's).
std::string decode_uintx_into(const OstrisFast& f, const std::vector<at::Tensor>& staged, at::Tensor& w,
                              RealType out, const py::object&, [[maybe_unused]] bool on_cuda) {
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.slot.packed)];
  const at::Tensor& scale = staged[static_cast<std::size_t>(f.slot.scale)];
  const at::Tensor& zero = staged[static_cast<std::size_t>(f.slot.zero)];
  const UintxSpec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), f.shape.bits,
                       static_cast<std::size_t>(f.shape.group), f.shape.orig, out};
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
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.slot.packed)];
  const at::Tensor& scale = staged[static_cast<std::size_t>(f.slot.scale)];
  at::Tensor cb;
  std::int64_t entries = f.shape.entries;
  if (f.slot.codebook >= 0) {  // orbit: the float32 codebook kept as bytes
    cb = staged[static_cast<std::size_t>(f.slot.codebook)];
    if (cb.scalar_type() != at::kByte || cb.nbytes() % 4 != 0 || !cb.is_contiguous()) return "a codebook not of float32 bytes";
    entries = static_cast<std::int64_t>(cb.nbytes() / 4);
  } else {  // orbit-VQ: the backend's per-device lattice table
    cb = f.hooks.vq_tables(f.hooks.lattice, f.shape.entries, x.attr("device")).attr("codebook").cast<at::Tensor>();
    if (cb.scalar_type() != at::kFloat || !cb.is_contiguous() || cb.device() != packed.device() ||
        cb.numel() != f.shape.entries * f.shape.vec_dim) {
      return "a lattice codebook not of float32 [codebook_size, vec_dim] on the layer's device";
    }
  }
  const auto scale_type = real_type_of(scale.scalar_type());
  const CodebookSpec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), f.shape.bits,
                          static_cast<std::size_t>(f.shape.vec_dim), static_cast<std::size_t>(entries),
                          static_cast<std::size_t>(f.shape.group), scale_type.value_or(RealType::kFloat32), out};
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

std::string decode_nvfp4_into(const OstrisFast& f, const std::vector<at::Tensor>& staged, at::Tensor& w, RealType out,
                              const py::object&, bool on_cuda) {
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.slot.packed)];
  const at::Tensor& scales = staged[static_cast<std::size_t>(f.slot.scale)];
  const at::Tensor& pts = staged[static_cast<std::size_t>(f.slot.pts)];
  // (The backend takes its Triton kernel on a GPU, its torch path on the host, until a proof says otherwise.)
  const Nvfp4Spec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), out,
                       f.proof.plus_zero.value_or(on_cuda)};
  if (spec.cols % 16 != 0 || static_cast<std::size_t>(packed.numel()) != spec.rows * spec.cols / 2 ||
      scales.scalar_type() != at::kByte || static_cast<std::size_t>(scales.numel()) != spec.rows * spec.cols / 16 ||
      pts.nbytes() != 4 || !pts.is_contiguous() || reinterpret_cast<std::uintptr_t>(pts.data_ptr()) % 4 != 0) {
    return "buffers whose sizes are not nvfp4's for this layer";
  }
  const auto* p = static_cast<const std::uint8_t*>(packed.data_ptr());
  const auto* sc = static_cast<const std::uint8_t*>(scales.data_ptr());
  const auto* t = static_cast<const float*>(pts.data_ptr());
#ifdef LAYERSTREAM_TORCH_CUDA
  if (on_cuda) {
    decode_nvfp4_cuda(spec, p, sc, t, w.data_ptr(), stream_of(packed));
    return "";
  }
#endif
  decode_nvfp4_host(spec, p, sc, t, w.data_ptr());
  return "";
}

// Each layout's call with its weight decoded (`b` the bias or undefined); nullopt: the layer's own forward.
std::optional<py::object> linear_call(const py::object&, OstrisFast&, const std::vector<at::Tensor>&, const py::object&,
                                      const at::Tensor& xt, const at::Tensor& w, const at::Tensor& b, std::int64_t,
                                      std::int64_t, bool) {
  return py::cast(at::linear(xt, w, b));
}

std::optional<py::object> nvfp4_call(const py::object&, OstrisFast& fast, const std::vector<at::Tensor>& staged,
                                     const py::object&, const at::Tensor& xt, const at::Tensor& w, const at::Tensor& b,
                                     std::int64_t, std::int64_t cols, bool) {
  // The backend's AWQ input scale, as it applies it: x * pre_scale (its float32 bytes) in x's type.
  at::Tensor xin = xt;
  if (fast.slot.pre_scale >= 0) {
    const at::Tensor& pre = staged[static_cast<std::size_t>(fast.slot.pre_scale)];
    if (pre.scalar_type() != at::kByte || !pre.is_contiguous() || pre.numel() != cols * 4 ||
        reinterpret_cast<std::uintptr_t>(pre.data_ptr()) % 4 != 0) {
      fast.proof.refused = true;
      own_forward(fast.backend, "an input scale that is not float32 bytes of one value per input");
      return std::nullopt;
    }
    xin = at::mul(xt, pre.view(at::kFloat).to(xt.scalar_type()));
  }
  return py::cast(at::linear(xin, w, b));
}

std::optional<py::object> convrot4_call(const py::object&, OstrisFast& fast, const std::vector<at::Tensor>&,
                                        const py::object& x, const at::Tensor& xt, const at::Tensor& w,
                                        const at::Tensor& b, std::int64_t rows, std::int64_t cols, bool on_cuda) {
  return convrot4_forward(fast, x, xt, w, b, rows, cols, on_cuda);
}

std::optional<py::object> codebook_call(const py::object&, OstrisFast& fast, const std::vector<at::Tensor>& staged,
                                        const py::object& x, const at::Tensor&, const at::Tensor& w,
                                        const at::Tensor& b, std::int64_t, std::int64_t, bool) {
  const py::object x_rot = fast.hooks.rotate(x, staged[static_cast<std::size_t>(fast.slot.perm)],
                                             staged[static_cast<std::size_t>(fast.slot.signs)], fast.shape.block);
  return py::cast(at::linear(x_rot.cast<at::Tensor>(), w, b));
}

// convrot4 decodes only where the GPU has no fp4 matmul: where it has, the backend's own forward uses them.
bool convrot4_decodes(OstrisFast& fast, const py::object& x, const at::Tensor& xt) {
  if (xt.numel() != 0 && !fast.hooks.fp4_gemm(x.attr("device")).cast<bool>()) return true;
  if (xt.numel() != 0) own_forward(fast.backend, "the GPU has fp4 matmuls, which its own forward uses");
  return false;
}

}  // namespace

// One row of the layout table (see ostris_fast.h).
struct OstrisLayout {
  const char* name;
  std::string (*fill)(OstrisFast&, const py::object& module, const py::object& quantizer, const py::dict& helpers,
                      const SlotOf& slot_of);
  // The layout's whole call where it keeps its own forward (the int8 matmul family: ostris_int.cc), else null
  // and the fields below apply.
  std::optional<py::object> (*whole_call)(const py::object& module, OstrisFast&, const std::vector<at::Tensor>& staged,
                                          const py::object& x, const at::Tensor& xt, std::int64_t rows,
                                          std::int64_t cols, bool on_cuda);
  bool (*decodes)(OstrisFast&, const py::object& x, const at::Tensor& xt);  // null: every call
  // Decodes the staged buffers into `w` ([rows, cols] of the input's type); why not, or "".
  std::string (*decode)(const OstrisFast&, const std::vector<at::Tensor>& staged, at::Tensor& w, RealType out,
                        const py::object& x, bool on_cuda);
  // The backend's own dequantization of the swapped-in buffers that the decode is proved against: its method,
  // called (module, dtype), or (module) then .to(dtype) where it takes no dtype (uintx).
  const char* own_weight;
  bool own_weight_takes_dtype;
  bool nvfp4_codes;  // code 8's zero sign is guessed from the device and settled by the first proof
  std::optional<py::object> (*call)(const py::object& module, OstrisFast&, const std::vector<at::Tensor>& staged,
                                    const py::object& x, const at::Tensor& xt, const at::Tensor& w, const at::Tensor& b,
                                    std::int64_t rows, std::int64_t cols, bool on_cuda);
};

namespace {

const OstrisLayout kUintx{"uintx", fill_uintx, nullptr, nullptr, decode_uintx_into, "_dequantize_native", false, false,
                          linear_call};
const OstrisLayout kCodebook{"codebook", fill_codebook, nullptr, nullptr, decode_codebook_into, "_dequantize_rotated",
                             true, false, codebook_call};
const OstrisLayout kNvfp4{"nvfp4", fill_nvfp4, nullptr, nullptr, decode_nvfp4_into, "_dequantize_weight", true, true,
                          nvfp4_call};
const OstrisLayout kConvrot4{"convrot4", fill_convrot4, nullptr, convrot4_decodes, decode_nvfp4_into,
                             "_dequantize_rotated", true, true, convrot4_call};
const OstrisLayout kConvrotInt{"convrot-int", fill_convrot_int, convrot_int_forward, nullptr, nullptr, nullptr, false,
                               false, nullptr};

// The backends layerstream decodes: the quantizer's class, the module it must come from (toolkit.util.<name>),
// and its layout.
struct OstrisBackend {
  const char* cls;
  const char* module_tail;
  const OstrisLayout* layout;
};
const OstrisBackend kBackends[] = {
    {"UIntXQuantizer", "uintx_quant", &kUintx},
    {"OrbitQuantizer", "orbit_quant", &kCodebook},
    {"OrbitVQQuantizer", "orbit_vq_quant", &kCodebook},
    {"Nvfp4Quantizer", "nvfp4_quant", &kNvfp4},
    {"ConvRotQuantizer", "convrot_quant", &kConvrot4},
    // ConvRot's W8A8 backends (convrot8, convrotint2..8, convrotbitnet, convrotcomfyw4a4): int8 matmuls
    // forward, a dequantized weight in the training backward.
    {"ConvRotInt8Quantizer", "convrot_quant", &kConvrotInt},
    {"ConvRotIntNQuantizer", "convrot_quant", &kConvrotInt},
    {"ConvRotBitNetQuantizer", "convrot_quant", &kConvrotInt},
    {"ConvRotComfyW4A4Quantizer", "convrot_quant", &kConvrotInt},
};

const OstrisLayout* layout_of(const std::string& cls, const std::string& module) {
  for (const OstrisBackend& b : kBackends) {
    if (cls == b.cls && ends_with(module, b.module_tail)) return b.layout;
  }
  return nullptr;
}

// The proof, once per input type: `w` against the backend's own dequantization of the same staged buffers
// (swapped into the layer); why they are not the same, or "".
std::string differs_from_backend(const py::object& module, const OstrisFast& f, const at::Tensor& w, const py::object& x) {
  try {
    const py::object own = module.attr("ostris_quantizer").attr(f.layout->own_weight);
    const at::Tensor theirs = (f.layout->own_weight_takes_dtype ? own(module, x.attr("dtype"))
                                                                : own(module).attr("to")(x.attr("dtype"))).cast<at::Tensor>();
    if (!same_bits(w, theirs)) {
      return at::equal(w, theirs) ? "its weight decoded by layerstream differed from its own dequantization in the sign of zeros"
                                  : "its weight decoded by layerstream differed from its own dequantization";
    }
  } catch (py::error_already_set& e) {
    return std::string("its own dequantization could not be called to check layerstream's: ") + e.what();
  }
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
  const OstrisLayout* layout = layout_of(f.backend, where);
  if (layout == nullptr) {
    own_forward(f.backend, "a backend layerstream does not decode");
    return OstrisFast{};
  }
  if (!Settings::current()->ostris_decode) {
    own_forward(f.backend, "LAYERSTREAM_OSTRIS_DECODE=0");
    return OstrisFast{};
  }
  // The forward the format is known for: the backend class's own, called by OstrisLinear's own. The backend's
  // helpers (rpbh_forward, get_vq_tables, rotate, ...) are those its forward sees: its module's globals.
  const bool own_class = std::string(py::str(py::type::handle_of(module).attr("__name__"))) == "OstrisLinear";
  const bool patched = py::hasattr(q, "__dict__") && py::dict(q.attr("__dict__")).contains("forward");
  if (!own_class || patched) {
    own_forward(f.backend, !own_class ? "a subclass of OstrisLinear" : "a replaced forward");
    return OstrisFast{};
  }
  std::string why;
  try {
    const py::dict helpers = cls.attr("forward").attr("__globals__");
    const SlotOf slot_of = [&](const char* name) {
      auto it = std::find(names.begin(), names.end(), name);
      return it == names.end() ? -1 : static_cast<int>(it - names.begin());
    };
    why = layout->fill(f, module, q, helpers, slot_of);
  } catch (const std::exception& e) {  // py::error_already_set, py::cast_error
    why = std::string("attributes of another AI-Toolkit version: ") + e.what();
  }
  if (!why.empty()) {
    own_forward(f.backend, why);
    return OstrisFast{};
  }
  f.layout = layout;
  return f;
}

std::optional<py::object> ostris_fast_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& bias,
                                              const py::object& x, bool decoded_on_cuda) {
  const OstrisLayout* layout = fast.layout;
  if (layout == nullptr || fast.proof.refused || !THPVariable_Check(x.ptr())) return std::nullopt;
  const at::Tensor xt = x.cast<at::Tensor>();
  const auto out_type = real_type_of(xt.scalar_type());
  const at::Tensor& packed = staged[static_cast<std::size_t>(fast.slot.packed)];
  if (!out_type || xt.device() != packed.device()) return std::nullopt;  // (the backend's own call decides)
  const auto rows = module.attr("out_features").cast<std::int64_t>();
  const auto cols = module.attr("in_features").cast<std::int64_t>();
  if (layout->whole_call != nullptr) return layout->whole_call(module, fast, staged, x, xt, rows, cols, decoded_on_cuda);
  if (layout->decodes != nullptr && !layout->decodes(fast, x, xt)) return std::nullopt;
  std::string why;
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() ||
      !staged[static_cast<std::size_t>(fast.slot.scale)].is_contiguous()) {
    why = "packed codes that are not contiguous bytes";
  } else if (decoded_on_cuda && (cols % 8 != 0 || fast.shape.group % 8 != 0)) {
    why = "rows or groups that are not multiples of 8 values (the device kernels take eight at a time)";
  }
  at::Tensor w = at::empty({rows, cols}, packed.options().dtype(xt.scalar_type()));
  if (why.empty()) why = layout->decode(fast, staged, w, *out_type, x, decoded_on_cuda);
  const c10::ScalarType dtype = xt.scalar_type();
  if (why.empty() && std::find(fast.proof.proven.begin(), fast.proof.proven.end(), dtype) == fast.proof.proven.end()) {
    why = differs_from_backend(module, fast, w, x);
    if (!why.empty() && layout->nvfp4_codes && fast.proof.proven.empty() && !fast.proof.plus_zero) {
      // The first proof of an nvfp4 layer: where the guess of the backend's path was wrong, the other sign of
      // code 8's zero, decoded again and proved again.
      fast.proof.plus_zero = !decoded_on_cuda;
      why = layout->decode(fast, staged, w, *out_type, x, decoded_on_cuda);
      if (why.empty()) why = differs_from_backend(module, fast, w, x);
    }
    if (why.empty()) {
      if (layout->nvfp4_codes) fast.proof.plus_zero = fast.proof.plus_zero.value_or(decoded_on_cuda);
      fast.proof.proven.push_back(dtype);
    }
  }
  if (!why.empty()) {
    fast.proof.refused = true;
    own_forward(fast.backend, why);
    return std::nullopt;
  }
  const at::Tensor b = bias.is_none() ? at::Tensor() : bias.cast<at::Tensor>();
  return layout->call(module, fast, staged, x, xt, w, b, rows, cols, decoded_on_cuda);
}

at::Tensor nvfp4_decode(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& pts, std::int64_t rows,
                        std::int64_t cols, c10::ScalarType out, bool plus_zero) {
  const auto type = real_type_of(out);
  LS_CHECK_ARG(type && rows > 0 && cols > 0, "nvfp4_decode: a float32, float16 or bfloat16 output of rows x cols");
  OstrisFast f;
  f.slot.packed = 0, f.slot.scale = 1, f.slot.pts = 2;
  f.proof.plus_zero = plus_zero;
  at::Tensor w = at::empty({rows, cols}, packed.options().dtype(out));
  const std::string why = decode_nvfp4_into(f, {packed.contiguous(), scales.contiguous(), pts.contiguous()}, w, *type,
                                            py::none(), packed.is_cuda());
  LS_CHECK_ARG(why.empty(), "nvfp4_decode: ", why);
  return w;
}

}  // namespace layerstream::torchglue
