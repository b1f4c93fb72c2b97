// The host reference of the OstrisLinear decoders (see ostris_decode.h); ostris_decode.cu computes the same
// values with the hardware conversions.
#include "layerstream/ostris_decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "layerstream/check.h"

namespace layerstream {

namespace {

std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

// Index i of a most-significant-bit-first stream of `bits`-bit values.
std::uint32_t stream_index(const std::uint8_t* packed, int bits, std::size_t i) {
  std::uint32_t v = 0;
  const std::size_t first = i * static_cast<std::size_t>(bits);
  for (int b = 0; b < bits; ++b) {
    const std::size_t g = first + static_cast<std::size_t>(b);
    v = (v << 1) | ((packed[g >> 3] >> (7 - (g & 7))) & 1u);
  }
  return v;
}

std::uint32_t bits_of(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

float float_of(std::uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kE2m1Edges[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
constexpr std::size_t kNvfp4Block = 16;

// The larger, or a NaN where either is one (torch's amax propagates NaN).
float nan_max(float a, float b) { return std::isnan(a) ? a : (std::isnan(b) || b > a) ? b : a; }

}  // namespace

std::uint8_t e4m3_from_float(float v, bool saturates) {
  constexpr std::uint32_t kFirstOut = UINT32_C(1087) << 20;  // 480.0f, the first value past the range
  constexpr std::uint32_t kDenormMagic = UINT32_C(141) << 23;
  std::uint32_t f = bits_of(v);
  const std::uint32_t sign = f & UINT32_C(0x80000000);
  f ^= sign;
  std::uint8_t r = 0;
  if (f >= kFirstOut) {
    r = (!saturates || f > UINT32_C(0x7F800000)) ? 0x7f : 0x7e;
  } else if (f < (UINT32_C(121) << 23)) {  // below 2^-6, the smallest normal: round in the denormal grid
    r = static_cast<std::uint8_t>(bits_of(float_of(f) + float_of(kDenormMagic)) - kDenormMagic);
  } else {
    const std::uint32_t odd = (f >> 20) & 1u;
    f += (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd;
    r = static_cast<std::uint8_t>(f >> 20);
    if (r == 0x7f && saturates) r = 0x7e;
  }
  return static_cast<std::uint8_t>(r | (sign >> 24));
}

std::array<std::size_t, 4> uintx_shard_bytes(const UintxSpec& spec) {
  std::array<std::size_t, 4> bytes{};
  for (std::size_t s = 0; s < bytes.size(); ++s) {
    const int k = 8 >> s;
    if (spec.bits & k) bytes[s] = ceil_div(spec.rows * spec.cols, static_cast<std::size_t>(8 / k));
  }
  return bytes;
}

std::size_t uintx_packed_bytes(const UintxSpec& spec) {
  std::size_t total = 0;
  for (std::size_t b : uintx_shard_bytes(spec)) total += b;
  return total;
}

std::size_t codebook_packed_bytes(const CodebookSpec& spec) {
  if (spec.vec_dim == 0) return 0;
  return ceil_div(spec.rows * spec.cols / spec.vec_dim, 8) * static_cast<std::size_t>(spec.bits);
}

std::size_t int_rows_packed_bytes(const IntRowsSpec& spec) {
  switch (spec.codes) {
    case IntRowsSpec::Codes::kInt8: return spec.rows * spec.cols;
    case IntRowsSpec::Codes::kBitfield: return spec.rows * (spec.cols / 8) * static_cast<std::size_t>(spec.bits);
    case IntRowsSpec::Codes::kTernary: return spec.rows * ceil_div(spec.cols, 5);
  }
  return 0;
}

void check_uintx_spec(const UintxSpec& spec) {
  LS_CHECK_ARG(spec.rows > 0 && spec.cols > 0, "uintx decode: empty weight (", spec.rows, " x ", spec.cols, ")");
  LS_CHECK_ARG(spec.bits >= 2 && spec.bits <= 8, "uintx decode: ", spec.bits, " bits (2 to 8 are the format's)");
  LS_CHECK_ARG(spec.group > 0 && spec.cols % spec.group == 0, "uintx decode: groups of ", spec.group,
               " do not divide rows of ", spec.cols);
}

void check_codebook_spec(const CodebookSpec& spec) {
  LS_CHECK_ARG(spec.rows > 0 && spec.cols > 0, "codebook decode: empty weight (", spec.rows, " x ", spec.cols, ")");
  LS_CHECK_ARG(spec.bits >= 1 && spec.bits <= 16, "codebook decode: ", spec.bits, " index bits (1 to 16)");
  LS_CHECK_ARG(spec.vec_dim > 0 && (spec.rows * spec.cols) % spec.vec_dim == 0, "codebook decode: vectors of ",
               spec.vec_dim, " do not divide ", spec.rows * spec.cols, " values");
  LS_CHECK_ARG(spec.entries > 0, "codebook decode: an empty codebook");
  LS_CHECK_ARG(spec.group > 0 && spec.cols % spec.group == 0, "codebook decode: groups of ", spec.group,
               " do not divide rows of ", spec.cols);
}

void check_nvfp4_spec(const Nvfp4Spec& spec) {
  LS_CHECK_ARG(spec.rows > 0 && spec.cols > 0, "nvfp4 decode: empty weight (", spec.rows, " x ", spec.cols, ")");
  LS_CHECK_ARG(spec.cols % kNvfp4Block == 0, "nvfp4 decode: rows of ", spec.cols, " values (a multiple of 16 is the format's)");
}

void check_fake_quant_spec(const FakeQuantSpec& spec) {
  LS_CHECK_ARG(spec.cols > 0 && spec.cols % kNvfp4Block == 0, "nvfp4 activation quantization: rows of ", spec.cols,
               " values (a multiple of 16 is the format's)");
}

void check_int_rows_spec(const IntRowsSpec& spec) {
  LS_CHECK_ARG(spec.rows > 0 && spec.cols > 0, "int rows decode: empty weight (", spec.rows, " x ", spec.cols, ")");
  if (spec.codes == IntRowsSpec::Codes::kBitfield) {
    LS_CHECK_ARG(spec.bits >= 2 && spec.bits <= 8, "int rows decode: ", spec.bits, " bits (2 to 8 are the format's)");
    LS_CHECK_ARG(spec.cols % 8 == 0, "int rows decode: rows of ", spec.cols,
                 " bitfield codes (a multiple of 8 is the format's)");
  }
  LS_CHECK_ARG(spec.group == 0 || spec.cols % spec.group == 0, "int rows decode: groups of ", spec.group,
               " do not divide rows of ", spec.cols);
}

namespace {

// The code of value c of row r (before the ratio), as the backend's unpack computes it.
int int_rows_code(const IntRowsSpec& spec, const std::uint8_t* packed, std::size_t r, std::size_t c) {
  switch (spec.codes) {
    case IntRowsSpec::Codes::kInt8: return static_cast<std::int8_t>(packed[r * spec.cols + c]);
    case IntRowsSpec::Codes::kBitfield: {
      const auto bits = static_cast<std::size_t>(spec.bits);
      const std::uint8_t* word = packed + (r * (spec.cols / 8) + c / 8) * bits;
      std::uint64_t w = 0;
      for (std::size_t b = 0; b < bits; ++b) w |= static_cast<std::uint64_t>(word[b]) << (8 * b);
      const int field = static_cast<int>((w >> (bits * (c % 8))) & ((std::uint64_t{1} << bits) - 1));
      return field - ((1 << (spec.bits - 1)) - 1);
    }
    case IntRowsSpec::Codes::kTernary: {
      static constexpr int kPow3[5] = {1, 3, 9, 27, 81};
      const int byte = packed[r * ceil_div(spec.cols, 5) + c / 5];
      return byte / kPow3[c % 5] % 3 - 1;
    }
  }
  return 0;
}

float load_float(const float* p, std::size_t i) {
  float v;
  std::memcpy(&v, p + i, sizeof v);  // (byte views of the backend's buffers: any alignment)
  return v;
}

}  // namespace

void decode_int_rows_host(const IntRowsSpec& spec, const std::uint8_t* packed, const float* ratio, const float* scale,
                          void* out) {
  check_int_rows_spec(spec);
  auto* o = static_cast<unsigned char*>(out);
  const std::size_t osize = real_size(spec.out), groups = spec.group ? spec.cols / spec.group : 0;
  for (std::size_t r = 0; r < spec.rows; ++r) {
    const float sc = round_to(spec.out, load_float(scale, r));
    for (std::size_t c = 0; c < spec.cols; ++c) {
      auto code = static_cast<float>(int_rows_code(spec, packed, r, c));
      if (spec.group) {
        code = std::nearbyint(code * load_float(ratio, r * groups + c / spec.group));
        // (+ 0: an integer, as the backend's int8 codes are; rint of a small negative product is -0)
        code = std::fmin(std::fmax(code, -127.0f), 127.0f) + 0.0f;  // (fmin/fmax as the device's fminf/fmaxf)
      }
      store_real(spec.out, code * sc, o + (r * spec.cols + c) * osize);
    }
  }
}

void decode_uintx_host(const UintxSpec& spec, const std::uint8_t* packed, const void* scale,
                       const std::uint8_t* zero, void* out) {
  check_uintx_spec(spec);
  const std::size_t n = spec.rows * spec.cols, groups = spec.cols / spec.group;
  const auto* s = static_cast<const unsigned char*>(scale);
  auto* o = static_cast<unsigned char*>(out);
  const std::size_t ssize = real_size(spec.orig), osize = real_size(spec.out);
  const std::array<std::size_t, 4> shard_bytes = uintx_shard_bytes(spec);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t code = 0;
    int offset = 0;
    const std::uint8_t* shard = packed;
    for (std::size_t si = 0; si < shard_bytes.size(); ++si) {
      const int k = 8 >> si;
      if (!(spec.bits & k)) continue;
      const std::size_t nbytes = shard_bytes[si];
      const std::uint32_t byte = shard[i % nbytes];
      const auto j = static_cast<int>(i / nbytes);
      code |= ((byte >> (j * k)) & ((1u << k) - 1u)) << offset;
      offset += k;
      shard += nbytes;
    }
    const std::size_t g = (i / spec.cols) * groups + (i % spec.cols) / spec.group;
    const float d = static_cast<float>(static_cast<int>(code) - static_cast<int>(zero[g]));
    store_real(spec.out, round_to(spec.orig, d * decode_real(spec.orig, s + g * ssize)), o + i * osize);
  }
}

void decode_codebook_host(const CodebookSpec& spec, const std::uint8_t* packed, const float* codebook,
                          const void* scale, void* out) {
  check_codebook_spec(spec);
  const std::size_t n = spec.rows * spec.cols, groups = spec.cols / spec.group;
  const auto* s = static_cast<const unsigned char*>(scale);
  auto* o = static_cast<unsigned char*>(out);
  const std::size_t ssize = real_size(spec.scale), osize = real_size(spec.out);
  for (std::size_t e = 0; e < n; ++e) {
    const std::uint32_t idx = stream_index(packed, spec.bits, e / spec.vec_dim);
    const float c = idx < spec.entries ? codebook[idx * spec.vec_dim + e % spec.vec_dim]
                                       : std::numeric_limits<float>::quiet_NaN();
    const std::size_t g = (e / spec.cols) * groups + (e % spec.cols) / spec.group;
    const float sc = round_to(spec.out, decode_real(spec.scale, s + g * ssize));
    store_real(spec.out, round_to(spec.out, c) * sc, o + e * osize);
  }
}

void decode_nvfp4_host(const Nvfp4Spec& spec, const std::uint8_t* packed, const std::uint8_t* scales,
                       const float* pts, void* out) {
  check_nvfp4_spec(spec);
  float p;
  std::memcpy(&p, pts, sizeof p);  // (a byte view of the backend's buffer: any alignment)
  auto* o = static_cast<unsigned char*>(out);
  const std::size_t n = spec.rows * spec.cols, osize = real_size(spec.out);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t code = static_cast<std::uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 15);
    const float sp = decode_code(CodeType::kFloat8E4M3, scales[i / kNvfp4Block]) * p;
    const float v = (code == 8 && spec.plus_zero) ? 0.0f : (code & 8) ? -kE2m1[code & 7] : kE2m1[code & 7];
    store_real(spec.out, v * sp, o + i * osize);
  }
}

void fake_quant_nvfp4_host(const FakeQuantSpec& spec, const void* x, const float* pts, void* delta) {
  check_fake_quant_spec(spec);
  float p;
  std::memcpy(&p, pts, sizeof p);
  const float d = 6.0f * p;
  const auto* in = static_cast<const unsigned char*>(x);
  auto* o = static_cast<unsigned char*>(delta);
  const std::size_t size = real_size(spec.type), blocks = spec.rows * spec.cols / kNvfp4Block;
  for (std::size_t b = 0; b < blocks; ++b) {
    float v[kNvfp4Block];
    float amax = 0.0f;
    for (std::size_t k = 0; k < kNvfp4Block; ++k) {
      v[k] = decode_real(spec.type, in + (b * kNvfp4Block + k) * size);
      amax = nan_max(amax, std::fabs(v[k]));
    }
    const float q = decode_code(CodeType::kFloat8E4M3, e4m3_from_float(amax / d, spec.e4m3_saturates)) * p;
    const float safe = q > 0.0f ? q : 1.0f;
    for (std::size_t k = 0; k < kNvfp4Block; ++k) {
      float z = v[k] / safe;
      if (!std::isnan(z)) z = std::min(std::max(z, -6.0f), 6.0f);
      const float a = std::fabs(z);
      int m = 0;
      for (float e : kE2m1Edges) m += !(e >= a);
      const float dq = round_to(spec.type, (z < 0.0f ? -kE2m1[m] : kE2m1[m]) * q);
      store_real(spec.type, dq - v[k], o + (b * kNvfp4Block + k) * size);
    }
  }
}

}  // namespace layerstream
