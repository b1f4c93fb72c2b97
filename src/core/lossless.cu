// The lossless bfloat16 decoder on the device (see lossless.h): one kernel rebuilds every value from its
// low byte and its exponent code (sixteen values per thread: a 16-byte and an 8-byte load, two 16-byte
// stores; the table in registers), a second, ordered after it on the same stream, writes the listed exceptions over the values the
// first gave the mark's exponent. Bound by HBM: 1.5 bytes read and 2 written per value.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "layerstream/check.h"
#include "layerstream/lossless.h"

namespace layerstream {

namespace {

struct Args {
  const std::uint8_t* low;
  const std::uint8_t* codes;
  std::uint16_t* out;
  std::size_t count;
  alignas(16) std::uint8_t table[16];
};

__device__ __forceinline__ std::uint16_t rebuild(unsigned low, unsigned exponent) {
  return static_cast<std::uint16_t>(((low & 0x80u) << 8) | (exponent << 7) | (low & 0x7Fu));
}

// The exponent of `code` (0..15) from the table held in four registers: a byte permute picks within each
// half, bit 3 picks the half.
__device__ __forceinline__ unsigned exponent_of(const uint4& t, unsigned code) {
  const unsigned low_half = __byte_perm(t.x, t.y, code & 7u);
  const unsigned high_half = __byte_perm(t.z, t.w, code & 7u);
  return ((code & 8u) ? high_half : low_half) & 0xFFu;
}

// Sixteen values per thread; kWide: the pointers allow the 16-, 8- and 16-byte accesses (a last group of
// fewer than sixteen values goes one value at a time either way). I: 32-bit indices where the count
// allows.
template <typename I, bool kWide>
__global__ void decode_values(Args a) {
  uint4 t;
  std::memcpy(&t, a.table, sizeof t);
  const I count = static_cast<I>(a.count);
  const I groups = (count + 15) / 16;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I g = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    const I first = g * 16;
    if (kWide && first + 16 <= count) {
      const uint4 low = __ldg(reinterpret_cast<const uint4*>(a.low) + g);
      const uint2 codes = __ldg(reinterpret_cast<const uint2*>(a.codes) + g);
      const unsigned lw[4] = {low.x, low.y, low.z, low.w};
      const unsigned cw[2] = {codes.x, codes.y};
      unsigned packed[8];  // two rebuilt values per word
#pragma unroll
      for (int k = 0; k < 16; k += 2) {
        const unsigned b0 = (lw[k / 4] >> (8 * (k % 4))) & 0xFFu;
        const unsigned b1 = (lw[k / 4] >> (8 * (k % 4 + 1))) & 0xFFu;
        const unsigned c0 = (cw[k / 8] >> (4 * (k % 8))) & 0xFu;
        const unsigned c1 = (cw[k / 8] >> (4 * (k % 8 + 1))) & 0xFu;
        packed[k / 2] = rebuild(b0, exponent_of(t, c0)) | (static_cast<unsigned>(rebuild(b1, exponent_of(t, c1))) << 16);
      }
      uint4* dst = reinterpret_cast<uint4*>(a.out) + 2 * static_cast<std::size_t>(g);
      dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    } else {
      const I last = first + 16 < count ? first + 16 : count;
      for (I i = first; i < last; ++i) {
        const unsigned code = (a.codes[i / 2] >> (4 * (i % 2))) & 0xFu;
        a.out[i] = rebuild(a.low[i], exponent_of(t, code));
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

unsigned blocks_for(std::size_t items, unsigned max_blocks) {
  // One item per thread up to 2^16 blocks (or max_blocks), then grid-stride.
  const std::size_t most = max_blocks > 0 ? std::min(max_blocks, 1u << 16) : 1u << 16;
  return static_cast<unsigned>(std::min<std::size_t>((items + kThreads - 1) / kThreads, most));
}

template <typename I>
void launch_values(const Args& a, bool wide, unsigned max_blocks, cudaStream_t stream) {
  const unsigned blocks = blocks_for((a.count + 15) / 16, max_blocks);
  if (wide) {
    decode_values<I, true><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    decode_values<I, false><<<blocks, kThreads, 0, stream>>>(a);
  }
}

}  // namespace

void lossless_decode_cuda(const LosslessSpec& spec, const void* encoded, void* out, void* stream,
                          unsigned max_blocks) {
  LS_CHECK_ARG(encoded != nullptr && out != nullptr, "lossless_decode_cuda: no input or no output");
  LS_CHECK_ARG(spec.count > 0 && spec.count <= kLosslessMaxCount, "lossless_decode_cuda: a spec of ", spec.count,
               " values");
  const auto at = reinterpret_cast<std::uintptr_t>(encoded);
  LS_CHECK_ARG(at % 4 == 0 && reinterpret_cast<std::uintptr_t>(out) % 2 == 0,
               "lossless_decode_cuda: the encoded buffer must be 4-byte aligned and the output 2-byte aligned");
  const auto* base = static_cast<const std::uint8_t*>(encoded);
  Args a{base, base + spec.codes_offset(), static_cast<std::uint16_t*>(out), spec.count, {}};
  for (int k = 0; k < 16; ++k) a.table[k] = spec.exponent[k];
  const bool wide = at % 16 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  // 32-bit indices while g * 8 and g + the grid's stride cannot wrap.
  if (spec.count < (std::size_t{1} << 31)) {
    launch_values<std::uint32_t>(a, wide, max_blocks, s);
  } else {
    launch_values<std::size_t>(a, wide, max_blocks, s);
  }
  if (spec.exceptions > 0) {
    patch_exceptions<<<blocks_for(spec.exceptions, max_blocks), kThreads, 0, s>>>(
        reinterpret_cast<const std::uint32_t*>(base + spec.exceptions_offset()), base, a.out, spec.exceptions);
  }
  const cudaError_t status = cudaGetLastError();
  LS_CHECK(status == cudaSuccess, "lossless decode kernel launch failed: ", cudaGetErrorName(status), " (",
           cudaGetErrorString(status), ")");
}

}  // namespace layerstream
