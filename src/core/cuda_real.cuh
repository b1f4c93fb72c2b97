// Device-side conversions of the RealType values (dequant.h) shared by the core's kernels: a load of any of
// them as float, a rounding to one (nearest even, as torch and the host reference round), and the output
// element type of each with its conversion from float. Only .cu files of the core include this.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

#include "layerstream/dequant.h"

namespace layerstream::cuda_real {

__device__ __forceinline__ float load_real(RealType t, const void* base, std::size_t i) {
  switch (t) {
    case RealType::kFloat32: return static_cast<const float*>(base)[i];
    case RealType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

__device__ __forceinline__ float round_real(RealType t, float v) {
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

}  // namespace layerstream::cuda_real
