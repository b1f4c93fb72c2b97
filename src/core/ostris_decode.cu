// The OstrisLinear decoders on the device (see ostris_decode.h for the formats and formulas): one thread per
// output value, grid-stride. Conversions are the hardware's round-to-nearest-even ones, those of torch and of
// the host reference, so the three agree bit for bit. Bound by HBM: a thread reads a byte or two of codes
// (neighbours share them through L1) and its scale, and writes one value.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda_real.cuh"
#include "layerstream/check.h"
#include "layerstream/cuda_check.h"
#include "layerstream/ostris_decode.h"

namespace layerstream {

namespace {

using cuda_real::load_real;
using cuda_real::Out;
using cuda_real::round_real;

// Eight consecutive values per thread, all in one row and one scale group (the launch checks cols and group
// are multiples of 8): the row, the group and each shard's byte are computed once per thread, not per value,
// and the values leave in 16-byte stores. I is the index type: 32-bit whenever the weight allows it (a 64-bit
// division is several times the instructions of a 32-bit one, in kernels that should be bound by HBM).
constexpr int kPerThread = 8;

template <RealType O>
__device__ __forceinline__ void store8(void* out, std::size_t first, const float (&v)[kPerThread]) {
  using T = typename Out<O>::T;
  alignas(16) T t[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) t[k] = Out<O>::from(v[k]);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(out) + first);
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof t / 16); ++j) dst[j] = reinterpret_cast<const uint4*>(t)[j];
}

struct UintxArgs {
  static constexpr std::size_t kValuesPerThread = kPerThread;
  const std::uint8_t* packed;
  const void* scale;
  const std::uint8_t* zero;
  void* out;
  std::size_t n, cols, group;
  std::size_t shard_bytes[4];  // per shard of 8, 4, 2, 1 bits (0 when absent)
  int bits;
  RealType orig;
};

template <RealType O, typename I>
__global__ void decode_uintx(UintxArgs a) {
  const I n8 = static_cast<I>(a.n / kPerThread), cols = static_cast<I>(a.cols), group = static_cast<I>(a.group);
  const I groups = cols / group;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I t = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; t < n8; t += step) {
    const I i0 = t * kPerThread;
    std::uint32_t code[kPerThread] = {};
    int offset = 0;
    const std::uint8_t* shard = a.packed;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int k = 8 >> s;
      if (!(a.bits & k)) continue;
      const I nbytes = static_cast<I>(a.shard_bytes[s]);
      I b = i0 % nbytes;
      int j = static_cast<int>(i0 / nbytes);
#pragma unroll
      for (int v = 0; v < kPerThread; ++v) {
        code[v] |= ((static_cast<std::uint32_t>(__ldg(shard + b)) >> (j * k)) & ((1u << k) - 1u)) << offset;
        if (++b == nbytes) b = 0, ++j;
      }
      offset += k;
      shard += nbytes;
    }
    const I g = (i0 / cols) * groups + (i0 % cols) / group;
    const float sc = load_real(a.orig, a.scale, g);
    const int z = __ldg(a.zero + g);
    float v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      v[k] = round_real(a.orig, __fmul_rn(static_cast<float>(static_cast<int>(code[k]) - z), sc));
    }
    store8<O>(a.out, i0, v);
  }
}

struct CodebookArgs {
  static constexpr std::size_t kValuesPerThread = kPerThread;
  const std::uint8_t* packed;
  const float* codebook;
  const void* scale;
  void* out;
  std::size_t n, cols, group, entries;
  int bits, vec_shift;  // vec_dim = 1 << vec_shift
  RealType scale_type;
};

template <RealType O, typename I>
__global__ void decode_codebook(CodebookArgs a) {
  const I n8 = static_cast<I>(a.n / kPerThread), cols = static_cast<I>(a.cols), group = static_cast<I>(a.group);
  const I groups = cols / group, vec_mask = (I{1} << a.vec_shift) - 1;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I t = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; t < n8; t += step) {
    const I e0 = t * kPerThread;
    const I g = (e0 / cols) * groups + (e0 % cols) / group;
    const float sc = round_real(O, load_real(a.scale_type, a.scale, g));
    float v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const I e = e0 + static_cast<I>(k);
      // The index's bits lie in at most three bytes (16 bits starting anywhere in a byte).
      const std::size_t first = static_cast<std::size_t>(e >> a.vec_shift) * static_cast<std::size_t>(a.bits);
      const std::size_t byte = first >> 3, last = (first + static_cast<std::size_t>(a.bits) - 1) >> 3;
      std::uint32_t window = 0;
      for (std::size_t b = byte; b <= last; ++b) window = (window << 8) | __ldg(a.packed + b);
      const auto spare = static_cast<int>((last - byte + 1) * 8 - (first & 7) - static_cast<std::size_t>(a.bits));
      const std::uint32_t idx = (window >> spare) & ((1u << a.bits) - 1u);
      const float c = idx < a.entries ? __ldg(a.codebook + (static_cast<std::size_t>(idx) << a.vec_shift) + (e & vec_mask))
                                      : __int_as_float(0x7fc00000);
      v[k] = __fmul_rn(round_real(O, c), sc);
    }
    store8<O>(a.out, e0, v);
  }
}

// nvfp4 (ostris_decode.h): a thread per eight values (half a block of 16, which share one scale byte): four code
// bytes in one 32-bit load where the codes are 4-byte aligned, and one 16-byte store, so that a warp reads 128
// consecutive bytes of codes and writes consecutive 16-byte pieces.
__device__ __forceinline__ float e4m3_value(std::uint32_t code) {
  const std::uint32_t e = (code >> 3) & 15u, m = code & 7u;
  float v;
  if (e == 15u && m == 7u) {
    v = __int_as_float(0x7fc00000);
  } else if (e == 0u) {
    v = __fmul_rn(static_cast<float>(m), 0.001953125f);  // m * 2^-9, exact
  } else {
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));
  }
  return (code & 0x80u) ? -v : v;
}

__device__ __forceinline__ std::uint32_t e4m3_code(float v, bool saturates) {
  std::uint32_t f = __float_as_uint(v);
  const std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  std::uint32_t r;
  if (f >= (1087u << 20)) {
    r = (!saturates || f > 0x7F800000u) ? 0x7fu : 0x7eu;
  } else if (f < (121u << 23)) {
    r = (__float_as_uint(__fadd_rn(__uint_as_float(f), __uint_as_float(141u << 23))) - (141u << 23)) & 0xffu;
  } else {
    f += (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((f >> 20) & 1u);
    r = (f >> 20) & 0xffu;
    if (r == 0x7fu && saturates) r = 0x7eu;
  }
  return r | (sign >> 24);
}

__device__ __forceinline__ float e2m1_value(std::uint32_t code) {
  const std::uint32_t m = code & 7u;
  // [0, .5, 1, 1.5, 2, 3, 4, 6]: exact in float
  const float mag = m < 4u ? 0.5f * static_cast<float>(m) : m == 4u ? 2.0f : m == 5u ? 3.0f : m == 6u ? 4.0f : 6.0f;
  return (code & 8u) ? -mag : mag;
}

struct Nvfp4Args {
  static constexpr std::size_t kValuesPerThread = kPerThread;
  const std::uint8_t* packed;
  const std::uint8_t* scales;
  const float* pts;
  void* out;
  std::size_t n, chunks;  // values, and runs of eight of them (one per thread)
  bool word_loads;        // the codes are 4-byte aligned: one 32-bit load per thread
  bool plus_zero;         // code 8 decodes as +0 (Nvfp4Spec)
};

template <RealType O, typename I>
__global__ void decode_nvfp4(Nvfp4Args a) {
  // The sixteen codes' values (code 8's zero signed as the spec says), one table per block in shared memory:
  // a lookup per value instead of the arithmetic decode (the kernel issues few enough instructions to stay
  // bound by HBM).
  __shared__ float values[16];
  if (threadIdx.x < 16) values[threadIdx.x] = (a.plus_zero && threadIdx.x == 8u) ? 0.0f : e2m1_value(threadIdx.x);
  __syncthreads();
  const float pts = __ldg(a.pts);
  const I chunks = static_cast<I>(a.chunks);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I c = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += step) {
    const float sp = __fmul_rn(e4m3_value(__ldg(a.scales + c / 2)), pts);
    std::uint32_t word;
    if (a.word_loads) {
      word = __ldg(reinterpret_cast<const std::uint32_t*>(a.packed) + c);
    } else {
      const std::uint8_t* p = a.packed + static_cast<std::size_t>(c) * 4;
      word = __ldg(p) | (std::uint32_t{__ldg(p + 1)} << 8) | (std::uint32_t{__ldg(p + 2)} << 16) |
             (std::uint32_t{__ldg(p + 3)} << 24);
    }
    float v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {  // nibble k (little-endian): the even column in the low one
      v[k] = __fmul_rn(values[(word >> (4 * k)) & 15u], sp);
    }
    store8<O>(a.out, static_cast<std::size_t>(c) * kPerThread, v);
  }
}

struct FakeQuantArgs {
  static constexpr std::size_t kValuesPerThread = 16;
  const void* x;
  const float* pts;
  void* delta;
  std::size_t n, blocks;
  bool saturates;
};

template <RealType O, typename I>
__global__ void fake_quant_nvfp4(FakeQuantArgs a) {
  using T = typename Out<O>::T;
  const float pts = __ldg(a.pts);
  const float d = __fmul_rn(6.0f, pts);
  const I blocks = static_cast<I>(a.blocks);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I b = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks; b += step) {
    alignas(16) T t[16];
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + static_cast<std::size_t>(b) * 16);
#pragma unroll
    for (int j = 0; j < static_cast<int>(sizeof t / 16); ++j) reinterpret_cast<uint4*>(t)[j] = __ldg(src + j);
    float v[16];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      v[k] = load_real(O, t, k);
      const float m = fabsf(v[k]);
      amax = isnan(amax) ? amax : (isnan(m) || m > amax) ? m : amax;
    }
    const float q = __fmul_rn(e4m3_value(e4m3_code(__fdiv_rn(amax, d), a.saturates)), pts);
    const float safe = q > 0.0f ? q : 1.0f;
    float out[2][kPerThread];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      float z = __fdiv_rn(v[k], safe);
      if (!isnan(z)) z = fminf(fmaxf(z, -6.0f), 6.0f);
      const float m = fabsf(z);
      const std::uint32_t idx = !(0.25f >= m) + !(0.75f >= m) + !(1.25f >= m) + !(1.75f >= m) + !(2.5f >= m) +
                                !(3.5f >= m) + !(5.0f >= m);
      const float dq = round_real(O, __fmul_rn(e2m1_value(idx | (z < 0.0f ? 8u : 0u)), q));
      out[k / kPerThread][k % kPerThread] = __fsub_rn(dq, v[k]);
    }
    store8<O>(a.delta, static_cast<std::size_t>(b) * 16, out[0]);
    store8<O>(a.delta, static_cast<std::size_t>(b) * 16 + kPerThread, out[1]);
  }
}

// ConvRot int rows (ostris_decode.h): eight values of one row per thread (cols and the ratio group are
// multiples of 8), so one scale and at most one ratio per thread.
struct IntRowsArgs {
  static constexpr std::size_t kValuesPerThread = kPerThread;
  const std::uint8_t* packed;
  const float* ratio;  // null: no ratios
  const float* scale;
  void* out;
  std::size_t n, cols, group;
  IntRowsSpec::Codes codes;
  int bits;
};

template <RealType O, typename I>
__global__ void decode_int_rows(IntRowsArgs a) {
  const I n8 = static_cast<I>(a.n / kPerThread), cols = static_cast<I>(a.cols);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const int qmax = (1 << (a.bits - 1)) - 1;
  for (I t = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; t < n8; t += step) {
    const I i0 = t * kPerThread, r = i0 / cols, c0 = i0 - r * cols;
    int code[kPerThread];
    if (a.codes == IntRowsSpec::Codes::kInt8) {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(a.packed) + t);
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        code[k] = static_cast<std::int8_t>(((k < 4 ? raw.x : raw.y) >> (8 * (k % 4))) & 0xffu);
      }
    } else if (a.codes == IntRowsSpec::Codes::kBitfield) {
      // The eight codes are the thread's word: bytes [t * bits, t * bits + bits) (rows hold whole words).
      const std::uint8_t* word = a.packed + static_cast<std::size_t>(t) * static_cast<std::size_t>(a.bits);
      unsigned long long w = 0;
      for (int b = 0; b < a.bits; ++b) w |= static_cast<unsigned long long>(__ldg(word + b)) << (8 * b);
      const unsigned long long mask = (1ull << a.bits) - 1ull;
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) code[k] = static_cast<int>((w >> (a.bits * k)) & mask) - qmax;
    } else {
      const std::uint8_t* row = a.packed + static_cast<std::size_t>(r) * static_cast<std::size_t>((a.cols + 4) / 5);
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        const I c = c0 + static_cast<I>(k);
        const I q = c / 5;
        const unsigned byte = __ldg(row + q);
        const unsigned j = static_cast<unsigned>(c - q * 5);
        const unsigned p3 = j == 0 ? 1u : j == 1 ? 3u : j == 2 ? 9u : j == 3 ? 27u : 81u;
        code[k] = static_cast<int>(byte / p3 % 3u) - 1;
      }
    }
    const float sc = round_real(O, __ldg(a.scale + r));
    float v[kPerThread];
    if (a.ratio != nullptr) {
      const I groups = cols / static_cast<I>(a.group);
      const float ratio = __ldg(a.ratio + r * groups + c0 / static_cast<I>(a.group));
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        // (+ 0: an integer, as the backend's int8 codes are; rint of a small negative product is -0)
        const float c8 = __fadd_rn(fminf(fmaxf(rintf(__fmul_rn(static_cast<float>(code[k]), ratio)), -127.0f), 127.0f), 0.0f);
        v[k] = __fmul_rn(c8, sc);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) v[k] = __fmul_rn(static_cast<float>(code[k]), sc);
    }
    store8<O>(a.out, i0, v);
  }
}

unsigned blocks_for(std::size_t items, unsigned threads) {
  // One item per thread up to 2^16 blocks, then grid-stride.
  return static_cast<unsigned>(std::min<std::size_t>((items + threads - 1) / threads, 1u << 16));
}

// The kernel for the output type, with 32-bit indices while an index plus the grid's stride cannot wrap.
template <template <RealType, typename> class K, typename Args>
void launch(const Args& a, RealType out, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  const unsigned blocks = blocks_for(a.n / Args::kValuesPerThread, kThreads);
  if (blocks == 0) return;
  const bool small = a.n < (std::size_t{1} << 31);
  switch (out) {
    case RealType::kFloat32:
      small ? K<RealType::kFloat32, std::uint32_t>::go(blocks, kThreads, stream, a)
            : K<RealType::kFloat32, std::size_t>::go(blocks, kThreads, stream, a);
      break;
    case RealType::kFloat16:
      small ? K<RealType::kFloat16, std::uint32_t>::go(blocks, kThreads, stream, a)
            : K<RealType::kFloat16, std::size_t>::go(blocks, kThreads, stream, a);
      break;
    case RealType::kBFloat16:
      small ? K<RealType::kBFloat16, std::uint32_t>::go(blocks, kThreads, stream, a)
            : K<RealType::kBFloat16, std::size_t>::go(blocks, kThreads, stream, a);
      break;
  }
}

template <RealType O, typename I>
struct UintxKernel {
  static void go(unsigned blocks, unsigned threads, cudaStream_t s, const UintxArgs& a) {
    decode_uintx<O, I><<<blocks, threads, 0, s>>>(a);
  }
};
template <RealType O, typename I>
struct Nvfp4Kernel {
  static void go(unsigned blocks, unsigned threads, cudaStream_t s, const Nvfp4Args& a) {
    decode_nvfp4<O, I><<<blocks, threads, 0, s>>>(a);
  }
};
template <RealType O, typename I>
struct FakeQuantKernel {
  static void go(unsigned blocks, unsigned threads, cudaStream_t s, const FakeQuantArgs& a) {
    fake_quant_nvfp4<O, I><<<blocks, threads, 0, s>>>(a);
  }
};
template <RealType O, typename I>
struct CodebookKernel {
  static void go(unsigned blocks, unsigned threads, cudaStream_t s, const CodebookArgs& a) {
    decode_codebook<O, I><<<blocks, threads, 0, s>>>(a);
  }
};

template <RealType O, typename I>
struct IntRowsKernel {
  static void go(unsigned blocks, unsigned threads, cudaStream_t s, const IntRowsArgs& a) {
    decode_int_rows<O, I><<<blocks, threads, 0, s>>>(a);
  }
};

void check_wide(std::size_t cols, std::size_t group, const void* out) {
  LS_CHECK_ARG(cols % kPerThread == 0 && group % kPerThread == 0 &&
                   reinterpret_cast<std::uintptr_t>(out) % 16 == 0,
               "OstrisLinear decode on the device: rows (", cols, ") and groups (", group,
               ") must be multiples of 8 values and the output 16-byte aligned (use the layer's own forward)");
}

}  // namespace

void decode_uintx_cuda(const UintxSpec& spec, const std::uint8_t* packed, const void* scale,
                       const std::uint8_t* zero, void* out, void* stream) {
  check_uintx_spec(spec);
  check_wide(spec.cols, spec.group, out);
  UintxArgs a{packed, scale, zero, out, spec.rows * spec.cols, spec.cols, spec.group, {0, 0, 0, 0}, spec.bits,
              spec.orig};
  const std::array<std::size_t, 4> shard_bytes = uintx_shard_bytes(spec);
  std::copy(shard_bytes.begin(), shard_bytes.end(), a.shard_bytes);
  launch<UintxKernel>(a, spec.out, static_cast<cudaStream_t>(stream));
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "uintx decode kernel launch failed");
}

void decode_codebook_cuda(const CodebookSpec& spec, const std::uint8_t* packed, const float* codebook,
                          const void* scale, void* out, void* stream) {
  check_codebook_spec(spec);
  check_wide(spec.cols, spec.group, out);
  int shift = 0;
  while ((std::size_t{1} << shift) < spec.vec_dim) ++shift;
  LS_CHECK_ARG((std::size_t{1} << shift) == spec.vec_dim, "codebook decode on the device: vectors of ",
               spec.vec_dim, " values (a power of two is needed; use the layer's own forward)");
  CodebookArgs a{packed, codebook, scale, out, spec.rows * spec.cols, spec.cols, spec.group, spec.entries,
                 spec.bits, shift, spec.scale};
  launch<CodebookKernel>(a, spec.out, static_cast<cudaStream_t>(stream));
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "codebook decode kernel launch failed");
}

void decode_nvfp4_cuda(const Nvfp4Spec& spec, const std::uint8_t* packed, const std::uint8_t* scales,
                       const float* pts, void* out, void* stream) {
  check_nvfp4_spec(spec);
  check_wide(spec.cols, 16, out);
  const std::size_t n = spec.rows * spec.cols;
  Nvfp4Args a{packed, scales, pts, out, n, n / kPerThread, reinterpret_cast<std::uintptr_t>(packed) % 4 == 0,
                 spec.plus_zero};
  launch<Nvfp4Kernel>(a, spec.out, static_cast<cudaStream_t>(stream));
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "nvfp4 decode kernel launch failed");
}

void fake_quant_nvfp4_cuda(const FakeQuantSpec& spec, const void* x, const float* pts, void* delta, void* stream) {
  check_fake_quant_spec(spec);
  check_wide(spec.cols, 16, delta);
  LS_CHECK_ARG(reinterpret_cast<std::uintptr_t>(x) % 16 == 0,
               "nvfp4 activation quantization on the device: the input must be 16-byte aligned");
  const std::size_t n = spec.rows * spec.cols;
  if (n == 0) return;
  FakeQuantArgs a{x, pts, delta, n, n / 16, spec.e4m3_saturates};
  launch<FakeQuantKernel>(a, spec.type, static_cast<cudaStream_t>(stream));
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "nvfp4 activation quantization kernel launch failed");
}

void decode_int_rows_cuda(const IntRowsSpec& spec, const std::uint8_t* packed, const float* ratio, const float* scale,
                          void* out, void* stream) {
  check_int_rows_spec(spec);
  check_wide(spec.cols, spec.group ? spec.group : 8, out);
  LS_CHECK_ARG((spec.group == 0) == (ratio == nullptr), "int rows decode: ratios go with a group and only with one");
  LS_CHECK_ARG(reinterpret_cast<std::uintptr_t>(scale) % 4 == 0 && reinterpret_cast<std::uintptr_t>(ratio) % 4 == 0 &&
                   (spec.codes != IntRowsSpec::Codes::kInt8 || reinterpret_cast<std::uintptr_t>(packed) % 8 == 0),
               "int rows decode on the device: scales and ratios 4-byte aligned, int8 codes 8-byte aligned");
  IntRowsArgs a{packed, ratio, scale, out, spec.rows * spec.cols, spec.cols, spec.group, spec.codes, spec.bits};
  launch<IntRowsKernel>(a, spec.out, static_cast<cudaStream_t>(stream));
  LS_CUDA_CHECK_MSG(cudaGetLastError(), "int rows decode kernel launch failed");
}

}  // namespace layerstream
