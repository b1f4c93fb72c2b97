// The ConvRot backends whose forward is an int8 matmul (convrot8, convrotint2..8, convrotbitnet,
// convrotcomfyw4a4; see ostris_fast.h): their training call with layerstream's backward, and the decoder of the
// weight that backward multiplies by.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/ostris_decode.h"
#include "ostris_fast.h"
#include "ostris_internal.h"
#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace ostris_detail {

namespace {

// The convrot int weight of the staged buffers (ostris_decode.h), in `type`, on their device.
IntRowsSpec int_rows_spec(const OstrisFast& f, std::int64_t rows, std::int64_t cols, RealType out) {
  return IntRowsSpec{static_cast<std::size_t>(rows), static_cast<std::size_t>(cols), f.shape.codes, f.shape.bits,
                     static_cast<std::size_t>(f.shape.ratio_group), out};
}

// Whether the codes, row scales (float32) and group ratios (float32 per row and group; none where spec.group is
// 0) have the byte sizes of `spec`: the forward's, the backward's and the test hook's check.
bool int_rows_sizes_match(const IntRowsSpec& s, const at::Tensor& packed, const at::Tensor& ratio,
                          const at::Tensor& scale) {
  const bool ratios = s.group == 0 ? !ratio.defined() : ratio.defined() && ratio.nbytes() == s.rows * (s.cols / s.group) * 4;
  return ratios && packed.defined() && scale.defined() && packed.nbytes() == int_rows_packed_bytes(s) &&
         scale.nbytes() == s.rows * 4;
}

// The name the backend passes its op for an input type (real_type_of says it is one of these).
const char* dtype_name(c10::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "float32";
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
// (StreamedLayer::with_staged_tensors). The forward holds the GIL (it calls the backend); the backward runs on
// autograd's threads without it and touches nothing of Python.
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
    // What the forward saved, as the decoder reads it (contiguous, aligned): a saved-tensor hook may have given
    // back other memory, or a view of it.
    auto usable = [](const at::Tensor& t, std::uintptr_t align) {
      if (!t.defined() || (t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % align == 0)) return t;
      return t.contiguous().clone();
    };
    const at::Tensor packed = usable(saved[0], 8), ratio = usable(saved[1], 4), scale = usable(saved[2], 4);
    LS_CHECK(int_rows_sizes_match(spec, packed, ratio, scale),
             "convrot int backward: the codes saved by its forward came back with other sizes (a saved-tensor hook "
             "that changes what it is given?)");
    const at::Tensor w = decode_int_rows(spec, packed, ratio, scale, g.scalar_type());
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
  } catch (const std::exception& e) {  // py::error_already_set, py::cast_error, c10::Error
    return std::string("its own unpack or training linear could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

}  // namespace

// A convrot int layer's training call (its input requires grad, in both passes of checkpointing, where the
// device has int8 matmuls): the backend's own rotation and forward, layerstream's backward (IntSteFn).
// Anything else (inference, sampling, no int8 matmul) is its own forward.
std::optional<py::object> convrot_int_forward(const py::object& module, OstrisFast& fast,
                                              const std::vector<at::Tensor>& staged, const py::object& x,
                                              const at::Tensor& xt, std::int64_t rows, std::int64_t cols,
                                              bool on_cuda) {
  if (!xt.requires_grad() || xt.numel() == 0) return std::nullopt;
  // The backend's answer for the layer's device, asked once (it looks at the device's capability).
  if (fast.proof.int8_gemm_device != xt.device().index()) {
    fast.proof.int8_gemm_here = fast.hooks.int8_gemm(x.attr("device")).cast<bool>();
    fast.proof.int8_gemm_device = xt.device().index();
  }
  if (!fast.proof.int8_gemm_here) {
    own_forward(fast.backend, "no int8 matmul on this device: its fake-quantized fallback runs");
    return std::nullopt;
  }
  const c10::ScalarType dtype = xt.scalar_type();
  IntCall call{module.attr("ostris_quantizer").attr("_linear_ste"), module, py::str(dtype_name(dtype)),
               staged[static_cast<std::size_t>(fast.slot.packed)],
               fast.slot.ratio >= 0 ? staged[static_cast<std::size_t>(fast.slot.ratio)] : at::Tensor(),
               staged[static_cast<std::size_t>(fast.slot.scale)], int_rows_spec(fast, rows, cols, *real_type_of(dtype))};
  // Bytes, contiguous, aligned as the device kernel reads them (undefined: no ratios, which the sizes check).
  auto layout_ok = [&](const at::Tensor& t, std::uintptr_t align) {
    return !t.defined() || (t.is_contiguous() && t.element_size() == 1 &&
                            (!on_cuda || reinterpret_cast<std::uintptr_t>(t.data_ptr()) % align == 0));
  };
  std::string why;
  if (!int_rows_sizes_match(call.spec, call.packed, call.ratio, call.scale) ||
      !layout_ok(call.packed, fast.shape.codes == IntRowsSpec::Codes::kInt8 ? 8 : 1) || !layout_ok(call.scale, 4) ||
      !layout_ok(call.ratio, 4)) {
    why = "buffers whose sizes are not its format's for this layer";
  } else if (on_cuda && (cols % 8 != 0 || (fast.shape.ratio_group != 0 && fast.shape.ratio_group % 8 != 0))) {
    why = "rows or groups that are not multiples of 8 values (the device kernel takes eight at a time)";
  }
  try {
    if (why.empty()) check_int_rows_spec(call.spec);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty() && std::find(fast.proof.proven.begin(), fast.proof.proven.end(), dtype) == fast.proof.proven.end()) {
    why = int_rows_differ(module, call, decode_int_rows(call.spec, call.packed, call.ratio, call.scale, dtype));
    if (why.empty()) fast.proof.proven.push_back(dtype);
  }
  if (!why.empty()) {
    fast.proof.refused = true;
    own_forward(fast.backend, why);
    return std::nullopt;
  }
  const at::Tensor x2d = fast.hooks.rotate(x, fast.shape.rot).attr("reshape")(-1, cols).cast<at::Tensor>();
  std::vector<std::int64_t> shape = xt.sizes().vec();
  shape.back() = rows;
  return py::cast(IntSteFn::apply(x2d, call).reshape(shape));
}

}  // namespace ostris_detail

at::Tensor int_rows_decode(const at::Tensor& packed, const std::optional<at::Tensor>& ratio, const at::Tensor& scales,
                           std::int64_t rows, std::int64_t cols, const std::string& codes, int bits, c10::ScalarType out) {
  const auto type = real_type_of(out);
  LS_CHECK_ARG(type && rows > 0 && cols > 0, "int_rows_decode: a float32, float16 or bfloat16 output of rows x cols");
  LS_CHECK_ARG(codes == "int8" || codes == "bitfield" || codes == "ternary",
               "int_rows_decode: codes are 'int8', 'bitfield' or 'ternary', not '", codes, "'");
  const at::Tensor p = packed.contiguous(), s = scales.contiguous();
  const at::Tensor r = ratio ? ratio->contiguous() : at::Tensor();
  const std::int64_t per_row = r.defined() ? static_cast<std::int64_t>(r.nbytes() / 4) / rows : 0;
  LS_CHECK_ARG(!r.defined() || (per_row > 0 && cols % per_row == 0 && per_row * rows * 4 == static_cast<std::int64_t>(r.nbytes())),
               "int_rows_decode: ", r.defined() ? r.nbytes() / 4 : 0, " float32 ratios do not make whole groups of the ",
               rows, " x ", cols, " rows");
  const IntRowsSpec spec{static_cast<std::size_t>(rows), static_cast<std::size_t>(cols),
                         codes == "int8" ? IntRowsSpec::Codes::kInt8
                         : codes == "bitfield" ? IntRowsSpec::Codes::kBitfield : IntRowsSpec::Codes::kTernary,
                         bits, r.defined() ? static_cast<std::size_t>(cols / per_row) : 0,
                         *type};
  check_int_rows_spec(spec);
  LS_CHECK_ARG(p.element_size() == 1 && ostris_detail::int_rows_sizes_match(spec, p, r, s),
               "int_rows_decode: codes, row scales (float32) or ratios (float32 per row and group) of the wrong size");
  return ostris_detail::decode_int_rows(spec, p, r, s, out);
}

}  // namespace layerstream::torchglue
