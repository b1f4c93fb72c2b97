#include "ostris_fast.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "layerstream/check.h"
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

// ConvRot's W8A8 backends (convrot8, convrotint2..8, convrotbitnet, convrotcomfyw4a4): int8 matmuls forward,
// a dequantized weight in the training backward.
bool is_convrot_int(const std::string& backend) {
  return backend == "ConvRotInt8Quantizer" || backend == "ConvRotIntNQuantizer" || backend == "ConvRotBitNetQuantizer" ||
         backend == "ConvRotComfyW4A4Quantizer";
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
  if (is_convrot_int(f.backend)) {
    // convrot8's int8 codes, or the bitpacked (base-3 for bitnet) codes of the others, with group ratios up
    // to 7 bits; the row scales as float32 bytes.
    const bool eight = f.backend == "ConvRotInt8Quantizer";
    f.format = OstrisFast::Format::kConvrotInt;
    f.packed = pos(eight ? "cr8_qdata" : "crn_qdata");
    f.scale = pos(eight ? "cr8_scales" : "crn_scales");
    f.ratio = eight ? -1 : pos("crn_gratio");
    if (f.packed < 0 || f.scale < 0) return eight ? "buffers other than cr8_qdata/_scales" : "buffers other than crn_qdata/_scales";
    f.rot = module.attr(eight ? "cr8_rot_size" : "crn_rot_size").cast<std::int64_t>();
    f.bits = eight ? 8 : module.attr("crn_bits").cast<int>();
    f.codes = eight ? IntRowsSpec::Codes::kInt8
                    : f.backend == "ConvRotBitNetQuantizer" ? IntRowsSpec::Codes::kTernary : IntRowsSpec::Codes::kBitfield;
    if (f.codes == IntRowsSpec::Codes::kTernary && (f.ratio < 0 || f.bits != 2)) return "ternary codes without group ratios";
    if (f.bits < 2 || f.bits > 8) return std::to_string(f.bits) + " bits";
    const auto rows = module.attr("out_features").cast<std::int64_t>();
    const auto cols = module.attr("in_features").cast<std::int64_t>();
    if (f.ratio >= 0) {
      const py::object ratio = py::dict(module.attr("_buffers"))["crn_gratio"];
      const auto bytes = ratio.attr("numel")().cast<std::int64_t>();  // (a uint8 view of float32 ratios)
      const std::int64_t per_row = rows > 0 ? bytes / 4 / rows : 0;
      if (per_row <= 0 || per_row * 4 * rows != bytes || cols % per_row != 0) return "group ratios that do not divide a row";
      f.ratio_group = cols / per_row;
    }
    for (const char* name : {"rotate", "_int8_gemm_supported"}) {
      if (!helpers.contains(name)) return std::string("no ") + name + " beside its forward";
    }
    f.rotate = helpers["rotate"];
    f.int8_gemm = helpers["_int8_gemm_supported"];
    if (f.rot <= 0 || cols % f.rot != 0) return "a rotation block that does not divide a row";
    return "";
  }
  if (f.backend == "Nvfp4Quantizer" || f.backend == "ConvRotQuantizer") {
    const bool nv = f.backend == "Nvfp4Quantizer";
    f.format = nv ? OstrisFast::Format::kNvfp4 : OstrisFast::Format::kConvrot4;
    f.packed = pos(nv ? "nv4_qdata" : "cr_qdata");
    f.scale = pos(nv ? "nv4_scales" : "cr_scales");
    f.pts = pos(nv ? "nv4_pts" : "cr_pts");
    if (nv) f.pre_scale = pos("nv4_pre_scale");
    if (f.packed < 0 || f.scale < 0 || f.pts < 0) {
      return nv ? "buffers other than nv4_qdata/_scales/_pts" : "buffers other than cr_qdata/_scales/_pts";
    }
    f.group = 16;
    if (!nv) {
      f.rot = module.attr("cr_rot_size").cast<std::int64_t>();
      for (const char* name : {"rotate", "quantize_nvfp4", "dequantize_nvfp4", "_fp4_gemm_supported"}) {
        if (!helpers.contains(name)) return std::string("no ") + name + " beside its forward";
      }
      f.rotate = helpers["rotate"];
      f.quantize = helpers["quantize_nvfp4"];
      f.dequantize = helpers["dequantize_nvfp4"];
      f.fp4_gemm = helpers["_fp4_gemm_supported"];
      if (f.rot <= 0 || module.attr("in_features").cast<std::int64_t>() % f.rot != 0) return "a rotation block that does not divide a row";
    }
  } else if (f.backend == "UIntXQuantizer") {
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

at::Tensor over_storage(const at::Tensor& t) {
  if (!t.defined()) return t;
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

OstrisFast recognise_ostris(const py::object& module, const std::vector<std::string>& names) {
  OstrisFast f;
  const py::object q = py::getattr(module, "ostris_quantizer", py::none());
  if (q.is_none()) return f;
  const py::handle cls = py::type::handle_of(q);
  f.backend = py::str(cls.attr("__name__"));
  const std::string where = py::str(cls.attr("__module__"));
  const bool known = (f.backend == "UIntXQuantizer" && ends_with(where, "uintx_quant")) ||
                     (f.backend == "OrbitQuantizer" && ends_with(where, "orbit_quant")) ||
                     (f.backend == "OrbitVQQuantizer" && ends_with(where, "orbit_vq_quant")) ||
                     (f.backend == "Nvfp4Quantizer" && ends_with(where, "nvfp4_quant")) ||
                     ((f.backend == "ConvRotQuantizer" || is_convrot_int(f.backend)) && ends_with(where, "convrot_quant"));
  if (!known) {
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

std::string decode_nvfp4_into(const OstrisFast& f, const std::vector<at::Tensor>& staged, at::Tensor& w, RealType out,
                              [[maybe_unused]] bool on_cuda) {
  const at::Tensor& packed = staged[static_cast<std::size_t>(f.packed)];
  const at::Tensor& scales = staged[static_cast<std::size_t>(f.scale)];
  const at::Tensor& pts = staged[static_cast<std::size_t>(f.pts)];
  const Nvfp4Spec spec{static_cast<std::size_t>(w.size(0)), static_cast<std::size_t>(w.size(1)), out};
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

// Whether torch's float32 -> float8_e4m3fn conversion on `device` saturates from 464 up (recent releases) or
// gives NaN (older ones); nullopt when it does neither, so the decoder is not the backend's. Asked once per
// device (callers hold the GIL, which guards the cache).
std::optional<bool> e4m3_saturates(const at::Device& device) {
  static std::map<std::pair<int, int>, std::optional<bool>> known;
  const std::pair<int, int> key{static_cast<int>(device.type()), device.index()};
  if (auto it = known.find(key); it != known.end()) return it->second;
  const at::Tensor probe = at::tensor(std::vector<float>{500.0f, 470.0f, 448.0f}).to(device);
  const at::Tensor codes = probe.to(at::kFloat8_e4m3fn).view(at::kByte).cpu();
  const auto* c = codes.data_ptr<std::uint8_t>();
  std::optional<bool> answer;
  if (c[2] == 0x7e && c[0] == 0x7e && c[1] == 0x7e) answer = true;
  if (c[2] == 0x7e && c[0] == 0x7f && c[1] == 0x7f) answer = false;
  return known[key] = answer;
}

// convrot4's straight-through activation of `x` (detached, contiguous, [rows, cols]): the tensor scale the
// backend computes from amax |x| (with torch's own operations, so the same float), and delta = x_dq - x.
struct Activation {
  at::Tensor pts, delta;
};

Activation fake_quantize(const at::Tensor& x, bool saturates, [[maybe_unused]] bool on_cuda) {
  const auto [lo, hi] = at::aminmax(x);
  at::Tensor pts = at::div(at::maximum(lo.neg(), hi).to(at::kFloat), 6.0 * 448.0);
  pts = at::where(pts > 0, pts, at::ones_like(pts));
  at::Tensor delta = at::empty_like(x);
  const FakeQuantSpec spec{static_cast<std::size_t>(x.size(0)), static_cast<std::size_t>(x.size(1)),
                           *real_type_of(x.scalar_type()), saturates};
#ifdef LAYERSTREAM_TORCH_CUDA
  if (on_cuda) {
    fake_quant_nvfp4_cuda(spec, x.data_ptr(), pts.data_ptr<float>(), delta.data_ptr(), stream_of(x));
    return {pts, delta};
  }
#endif
  fake_quant_nvfp4_host(spec, x.data_ptr(), pts.data_ptr<float>(), delta.data_ptr());
  return {pts, delta};
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::ScalarType as = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kByte;
  return at::equal(a.contiguous().view(as), b.contiguous().view(as));
}

// A probe of the activation quantization's corners: magnitudes from 2^-30 to 2^10 in blocks of their own
// (so block scales of every e4m3 exponent, denormal ones included), values of three significant bits (so that
// x / scale lands exactly on the e2m1 edges), zeros of both signs, whole blocks of zeros; `top` is the
// largest magnitude (the tensor scale's source).
at::Tensor activation_probe(const at::TensorOptions& options, float top) {
  constexpr int kRows = 64, kCols = 64;
  std::vector<float> v(kRows * kCols);
  std::uint32_t seed = 12345;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (int b = 0; b < kRows * kCols / 16; ++b) {
    const int e = -30 + (b * 7) % 41;
    for (int k = 0; k < 16; ++k) {
      const std::uint32_t r = next() >> 8;
      float x = std::ldexp(1.0f + static_cast<float>(r % 8) / 8.0f, e - static_cast<int>((r >> 3) % 4));
      if ((r >> 5) % 7 == 0) x = 0.0f;
      if (b % 23 == 5) x = 0.0f;
      v[static_cast<std::size_t>(b * 16 + k)] = ((r >> 8) & 1) ? -x : x;
    }
  }
  v[0] = top;
  return at::tensor(v).view({kRows, kCols}).to(options);
}

// The proof of convrot4's activation, once per input type: on this call's input and on the probes, the
// kernel's delta and tensor scale are bit for bit those of the backend's own quantize_nvfp4 and
// dequantize_nvfp4; why not, or "".
std::string activation_differs(const OstrisFast& f, const at::Tensor& x, const Activation& got, bool saturates,
                               bool on_cuda) {
  try {
    const py::object dtype = py::cast(x).attr("dtype");
    for (int i = 0; i < 3; ++i) {
      const at::Tensor input = i == 0 ? x : activation_probe(x.options(), i == 1 ? 2688.0f : 937.0f);
      const Activation mine = i == 0 ? got : fake_quantize(input, saturates, on_cuda);
      const py::tuple q = f.quantize(input);
      const at::Tensor x_dq = f.dequantize(q[0], q[1], q[2], input.size(0), input.size(1), dtype).cast<at::Tensor>();
      if (!same_bits(mine.pts, q[2].cast<at::Tensor>().reshape({})) || !same_bits(mine.delta, at::sub(x_dq, input))) {
        return "its activation quantized by layerstream differed from its own quantize_nvfp4";
      }
    }
  } catch (py::error_already_set& e) {
    return std::string("its own quantize_nvfp4 could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

// The proof, once per input type: `w` against the backend's own dequantization of the same staged buffers
// (swapped into the layer); why they are not the same, or "".
std::string differs_from_backend(const py::object& module, const OstrisFast& f, const at::Tensor& w, const py::object& x) {
  try {
    const py::object q = module.attr("ostris_quantizer");
    const py::object dtype = x.attr("dtype");
    py::object want;
    switch (f.format) {
      case OstrisFast::Format::kUintx: want = q.attr("_dequantize_native")(module).attr("to")(dtype); break;
      case OstrisFast::Format::kNvfp4: want = q.attr("_dequantize_weight")(module, dtype); break;
      default: want = q.attr("_dequantize_rotated")(module, dtype); break;  // codebook, convrot4
    }
    if (!at::equal(w, want.cast<at::Tensor>())) return "its weight decoded by layerstream differed from its own dequantization";
  } catch (py::error_already_set& e) {
    return std::string("its own dequantization could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

// convrot4 without fp4 matmuls, as its own forward computes it: the rotated input; in training (x requires
// grad, in both passes of checkpointing) the straight-through activation x2d + (x_dq - x2d), with delta =
// x_dq - x2d from the kernel (proved once per input type); then F.linear with the decoded rotated weight.
std::optional<py::object> convrot4_forward(OstrisFast& fast, const py::object& x, const at::Tensor& xt,
                                           const at::Tensor& w, const at::Tensor& b, std::int64_t rows,
                                           std::int64_t cols, bool on_cuda) {
  const at::Tensor x2d = fast.rotate(x, fast.rot).attr("reshape")(-1, cols).cast<at::Tensor>();
  at::Tensor input = x2d;
  if (xt.requires_grad()) {
    const std::optional<bool> saturates = e4m3_saturates(xt.device());
    if (!saturates) {
      fast.refused = true;
      own_forward(fast.backend, "torch's float8_e4m3fn conversion is not one layerstream knows");
      return std::nullopt;
    }
    at::Tensor xd = x2d.detach();
    if (!xd.is_contiguous() || reinterpret_cast<std::uintptr_t>(xd.data_ptr()) % 16 != 0) xd = xd.clone();
    const Activation a = fake_quantize(xd, *saturates, on_cuda);
    const c10::ScalarType dtype = xt.scalar_type();
    if (std::find(fast.proven_activation.begin(), fast.proven_activation.end(), dtype) == fast.proven_activation.end()) {
      const std::string why = activation_differs(fast, xd, a, *saturates, on_cuda);
      if (!why.empty()) {
        fast.refused = true;
        own_forward(fast.backend, why);
        return std::nullopt;
      }
      fast.proven_activation.push_back(dtype);
    }
    input = at::add(x2d, a.delta);
  }
  std::vector<std::int64_t> shape = xt.sizes().vec();
  shape.back() = rows;
  return py::cast(at::linear(input, w, b).reshape(shape));
}

// The convrot int weight of the staged buffers (ostris_decode.h), in `type`, on their device.
IntRowsSpec int_rows_spec(const OstrisFast& f, std::int64_t rows, std::int64_t cols, RealType out) {
  return IntRowsSpec{static_cast<std::size_t>(rows), static_cast<std::size_t>(cols), f.codes, f.bits,
                     static_cast<std::size_t>(f.ratio_group), out};
}

at::Tensor decode_int_rows(const IntRowsSpec& spec, const at::Tensor& packed, const at::Tensor& ratio,
                           const at::Tensor& scale, c10::ScalarType type) {
  at::Tensor w = at::empty({static_cast<std::int64_t>(spec.rows), static_cast<std::int64_t>(spec.cols)},
                           packed.options().dtype(type));
  const auto* p = static_cast<const std::uint8_t*>(packed.data_ptr());
  const auto* r = ratio.defined() ? static_cast<const float*>(ratio.data_ptr()) : nullptr;
  const auto* sc = static_cast<const float*>(scale.data_ptr());
#ifdef LAYERSTREAM_TORCH_CUDA
  if (packed.is_cuda()) {
    decode_int_rows_cuda(spec, p, r, sc, w.data_ptr(), stream_of(packed));
    return w;
  }
#endif
  decode_int_rows_host(spec, p, r, sc, w.data_ptr());
  return w;
}

// What a convrot int training call needs beyond its input: the backend's own straight-through linear for the
// forward value, and the staged codes the backward decodes.
struct IntCall {
  py::object linear_ste;  // the backend's bound _linear_ste
  py::object module;
  py::object out_dtype;   // its name ("bfloat16"), as the backend passes it
  at::Tensor packed, ratio, scale;
  IntRowsSpec spec;
};

// The backend's training linear with the backward done here: the forward is its own custom op (rotated
// input -> int8 activation -> torch._int_mm -> its epilogue, run without a graph), and the backward is its
// straight-through `grad @ (code8 * scale)` with that weight decoded from the codes in one kernel instead of
// its unpack, cast and multiply (three passes over the weight, the middle one twice its size). The codes are
// saved as the backend saves them; what the ring region held of them is copied out when the call ends
// (StreamedLayer::with_staged_tensors).
struct IntSteFn : public torch::autograd::Function<IntSteFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x2d, const IntCall& call) {
    at::Tensor out = call.linear_ste(call.module, x2d, call.out_dtype).cast<at::Tensor>();
    ctx->save_for_backward({call.packed, call.ratio, call.scale});
    const IntRowsSpec& s = call.spec;
    ctx->saved_data["spec"] = std::vector<std::int64_t>{
        static_cast<std::int64_t>(s.rows), static_cast<std::int64_t>(s.cols), static_cast<std::int64_t>(s.codes),
        s.bits, static_cast<std::int64_t>(s.group)};
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::vector<std::int64_t> v = ctx->saved_data["spec"].toIntVector();
    const at::Tensor& g = grads[0];
    const auto type = real_type_of(g.scalar_type());
    LS_CHECK(type.has_value(), "convrot int backward: a gradient of type ", g.scalar_type());
    const IntRowsSpec spec{static_cast<std::size_t>(v[0]), static_cast<std::size_t>(v[1]),
                           static_cast<IntRowsSpec::Codes>(v[2]), static_cast<int>(v[3]),
                           static_cast<std::size_t>(v[4]), *type};
    const at::Tensor w = decode_int_rows(spec, saved[0], saved[1], saved[2], g.scalar_type());
    return {at::matmul(g, w), at::Tensor()};
  }
};

// Deterministic probe values in [-2, 2) (no draw from torch's generators: the run's randomness stays stock's).
at::Tensor int_probe(std::int64_t rows, std::int64_t cols, std::uint32_t seed, const at::TensorOptions& options) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / static_cast<float>(1u << 22) - 2.0f;
  }
  return at::tensor(v).view({rows, cols}).to(options);
}

// The proof, once per input type, with the staged buffers swapped into the layer: the decoded weight equals
// the backend's own `_qdata(module).to(t) * _scales(module).to(t)[:, None]` (what its backward builds), and a
// gradient through its own training linear on a probe is `probe_grad @ w`, bit for bit; why not, or "".
std::string int_rows_differ(const py::object& module, const IntCall& call, const at::Tensor& w) {
  try {
    const py::object q = module.attr("ostris_quantizer");
    const c10::ScalarType t = w.scalar_type();
    const at::Tensor codes = q.attr("_qdata")(module).cast<at::Tensor>();
    const at::Tensor scales = q.attr("_scales")(module).cast<at::Tensor>();
    if (!same_bits(w, at::mul(codes.to(t), scales.to(t).unsqueeze(1)))) {
      return "its weight decoded by layerstream differed from its own unpacked codes times scales";
    }
    const at::Tensor xp = int_probe(32, w.size(1), 7, w.options()).requires_grad_(true);
    const at::Tensor gp = int_probe(32, w.size(0), 11, w.options());
    // The probe's graph is its own: saved tensors stay in it (identity hooks over any of checkpointing's, whose
    // unpack would recompute the checkpointed region, this layer included, and whose count of saved tensors
    // must stay that of the model's own forward), and it is built with grad mode on (a first reentrant
    // checkpointing pass runs without).
    const py::cpp_function same([](py::object t) { return t; });
    py::object hooks = py::module_::import("torch.autograd.graph").attr("saved_tensors_hooks")(same, same);
    hooks.attr("__enter__")();
    at::Tensor theirs;
    try {
      const at::AutoGradMode enable(true);
      const py::object out = call.linear_ste(module, xp, call.out_dtype);
      theirs = py::module_::import("torch.autograd").attr("grad")(out, xp, gp).cast<py::tuple>()[0].cast<at::Tensor>();
    } catch (...) {
      hooks.attr("__exit__")(py::none(), py::none(), py::none());
      throw;
    }
    hooks.attr("__exit__")(py::none(), py::none(), py::none());
    if (!same_bits(theirs, at::matmul(gp, w))) {
      return "its own training backward is not the gradient times its decoded weight";
    }
  } catch (py::error_already_set& e) {
    return std::string("its own unpack or training linear could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

// A convrot int layer's training call (its input requires grad, in both passes of checkpointing, where the
// device has int8 matmuls): the backend's own rotation and forward, layerstream's backward (IntSteFn).
// Anything else (inference, sampling, no int8 matmul) is its own forward.
std::optional<py::object> convrot_int_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& x,
                                              const at::Tensor& xt, std::int64_t rows, std::int64_t cols,
                                              bool on_cuda) {
  if (!xt.requires_grad() || xt.numel() == 0) return std::nullopt;
  if (!fast.int8_gemm(x.attr("device")).cast<bool>()) {
    own_forward(fast.backend, "no int8 matmul on this device: its fake-quantized fallback runs");
    return std::nullopt;
  }
  const c10::ScalarType dtype = xt.scalar_type();
  // (Tensors of their own over the staged storages: see over_storage.)
  IntCall call{module.attr("ostris_quantizer").attr("_linear_ste"), module,
               py::str(x.attr("dtype")).attr("split")(".")[py::int_(-1)],
               over_storage(staged[static_cast<std::size_t>(fast.packed)]),
               fast.ratio >= 0 ? over_storage(staged[static_cast<std::size_t>(fast.ratio)]) : at::Tensor(),
               over_storage(staged[static_cast<std::size_t>(fast.scale)]), int_rows_spec(fast, rows, cols, *real_type_of(dtype))};
  auto bytes_ok = [&](const at::Tensor& t, std::size_t n, std::uintptr_t align) {
    return t.defined() && t.is_contiguous() && t.element_size() == 1 && t.nbytes() == n &&
           (!on_cuda || reinterpret_cast<std::uintptr_t>(t.data_ptr()) % align == 0);
  };
  std::string why;
  if (!bytes_ok(call.packed, int_rows_packed_bytes(call.spec), fast.codes == IntRowsSpec::Codes::kInt8 ? 8 : 1) ||
      !bytes_ok(call.scale, static_cast<std::size_t>(rows) * 4, 4) ||
      (fast.ratio >= 0 && !bytes_ok(call.ratio, static_cast<std::size_t>(rows * (cols / fast.ratio_group)) * 4, 4))) {
    why = "buffers whose sizes are not its format's for this layer";
  } else if (on_cuda && (cols % 8 != 0 || (fast.ratio_group != 0 && fast.ratio_group % 8 != 0))) {
    why = "rows or groups that are not multiples of 8 values (the device kernel takes eight at a time)";
  }
  try {
    if (why.empty()) check_int_rows_spec(call.spec);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty() && std::find(fast.proven.begin(), fast.proven.end(), dtype) == fast.proven.end()) {
    why = int_rows_differ(module, call, decode_int_rows(call.spec, call.packed, call.ratio, call.scale, dtype));
    if (why.empty()) fast.proven.push_back(dtype);
  }
  if (!why.empty()) {
    fast.refused = true;
    own_forward(fast.backend, why);
    return std::nullopt;
  }
  const at::Tensor x2d = fast.rotate(x, fast.rot).attr("reshape")(-1, cols).cast<at::Tensor>();
  std::vector<std::int64_t> shape = xt.sizes().vec();
  shape.back() = rows;
  return py::cast(IntSteFn::apply(x2d, call).reshape(shape));
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
  if (fast.format == OstrisFast::Format::kConvrotInt) {
    return convrot_int_forward(module, fast, staged, x, xt, rows, cols, decoded_on_cuda);
  }
  const bool convrot = fast.format == OstrisFast::Format::kConvrot4;
  if (convrot && (xt.numel() == 0 || fast.fp4_gemm(x.attr("device")).cast<bool>())) {
    // Where the GPU has fp4 matmuls the backend's own forward uses them (nothing of it to decode here).
    if (xt.numel() != 0) own_forward(fast.backend, "the GPU has fp4 matmuls, which its own forward uses");
    return std::nullopt;
  }
  std::string why;
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() ||
      !staged[static_cast<std::size_t>(fast.scale)].is_contiguous()) {
    why = "packed codes that are not contiguous bytes";
  } else if (decoded_on_cuda && (cols % 8 != 0 || fast.group % 8 != 0)) {
    why = "rows or groups that are not multiples of 8 values (the device kernels take eight at a time)";
  }
  at::Tensor w = at::empty({rows, cols}, packed.options().dtype(xt.scalar_type()));
  if (why.empty()) {
    switch (fast.format) {
      case OstrisFast::Format::kUintx: why = decode_uintx_into(fast, staged, w, *out_type, decoded_on_cuda); break;
      case OstrisFast::Format::kCodebook: why = decode_codebook_into(fast, staged, w, *out_type, x, decoded_on_cuda); break;
      default: why = decode_nvfp4_into(fast, staged, w, *out_type, decoded_on_cuda); break;
    }
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
  if (fast.format == OstrisFast::Format::kNvfp4) {
    // The backend's AWQ input scale, as it applies it: x * pre_scale (its float32 bytes) in x's type.
    at::Tensor xin = xt;
    if (fast.pre_scale >= 0) {
      const at::Tensor& pre = staged[static_cast<std::size_t>(fast.pre_scale)];
      if (pre.scalar_type() != at::kByte || !pre.is_contiguous() || pre.numel() != cols * 4 ||
          reinterpret_cast<std::uintptr_t>(pre.data_ptr()) % 4 != 0) {
        fast.refused = true;
        own_forward(fast.backend, "an input scale that is not float32 bytes of one value per input");
        return std::nullopt;
      }
      xin = at::mul(xt, pre.view(at::kFloat).to(xt.scalar_type()));
    }
    return py::cast(at::linear(xin, w, b));
  }
  if (convrot) return convrot4_forward(fast, x, xt, w, b, rows, cols, decoded_on_cuda);
  const py::object x_rot = fast.rotate(x, over_storage(staged[static_cast<std::size_t>(fast.perm)]),
                                       over_storage(staged[static_cast<std::size_t>(fast.signs)]), fast.block);
  return py::cast(at::linear(x_rot.cast<at::Tensor>(), w, b));
}

std::pair<at::Tensor, at::Tensor> nvfp4_fake_quantize(const at::Tensor& x) {
  LS_CHECK_ARG(x.dim() == 2 && x.size(1) % 16 == 0 && real_type_of(x.scalar_type()),
               "nvfp4_fake_quantize takes a float32, float16 or bfloat16 [rows, cols] tensor, cols a multiple of 16");
  const std::optional<bool> sat = e4m3_saturates(x.device());
  LS_CHECK(sat.has_value(), "torch's float8_e4m3fn conversion on ", x.device(), " is not one layerstream knows");
  const at::Tensor xd = x.detach().contiguous().clone();
  const Activation a = fake_quantize(xd, *sat, x.is_cuda());
  return {a.pts, a.delta};
}

at::Tensor nvfp4_decode(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& pts, std::int64_t rows,
                        std::int64_t cols, c10::ScalarType out) {
  const auto type = real_type_of(out);
  LS_CHECK_ARG(type && rows > 0 && cols > 0, "nvfp4_decode: a float32, float16 or bfloat16 output of rows x cols");
  OstrisFast f;
  f.packed = 0, f.scale = 1, f.pts = 2;
  at::Tensor w = at::empty({rows, cols}, packed.options().dtype(out));
  const std::string why = decode_nvfp4_into(f, {packed.contiguous(), scales.contiguous(), pts.contiguous()}, w, *type,
                                            packed.is_cuda());
  LS_CHECK_ARG(why.empty(), "nvfp4_decode: ", why);
  return w;
}

at::Tensor int_rows_decode(const at::Tensor& packed, const std::optional<at::Tensor>& ratio, const at::Tensor& scales,
                           std::int64_t rows, std::int64_t cols, const std::string& codes, int bits, c10::ScalarType out) {
  const auto type = real_type_of(out);
  LS_CHECK_ARG(type && rows > 0 && cols > 0, "int_rows_decode: a float32, float16 or bfloat16 output of rows x cols");
  LS_CHECK_ARG(codes == "int8" || codes == "bitfield" || codes == "ternary",
               "int_rows_decode: codes are 'int8', 'bitfield' or 'ternary', not '", codes, "'");
  const at::Tensor p = packed.contiguous(), s = scales.contiguous();
  const at::Tensor r = ratio ? ratio->contiguous() : at::Tensor();
  const IntRowsSpec spec{static_cast<std::size_t>(rows), static_cast<std::size_t>(cols),
                         codes == "int8" ? IntRowsSpec::Codes::kInt8
                         : codes == "bitfield" ? IntRowsSpec::Codes::kBitfield : IntRowsSpec::Codes::kTernary,
                         bits, r.defined() ? static_cast<std::size_t>(cols / std::max<std::int64_t>(1, r.nbytes() / 4 / rows)) : 0,
                         *type};
  check_int_rows_spec(spec);
  LS_CHECK_ARG(p.element_size() == 1 && p.nbytes() == int_rows_packed_bytes(spec) && s.nbytes() == spec.rows * 4 &&
                   (!r.defined() || r.nbytes() == spec.rows * (spec.cols / spec.group) * 4),
               "int_rows_decode: codes, row scales (float32) or ratios (float32 per row and group) of the wrong size");
  return decode_int_rows(spec, p, r, s, out);
}

}  // namespace layerstream::torchglue
