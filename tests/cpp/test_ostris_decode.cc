// The OstrisLinear decoders: the host reference against values packed here by hand in the formats of
// ostris_decode.h, and on a GPU the kernels against the reference bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends.h"
#include "layerstream/check.h"
#include "layerstream/ostris_decode.h"

namespace layerstream {
namespace {

// Codes of `bits` bits in the uintx layout: shards of 8, 4, 2, 1 bits, lowest bits first, a k-bit shard's
// code i in byte i % nbytes at bit (i / nbytes) * k.
std::vector<std::uint8_t> pack_uintx(const std::vector<unsigned>& codes, int bits) {
  std::vector<std::uint8_t> out;
  int offset = 0;
  for (int k : {8, 4, 2, 1}) {
    if (!(bits & k)) continue;
    const std::size_t per = static_cast<std::size_t>(8 / k), nbytes = (codes.size() + per - 1) / per;
    std::vector<std::uint8_t> shard(nbytes, 0);
    for (std::size_t i = 0; i < codes.size(); ++i) {
      const unsigned part = (codes[i] >> offset) & ((1u << k) - 1u);
      shard[i % nbytes] = static_cast<std::uint8_t>(shard[i % nbytes] | (part << ((i / nbytes) * k)));
    }
    out.insert(out.end(), shard.begin(), shard.end());
    offset += k;
  }
  return out;
}

// Indices of `bits` bits, most significant bit first, padded to a multiple of 8 indices.
std::vector<std::uint8_t> pack_stream(const std::vector<unsigned>& idx, int bits) {
  const std::size_t padded = (idx.size() + 7) / 8 * 8;
  std::vector<std::uint8_t> out(padded / 8 * static_cast<std::size_t>(bits), 0);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    for (int b = 0; b < bits; ++b) {
      const std::size_t g = i * static_cast<std::size_t>(bits) + static_cast<std::size_t>(b);
      const unsigned bit = (idx[i] >> (bits - 1 - b)) & 1u;
      out[g >> 3] = static_cast<std::uint8_t>(out[g >> 3] | (bit << (7 - (g & 7))));
    }
  }
  return out;
}

std::vector<unsigned char> reals(RealType t, const std::vector<float>& v) {
  std::vector<unsigned char> out(v.size() * real_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) store_real(t, v[i], &out[i * real_size(t)]);
  return out;
}

float at(RealType t, const std::vector<unsigned char>& v, std::size_t i) { return decode_real(t, &v[i * real_size(t)]); }

TEST(OstrisDecode, UintxReadsEveryShardLayout) {
  for (int bits = 2; bits <= 8; ++bits) {
    UintxSpec spec;
    spec.rows = 3;
    spec.cols = 10;  // 30 codes: no shard fills its last byte
    spec.bits = bits;
    spec.group = 5;
    spec.orig = RealType::kFloat32;
    spec.out = RealType::kFloat32;
    std::vector<unsigned> codes(spec.rows * spec.cols);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<unsigned>(i * 7 + 3) % (1u << bits);
    const std::vector<std::uint8_t> packed = pack_uintx(codes, bits);
    ASSERT_EQ(packed.size(), uintx_packed_bytes(spec)) << bits;
    std::vector<std::uint8_t> zero(6);
    std::vector<float> scale(6);
    for (std::size_t g = 0; g < 6; ++g) zero[g] = static_cast<std::uint8_t>(g % (1u << bits)), scale[g] = 0.5f * (g + 1);
    const auto s = reals(RealType::kFloat32, scale);
    std::vector<unsigned char> out(codes.size() * 4);
    decode_uintx_host(spec, packed.data(), s.data(), zero.data(), out.data());
    for (std::size_t i = 0; i < codes.size(); ++i) {
      const std::size_t g = (i / 10) * 2 + (i % 10) / 5;
      EXPECT_EQ(at(RealType::kFloat32, out, i), (static_cast<float>(codes[i]) - zero[g]) * scale[g]) << bits << " " << i;
    }
  }
}

TEST(OstrisDecode, UintxRoundsToTheOriginalTypeThenToTheOutput) {
  UintxSpec spec;
  spec.rows = 1;
  spec.cols = 8;
  spec.bits = 8;
  spec.group = 8;
  spec.orig = RealType::kBFloat16;
  spec.out = RealType::kFloat32;
  // 255 * 1.0078125 (1 + 2^-7, exact in bfloat16) = 256.9921875: bfloat16 steps by 2 above 256, so 256.
  const std::vector<unsigned> codes(8, 255);
  const auto packed = pack_uintx(codes, 8);
  const std::vector<std::uint8_t> zero{0};
  const auto s = reals(RealType::kBFloat16, {1.0078125f});
  std::vector<unsigned char> out(8 * 4);
  decode_uintx_host(spec, packed.data(), s.data(), zero.data(), out.data());
  EXPECT_EQ(at(RealType::kFloat32, out, 0), 256.0f);
}

TEST(OstrisDecode, CodebookReadsMostSignificantBitFirstAndScalesPerGroup) {
  for (auto [bits, vec_dim] : {std::pair{2, std::size_t{1}}, {3, 1}, {4, 1}, {12, 4}, {16, 4}, {16, 8}}) {
    CodebookSpec spec;
    spec.rows = 2;
    spec.cols = 16;
    spec.bits = bits;
    spec.vec_dim = vec_dim;
    spec.entries = std::size_t{1} << std::min(bits, 10);
    spec.group = 8;
    spec.scale = RealType::kFloat32;
    spec.out = RealType::kFloat32;
    const std::size_t n_idx = spec.rows * spec.cols / vec_dim;
    std::vector<unsigned> idx(n_idx);
    for (std::size_t i = 0; i < n_idx; ++i) idx[i] = static_cast<unsigned>(i * 5 + 1) % spec.entries;
    const auto packed = pack_stream(idx, bits);
    ASSERT_EQ(packed.size(), codebook_packed_bytes(spec));
    std::vector<float> cb(spec.entries * vec_dim);
    for (std::size_t i = 0; i < cb.size(); ++i) cb[i] = static_cast<float>(i);
    const auto s = reals(RealType::kFloat32, {1.0f, 2.0f, 3.0f, 4.0f});
    std::vector<unsigned char> out(spec.rows * spec.cols * 4);
    decode_codebook_host(spec, packed.data(), cb.data(), s.data(), out.data());
    for (std::size_t e = 0; e < spec.rows * spec.cols; ++e) {
      const float want = cb[idx[e / vec_dim] * vec_dim + e % vec_dim] * static_cast<float>(e / 8 + 1);
      EXPECT_EQ(at(RealType::kFloat32, out, e), want) << bits << "/" << vec_dim << " " << e;
    }
  }
}

TEST(OstrisDecode, CodebookRoundsBothFactorsToTheOutputType) {
  CodebookSpec spec;
  spec.rows = 1;
  spec.cols = 8;
  spec.bits = 1;
  spec.entries = 2;
  spec.group = 8;
  spec.scale = RealType::kFloat32;
  spec.out = RealType::kBFloat16;
  const auto packed = pack_stream({0, 1, 0, 1, 0, 1, 0, 1}, 1);
  const std::vector<float> cb{1.00390625f, -3.0f};  // rounds to 1.0 in bfloat16 (a tie, to even)
  const auto s = reals(RealType::kFloat32, {1.00390625f + 1.0f / 512});  // rounds up to 1.0078125
  std::vector<unsigned char> out(8 * 2);
  decode_codebook_host(spec, packed.data(), cb.data(), s.data(), out.data());
  EXPECT_EQ(at(RealType::kBFloat16, out, 0), 1.0078125f);
  EXPECT_EQ(at(RealType::kBFloat16, out, 1), round_to(RealType::kBFloat16, -3.0f * 1.0078125f));
}

TEST(OstrisDecode, AnIndexPastTheCodebookDecodesAsNaN) {
  CodebookSpec spec;
  spec.rows = 1;
  spec.cols = 8;
  spec.bits = 2;
  spec.entries = 3;
  spec.group = 8;
  spec.scale = RealType::kFloat32;
  spec.out = RealType::kFloat32;
  const auto packed = pack_stream({3, 0, 0, 0, 0, 0, 0, 0}, 2);
  const std::vector<float> cb{1, 2, 3};
  const auto s = reals(RealType::kFloat32, {1.0f});
  std::vector<unsigned char> out(8 * 4);
  decode_codebook_host(spec, packed.data(), cb.data(), s.data(), out.data());
  EXPECT_TRUE(std::isnan(at(RealType::kFloat32, out, 0)));
  EXPECT_EQ(at(RealType::kFloat32, out, 1), 1.0f);
}

TEST(OstrisDecode, RefusesSpecsOutsideTheFormats) {
  UintxSpec u;
  u.rows = 2;
  u.cols = 10;
  u.group = 4;
  EXPECT_THROW(check_uintx_spec(u), InvalidArgument);  // groups do not divide the row
  u.group = 5;
  u.bits = 9;
  EXPECT_THROW(check_uintx_spec(u), InvalidArgument);
  CodebookSpec c;
  c.rows = 1;
  c.cols = 6;
  c.group = 6;
  c.vec_dim = 4;
  EXPECT_THROW(check_codebook_spec(c), InvalidArgument);  // vectors do not divide the weight
  c.vec_dim = 2;
  c.bits = 17;
  EXPECT_THROW(check_codebook_spec(c), InvalidArgument);
}

#ifdef LAYERSTREAM_WITH_CUDA
std::vector<unsigned char> random_reals(RealType t, std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return reals(t, v);
}

class OstrisDecodeCuda : public testing::BackendTest {
 protected:
  // A device copy of `bytes` at `host`, freed after the test.
  void* upload(const void* host, std::size_t bytes, StreamHandle stream) {
    void* ptr = backend().device_alloc(bytes);
    owned_.push_back(ptr);
    PinnedBuffer staging(backend(), bytes, PinMethod::kHostAlloc);
    std::memcpy(staging.data(), host, bytes);
    backend().memcpy_h2d_async(ptr, staging.data(), bytes, stream);
    backend().stream_synchronize(stream);
    return ptr;
  }
  void TearDown() override {
    for (void* p : owned_) backend().device_free(p);
    owned_.clear();
  }
  std::vector<void*> owned_;
};

std::size_t mismatches(RealType t, const std::vector<unsigned char>& want, const std::vector<unsigned char>& got) {
  std::size_t bad = 0;
  const std::size_t w = real_size(t);
  for (std::size_t i = 0; i < want.size() / w; ++i) {
    if (std::isnan(at(t, want, i)) && std::isnan(at(t, got, i))) continue;
    if (std::memcmp(&want[i * w], &got[i * w], w) != 0) ++bad;
  }
  return bad;
}

// Every width, original type and output type over random packed bytes (every code value occurs), rows and
// groups of several lengths: the kernel's bytes equal the reference's.
TEST_P(OstrisDecodeCuda, UintxKernelEqualsTheReference) {
  if (GetParam() != "cuda") GTEST_SKIP() << "the kernels run on the cuda backend only";
  std::mt19937 rng(11);
  const StreamHandle stream = backend().stream_create();
  for (int bits = 2; bits <= 8; ++bits) {
    for (RealType orig : {RealType::kFloat32, RealType::kFloat16, RealType::kBFloat16}) {
      for (RealType out : {RealType::kFloat32, RealType::kFloat16, RealType::kBFloat16}) {
        for (auto [cols, group] : {std::pair{std::size_t{256}, std::size_t{64}}, {std::size_t{72}, std::size_t{24}}}) {
          UintxSpec spec{37, cols, bits, group, orig, out};
          std::vector<std::uint8_t> packed(uintx_packed_bytes(spec)), zero(spec.rows * cols / group);
          for (auto& b : packed) b = static_cast<std::uint8_t>(rng());
          for (auto& z : zero) z = static_cast<std::uint8_t>(rng() % (1u << bits));
          const auto scale = random_reals(orig, zero.size(), rng);
          std::vector<unsigned char> want(spec.rows * cols * real_size(out));
          decode_uintx_host(spec, packed.data(), scale.data(), zero.data(), want.data());
          const auto* d_packed = static_cast<const std::uint8_t*>(upload(packed.data(), packed.size(), stream));
          const auto* d_zero = static_cast<const std::uint8_t*>(upload(zero.data(), zero.size(), stream));
          const void* d_scale = upload(scale.data(), scale.size(), stream);
          void* d_out = backend().device_alloc(want.size());
          decode_uintx_cuda(spec, d_packed, d_scale, d_zero, d_out, stream.raw);
          const std::vector<unsigned char> got = read_back(d_out, want.size(), stream);
          backend().device_free(d_out);
          EXPECT_EQ(mismatches(out, want, got), 0u) << bits << " bits, orig " << static_cast<int>(orig) << " out "
                                                    << static_cast<int>(out) << " cols " << cols;
        }
      }
    }
  }
  backend().stream_destroy(stream);
}

TEST_P(OstrisDecodeCuda, CodebookKernelEqualsTheReference) {
  if (GetParam() != "cuda") GTEST_SKIP() << "the kernels run on the cuda backend only";
  std::mt19937 rng(13);
  const StreamHandle stream = backend().stream_create();
  for (auto [bits, vec_dim] : {std::pair{2, std::size_t{1}}, {3, 1}, {4, 1}, {12, 4}, {16, 4}, {16, 8}}) {
    for (RealType scale_type : {RealType::kFloat32, RealType::kBFloat16}) {
      for (RealType out : {RealType::kFloat32, RealType::kFloat16, RealType::kBFloat16}) {
        for (std::size_t group : {std::size_t{128}, std::size_t{512}}) {
          // Some indices point past the codebook (entries below 2^bits): NaN in both.
          CodebookSpec spec{29, 512, bits, vec_dim, (std::size_t{1} << bits) - 1, group, scale_type, out};
          std::vector<std::uint8_t> packed(codebook_packed_bytes(spec));
          for (auto& b : packed) b = static_cast<std::uint8_t>(rng());
          std::vector<float> cb(spec.entries * vec_dim);
          std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
          for (auto& c : cb) c = dist(rng);
          const auto scale = random_reals(scale_type, spec.rows * spec.cols / group, rng);
          std::vector<unsigned char> want(spec.rows * spec.cols * real_size(out));
          decode_codebook_host(spec, packed.data(), cb.data(), scale.data(), want.data());
          const auto* d_packed = static_cast<const std::uint8_t*>(upload(packed.data(), packed.size(), stream));
          const auto* d_cb = static_cast<const float*>(upload(cb.data(), cb.size() * sizeof(float), stream));
          const void* d_scale = upload(scale.data(), scale.size(), stream);
          void* d_out = backend().device_alloc(want.size());
          decode_codebook_cuda(spec, d_packed, d_cb, d_scale, d_out, stream.raw);
          const std::vector<unsigned char> got = read_back(d_out, want.size(), stream);
          backend().device_free(d_out);
          EXPECT_EQ(mismatches(out, want, got), 0u) << bits << " bits x " << vec_dim << ", scale "
                                                    << static_cast<int>(scale_type) << " out " << static_cast<int>(out)
                                                    << " group " << group;
        }
      }
    }
  }
  backend().stream_destroy(stream);
}

LS_INSTANTIATE_ON_BACKENDS(OstrisDecodeCuda);
#endif

}  // namespace
}  // namespace layerstream
