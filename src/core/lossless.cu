// The lossless bfloat16 decoder on the device (see lossless.h): one kernel rebuilds every value from its
// low byte and its exponent code (eight values per thread: an 8-byte and a 4-byte load, one 16-byte
// store), a second, ordered after it on the same stream, writes the listed exceptions over the values the
// first gave the mark's exponent. Bound by HBM: 1.5 bytes read and 2 written per value.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "layerstream/check.h"
#include "layerstream/lossless.h"

namespace layerstream {

namespace {

struct Args {
  const std::uint8_t* low;
  const std::uint8_t* codes;
  std::uint16_t* out;
  std::size_t count;
  std::uint8_t table[16];
};

__device__ __forceinline__ std::uint16_t rebuild(unsigned low, unsigned exponent) {
  return static_cast<std::uint16_t>(((low & 0x80u) << 8) | (exponent << 7) | (low & 0x7Fu));
}

// Eight values per thread; kWide: the pointers allow the 8-, 4- and 16-byte accesses (a last group of
// fewer than eight values goes one value at a time either way). I: 32-bit indices where the count allows.
template <typename I, bool kWide>
__global__ void decode_values(Args a) {
  __shared__ std::uint8_t table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = a.table[threadIdx.x];
  __syncthreads();
  const I count = static_cast<I>(a.count);
  const I groups = (count + 7) / 8;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I g = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    const I first = g * 8;
    if (kWide && first + 8 <= count) {
      const uint2 low = __ldg(reinterpret_cast<const uint2*>(a.low) + g);
      const std::uint32_t codes = __ldg(reinterpret_cast<const std::uint32_t*>(a.codes) + g);
      alignas(16) std::uint16_t v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const unsigned byte = ((k < 4 ? low.x : low.y) >> (8 * (k % 4))) & 0xFFu;
        v[k] = rebuild(byte, table[(codes >> (4 * k)) & 0xFu]);
      }
      reinterpret_cast<uint4*>(a.out)[g] = *reinterpret_cast<const uint4*>(v);
    } else {
      const I last = first + 8 < count ? first + 8 : count;
      for (I i = first; i < last; ++i) {
        const unsigned code = (a.codes[i / 2] >> (4 * (i % 2))) & 0xFu;
        a.out[i] = rebuild(a.low[i], table[code]);
      }
    }
  }
}

__global__ void patch_exceptions(const std::uint32_t* list, const std::uint8_t* low, std::uint16_t* out,
                                 std::size_t exceptions) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < exceptions; j += step) {
    const std::uint32_t i = list[2 * j];
    out[i] = rebuild(low[i], list[2 * j + 1]);
  }
}

constexpr int kThreads = 256;

unsigned blocks_for(std::size_t items) {
  // One item per thread up to 2^16 blocks, then grid-stride.
  return static_cast<unsigned>(std::min<std::size_t>((items + kThreads - 1) / kThreads, 1u << 16));
}

template <typename I>
void launch_values(const Args& a, bool wide, cudaStream_t stream) {
  const unsigned blocks = blocks_for((a.count + 7) / 8);
  if (wide) {
    decode_values<I, true><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    decode_values<I, false><<<blocks, kThreads, 0, stream>>>(a);
  }
}

}  // namespace

void lossless_decode_cuda(const LosslessSpec& spec, const void* encoded, void* out, void* stream) {
  LS_CHECK_ARG(encoded != nullptr && out != nullptr, "lossless_decode_cuda: no input or no output");
  LS_CHECK_ARG(spec.count > 0 && spec.count <= kLosslessMaxCount, "lossless_decode_cuda: a spec of ", spec.count,
               " values");
  const auto at = reinterpret_cast<std::uintptr_t>(encoded);
  LS_CHECK_ARG(at % 4 == 0 && reinterpret_cast<std::uintptr_t>(out) % 2 == 0,
               "lossless_decode_cuda: the encoded buffer must be 4-byte aligned and the output 2-byte aligned");
  const auto* base = static_cast<const std::uint8_t*>(encoded);
  Args a{base, base + spec.codes_offset(), static_cast<std::uint16_t*>(out), spec.count, {}};
  for (int k = 0; k < 16; ++k) a.table[k] = spec.exponent[k];
  const bool wide = at % 8 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  // 32-bit indices while g * 8 and g + the grid's stride cannot wrap.
  if (spec.count < (std::size_t{1} << 31)) {
    launch_values<std::uint32_t>(a, wide, s);
  } else {
    launch_values<std::size_t>(a, wide, s);
  }
  if (spec.exceptions > 0) {
    patch_exceptions<<<blocks_for(spec.exceptions), kThreads, 0, s>>>(
        reinterpret_cast<const std::uint32_t*>(base + spec.exceptions_offset()), base, a.out, spec.exceptions);
  }
  const cudaError_t status = cudaGetLastError();
  LS_CHECK(status == cudaSuccess, "lossless decode kernel launch failed: ", cudaGetErrorName(status), " (",
           cudaGetErrorString(status), ")");
}

}  // namespace layerstream
