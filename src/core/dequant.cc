// The host reference of the dequantization (see dequant.h); the CUDA kernel (dequant.cu) computes the
// same values with the hardware conversions.
#include "layerstream/dequant.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "layerstream/check.h"

namespace layerstream {

namespace {

float from_bits(std::uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

std::uint32_t bits_of(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return from_bits(sign | 0x7F800000u | (man << 13));  // inf / nan
  if (exp == 0) {                                                        // zero / subnormal: man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace

std::size_t real_size(RealType t) { return t == RealType::kFloat32 ? 4 : 2; }

const char* code_name(CodeType t) {
  switch (t) {
    case CodeType::kFloat8E4M3: return "float8_e4m3fn";
    case CodeType::kFloat8E5M2: return "float8_e5m2";
    case CodeType::kInt8: return "int8";
  }
  return "?";
}

void check_dequant_spec(const DequantSpec& spec) {
  LS_CHECK_ARG(spec.math == RealType::kFloat32 || spec.math == spec.scale,
               "dequantize: the scale must be exact in the math type (math float32, or the scale's own type)");
  LS_CHECK_ARG(spec.rows > 0 && spec.cols > 0, "dequantize: empty weight (", spec.rows, " x ", spec.cols, ")");
}

float decode_code(CodeType t, std::uint8_t b) {
  switch (t) {
    case CodeType::kInt8:
      return static_cast<float>(static_cast<std::int8_t>(b));
    case CodeType::kFloat8E5M2:  // the upper byte of a float16
      return fp16_bits_to_float(static_cast<std::uint16_t>(b) << 8);
    case CodeType::kFloat8E4M3: {  // bias 7, no infinities, S.1111.111 is NaN
      const bool negative = (b & 0x80u) != 0;
      const int exp = (b >> 3) & 0xF;
      const int man = b & 0x7;
      float v;
      if (exp == 0xF && man == 0x7) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        v = std::ldexp(static_cast<float>(man), -9);
      } else {
        v = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
      }
      return negative ? -v : v;
    }
  }
  return 0.0f;
}

std::uint16_t float_to_bf16_bits(float v) {
  const std::uint32_t bits = bits_of(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // quiet nan
  const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

std::uint16_t float_to_fp16_bits(float v) {
  const std::uint32_t bits = bits_of(v);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // nan
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (a < 0x38800000u) {                        // below 2^-14: a subnormal half (or zero)
    const std::uint32_t exp = a >> 23;
    if (exp < 102) return sign;  // below 2^-25: rounds to zero
    const std::uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // value / 2^-24 = man >> shift
    std::uint32_t q = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  std::uint32_t h = (((a >> 23) - 112u) << 10) | ((a & 0x7FFFFFu) >> 13);
  const std::uint32_t rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent: still right
  return static_cast<std::uint16_t>(sign | h);
}

float decode_real(RealType t, const void* at) {
  switch (t) {
    case RealType::kFloat32: {
      float v;
      std::memcpy(&v, at, sizeof v);
      return v;
    }
    case RealType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, at, sizeof h);
      return fp16_bits_to_float(h);
    }
    case RealType::kBFloat16: {
      std::uint16_t h;
      std::memcpy(&h, at, sizeof h);
      return from_bits(static_cast<std::uint32_t>(h) << 16);
    }
  }
  return 0.0f;
}

float round_to(RealType t, float v) {
  switch (t) {
    case RealType::kFloat32: return v;
    case RealType::kFloat16: {
      const std::uint16_t h = float_to_fp16_bits(v);
      return decode_real(RealType::kFloat16, &h);
    }
    case RealType::kBFloat16: {
      const std::uint16_t h = float_to_bf16_bits(v);
      return decode_real(RealType::kBFloat16, &h);
    }
  }
  return v;
}

void store_real(RealType t, float v, void* at) {
  switch (t) {
    case RealType::kFloat32: std::memcpy(at, &v, 4); break;
    case RealType::kFloat16: {
      const std::uint16_t h = float_to_fp16_bits(v);
      std::memcpy(at, &h, 2);
      break;
    }
    case RealType::kBFloat16: {
      const std::uint16_t h = float_to_bf16_bits(v);
      std::memcpy(at, &h, 2);
      break;
    }
  }
}

void dequantize_host(const DequantSpec& spec, const void* codes, const void* scale, void* out) {
  check_dequant_spec(spec);
  const auto* c = static_cast<const std::uint8_t*>(codes);
  const auto* s = static_cast<const unsigned char*>(scale);
  auto* o = static_cast<unsigned char*>(out);
  const std::size_t ssize = real_size(spec.scale), osize = real_size(spec.out);
  // A decode table per code type: 256 entries, computed once per call (cheap beside any real weight).
  float table[256];
  for (int i = 0; i < 256; ++i) table[i] = decode_code(spec.code, static_cast<std::uint8_t>(i));
  for (std::size_t r = 0; r < spec.rows; ++r) {
    const float sr = decode_real(spec.scale, s + (spec.per_row ? r : 0) * ssize);
    for (std::size_t k = 0; k < spec.cols; ++k) {
      const std::size_t i = r * spec.cols + k;
      store_real(spec.out, round_to(spec.math, table[c[i]] * sr), o + i * osize);
    }
  }
}

}  // namespace layerstream
