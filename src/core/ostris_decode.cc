// The host reference of the OstrisLinear decoders (see ostris_decode.h); ostris_decode.cu computes the same
// values with the hardware conversions.
#include "layerstream/ostris_decode.h"

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

}  // namespace

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

}  // namespace layerstream
