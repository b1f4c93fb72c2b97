// convrot4 where the GPU has no fp4 matmul (see ostris_fast.h): its training activation quantized to nvfp4 and
// back by one kernel (proved against the backend's own quantize_nvfp4/dequantize_nvfp4), then F.linear with the
// weight decoded in ostris_fast.cc.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/ostris_decode.h"
#include "ostris_fast.h"
#include "ostris_internal.h"
#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace ostris_detail {

namespace {

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
      const py::tuple q = f.hooks.quantize(input);
      const at::Tensor x_dq = f.hooks.dequantize(q[0], q[1], q[2], input.size(0), input.size(1), dtype).cast<at::Tensor>();
      if (!same_bits(mine.pts, q[2].cast<at::Tensor>().reshape({})) || !same_bits(mine.delta, at::sub(x_dq, input))) {
        return "its activation quantized by layerstream differed from its own quantize_nvfp4";
      }
    }
  } catch (py::error_already_set& e) {
    return std::string("its own quantize_nvfp4 could not be called to check layerstream's: ") + e.what();
  }
  return "";
}

}  // namespace

// convrot4 without fp4 matmuls, as its own forward computes it: the rotated input; in training (x requires
// grad, in both passes of checkpointing) the straight-through activation x2d + (x_dq - x2d), with delta =
// x_dq - x2d from the kernel (proved once per input type); then F.linear with the decoded rotated weight.
std::optional<py::object> convrot4_forward(OstrisFast& fast, const py::object& x, const at::Tensor& xt,
                                           const at::Tensor& w, const at::Tensor& b, std::int64_t rows,
                                           std::int64_t cols, bool on_cuda) {
  const at::Tensor x2d = fast.hooks.rotate(x, fast.shape.rot).attr("reshape")(-1, cols).cast<at::Tensor>();
  at::Tensor input = x2d;
  if (xt.requires_grad()) {
    const std::optional<bool> saturates = e4m3_saturates(xt.device());
    if (!saturates) {
      fast.proof.refused = true;
      own_forward(fast.backend, "torch's float8_e4m3fn conversion is not one layerstream knows");
      return std::nullopt;
    }
    at::Tensor xd = x2d.detach();
    if (!xd.is_contiguous() || reinterpret_cast<std::uintptr_t>(xd.data_ptr()) % 16 != 0) xd = xd.clone();
    const Activation a = fake_quantize(xd, *saturates, on_cuda);
    const c10::ScalarType dtype = xt.scalar_type();
    if (std::find(fast.proof.proven_activation.begin(), fast.proof.proven_activation.end(), dtype) == fast.proof.proven_activation.end()) {
      const std::string why = activation_differs(fast, xd, a, *saturates, on_cuda);
      if (!why.empty()) {
        fast.proof.refused = true;
        own_forward(fast.backend, why);
        return std::nullopt;
      }
      fast.proof.proven_activation.push_back(dtype);
    }
    input = at::add(x2d, a.delta);
  }
  std::vector<std::int64_t> shape = xt.sizes().vec();
  shape.back() = rows;
  return py::cast(at::linear(input, w, b).reshape(shape));
}

}  // namespace ostris_detail

std::pair<at::Tensor, at::Tensor> nvfp4_fake_quantize(const at::Tensor& x) {
  LS_CHECK_ARG(x.dim() == 2 && x.size(1) % 16 == 0 && real_type_of(x.scalar_type()),
               "nvfp4_fake_quantize takes a float32, float16 or bfloat16 [rows, cols] tensor, cols a multiple of 16");
  const std::optional<bool> sat = ostris_detail::e4m3_saturates(x.device());
  LS_CHECK(sat.has_value(), "torch's float8_e4m3fn conversion on ", x.device(), " is not one layerstream knows");
  const at::Tensor xd = x.detach().contiguous().clone();
  const ostris_detail::Activation a = ostris_detail::fake_quantize(xd, *sat, x.is_cuda());
  return {a.pts, a.delta};
}

}  // namespace layerstream::torchglue
