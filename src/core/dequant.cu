// The fused dequantization kernel (see dequant.h for the formula): each thread reads 16 codes at once (one
// 16-byte load) and writes 16 outputs (16-byte stores) when the rows and pointers allow it, else 8 codes,
// else one code at a time. Conversions are the hardware's round-to-nearest-even ones, which are those of
// torch and of the host reference, so the three agree bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda_real.cuh"
#include "layerstream/check.h"
#include "layerstream/cuda_check.h"
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

using cuda_real::load_real;
using cuda_real::Out;
using cuda_real::round_real;

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

template <int W>
struct CodeVec;  // W codes in one load
template <>
struct CodeVec<8> {
  using T = uint2;
};
template <>
struct CodeVec<16> {
  using T = uint4;
};

// W codes per thread (8 or 16: one 8- or 16-byte load, W * sizeof(T) / 16 16-byte stores), each group
// inside one row: rows are whole multiples of W codes and both pointers are aligned for the wide accesses.
// I is the index type: 32-bit whenever the tensor allows it, because the row of a group is a division, and
// a 64-bit one is several times the instructions of a 32-bit one in a kernel that should be bound by HBM.
template <CodeType C, RealType O, int W, typename I>
__global__ void dequant_wide(Args a) {
  using T = typename Out<O>::T;
  using V = typename CodeVec<W>::T;
  constexpr int kStores = W * static_cast<int>(sizeof(T)) / 16;
  const I groups = static_cast<I>(a.n / W);
  const I groups_per_row = static_cast<I>(a.cols / W);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I g = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    const V packed = __ldg(reinterpret_cast<const V*>(a.codes) + g);
    const float s = load_real(a.scale_type, a.scale, a.per_row ? g / groups_per_row : 0);
    const std::uint8_t* b = reinterpret_cast<const std::uint8_t*>(&packed);
    alignas(16) T v[W];
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = Out<O>::from(round_real(a.math, decode<C>(b[k]) * s));
    uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(a.out)) + static_cast<std::size_t>(g) * kStores;
#pragma unroll
    for (int j = 0; j < kStores; ++j) dst[j] = reinterpret_cast<const uint4*>(v)[j];
  }
}

// Any row length and alignment: one code per thread.
template <CodeType C, RealType O, typename I>
__global__ void dequant_scalar(Args a) {
  using T = typename Out<O>::T;
  T* out = static_cast<T*>(a.out);
  const I n = static_cast<I>(a.n);
  const I cols = static_cast<I>(a.cols);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const float s = load_real(a.scale_type, a.scale, a.per_row ? i / cols : 0);
    out[i] = Out<O>::from(round_real(a.math, decode<C>(a.codes[i]) * s));
  }
}

template <CodeType C, RealType O, typename I>
void launch_indexed(const Args& a, int width, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const std::size_t items = a.n / static_cast<std::size_t>(width);
  // One item per thread up to 2^16 blocks (every FLUX layer), then grid-stride.
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((items + kThreads - 1) / kThreads, 1u << 16));
  if (blocks == 0) return;
  switch (width) {
    case 16: dequant_wide<C, O, 16, I><<<blocks, kThreads, 0, stream>>>(a); break;
    case 8: dequant_wide<C, O, 8, I><<<blocks, kThreads, 0, stream>>>(a); break;
    default: dequant_scalar<C, O, I><<<blocks, kThreads, 0, stream>>>(a); break;
  }
}

template <CodeType C, RealType O>
void launch(const Args& a, int width, cudaStream_t stream) {
  // 32-bit indices while i + the grid's stride cannot wrap (the stride is at most 2^24 threads).
  if (a.n < (std::size_t{1} << 31)) {
    launch_indexed<C, O, std::uint32_t>(a, width, stream);
  } else {
    launch_indexed<C, O, std::size_t>(a, width, stream);
  }
}

template <CodeType C>
void launch_for_code(const Args& a, RealType out, int width, cudaStream_t stream) {
  switch (out) {
    case RealType::kFloat32: launch<C, RealType::kFloat32>(a, width, stream); break;
    case RealType::kFloat16: launch<C, RealType::kFloat16>(a, width, stream); break;
    case RealType::kBFloat16: launch<C, RealType::kBFloat16>(a, width, stream); break;
  }
}

}  // namespace

void dequantize_cuda(const DequantSpec& spec, const void* codes, const void* scale, void* out, void* stream) {
  check_dequant_spec(spec);
  Args a{static_cast<const std::uint8_t*>(codes), scale, out, spec.cols, spec.rows * spec.cols,
         spec.scale, spec.math, spec.per_row};
  // The widest access the rows and the pointers allow.
  const auto codes_at = reinterpret_cast<std::uintptr_t>(codes);
  const bool out_aligned = reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  const int width = out_aligned && spec.cols % 16 == 0 && codes_at % 16 == 0 ? 16
                    : out_aligned && spec.cols % 8 == 0 && codes_at % 8 == 0 ? 8
                                                                             : 1;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (spec.code) {
    case CodeType::kFloat8E4M3: launch_for_code<CodeType::kFloat8E4M3>(a, spec.out, width, s); break;
    case CodeType::kFloat8E5M2: launch_for_code<CodeType::kFloat8E5M2>(a, spec.out, width, s); break;
    case CodeType::kInt8: launch_for_code<CodeType::kInt8>(a, spec.out, width, s); break;
  }
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "dequantize kernel launch failed");
}

}  // namespace layerstream
