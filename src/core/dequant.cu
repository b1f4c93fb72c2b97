// The fused dequantization kernel (see dequant.h for the formula): each thread reads 8 codes at once (one
// 8-byte load) and writes 8 outputs (one 16- or 32-byte store) when the rows allow it, else one code at a
// time. Conversions are the hardware's round-to-nearest-even ones, which are those of torch and of the
// host reference, so the three agree bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "layerstream/check.h"
#include "layerstream/dequant.h"

namespace layerstream {

namespace {

template <CodeType C>
__device__ __forceinline__ float decode(std::uint8_t b) {
  if constexpr (C == CodeType::kInt8) {
    return static_cast<float>(static_cast<std::int8_t>(b));
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(b, C == CodeType::kFloat8E4M3 ? __NV_E4M3 : __NV_E5M2);
    return __half2float(__half(h));
  }
}

__device__ __forceinline__ float load_real(RealType t, const void* base, std::size_t i) {
  switch (t) {
    case RealType::kFloat32: return static_cast<const float*>(base)[i];
    case RealType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

__device__ __forceinline__ float round_math(RealType t, float v) {
  switch (t) {
    case RealType::kFloat32: return v;
    case RealType::kFloat16: return __half2float(__float2half_rn(v));
    default: return __bfloat162float(__float2bfloat16_rn(v));
  }
}

template <RealType O>
struct Out;
template <>
struct Out<RealType::kFloat32> {
  using T = float;
  __device__ static T from(float v) { return v; }
};
template <>
struct Out<RealType::kFloat16> {
  using T = __half;
  __device__ static T from(float v) { return __float2half_rn(v); }
};
template <>
struct Out<RealType::kBFloat16> {
  using T = __nv_bfloat16;
  __device__ static T from(float v) { return __float2bfloat16_rn(v); }
};

struct Args {
  const std::uint8_t* codes;
  const void* scale;
  void* out;
  std::size_t cols;
  std::size_t n;
  RealType scale_type;
  RealType math;
  bool per_row;
};

// kVec: rows are whole multiples of 8 codes and both pointers are aligned for the wide accesses.
template <CodeType C, RealType O, bool kVec>
__global__ void dequant_kernel(Args a) {
  using T = typename Out<O>::T;
  T* out = static_cast<T*>(a.out);
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    for (std::size_t g = first; g * 8 < a.n; g += step) {
      const std::size_t i = g * 8;
      const float s = load_real(a.scale_type, a.scale, a.per_row ? i / a.cols : 0);
      const uint2 packed = reinterpret_cast<const uint2*>(a.codes)[g];
      const std::uint8_t* b = reinterpret_cast<const std::uint8_t*>(&packed);
      alignas(16) T v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = Out<O>::from(round_math(a.math, decode<C>(b[k]) * s));
      if constexpr (sizeof(T) == 2) {
        reinterpret_cast<uint4*>(out)[g] = *reinterpret_cast<const uint4*>(v);
      } else {
        reinterpret_cast<uint4*>(out)[2 * g] = reinterpret_cast<const uint4*>(v)[0];
        reinterpret_cast<uint4*>(out)[2 * g + 1] = reinterpret_cast<const uint4*>(v)[1];
      }
    }
  } else {
    for (std::size_t i = first; i < a.n; i += step) {
      const float s = load_real(a.scale_type, a.scale, a.per_row ? i / a.cols : 0);
      out[i] = Out<O>::from(round_math(a.math, decode<C>(a.codes[i]) * s));
    }
  }
}

template <CodeType C, RealType O>
void launch(const Args& a, bool vec, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const std::size_t items = vec ? a.n / 8 : a.n;
  const std::size_t blocks = std::min<std::size_t>((items + kThreads - 1) / kThreads, 8192);
  if (vec) {
    dequant_kernel<C, O, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  } else {
    dequant_kernel<C, O, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  }
}

template <CodeType C>
void launch_for_code(const Args& a, RealType out, bool vec, cudaStream_t stream) {
  switch (out) {
    case RealType::kFloat32: launch<C, RealType::kFloat32>(a, vec, stream); break;
    case RealType::kFloat16: launch<C, RealType::kFloat16>(a, vec, stream); break;
    case RealType::kBFloat16: launch<C, RealType::kBFloat16>(a, vec, stream); break;
  }
}

}  // namespace

void dequantize_cuda(const DequantSpec& spec, const void* codes, const void* scale, void* out, void* stream) {
  check_dequant_spec(spec);
  Args a{static_cast<const std::uint8_t*>(codes), scale, out, spec.cols, spec.rows * spec.cols,
         spec.scale, spec.math, spec.per_row};
  const bool vec = spec.cols % 8 == 0 && reinterpret_cast<std::uintptr_t>(codes) % 8 == 0 &&
                   reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (spec.code) {
    case CodeType::kFloat8E4M3: launch_for_code<CodeType::kFloat8E4M3>(a, spec.out, vec, s); break;
    case CodeType::kFloat8E5M2: launch_for_code<CodeType::kFloat8E5M2>(a, spec.out, vec, s); break;
    case CodeType::kInt8: launch_for_code<CodeType::kInt8>(a, spec.out, vec, s); break;
  }
  const cudaError_t status = cudaGetLastError();
  LS_CHECK(status == cudaSuccess, "dequantize kernel launch failed: ", cudaGetErrorName(status), " (",
           cudaGetErrorString(status), ")");
}

}  // namespace layerstream
