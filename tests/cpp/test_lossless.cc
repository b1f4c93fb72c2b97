// Lossless bfloat16 packing: the table, the layout (against a one-value-at-a-time encoder written here),
// exact round trips of every bit pattern, and on a GPU the kernels against the host reference bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "backends.h"
#include "layerstream/check.h"
#include "layerstream/dequant.h"
#include "layerstream/lossless.h"

namespace layerstream {
namespace {

std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

std::vector<std::uint16_t> normal_bf16(std::size_t n, float stddev, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16_bits(dist(rng));
  return v;
}

std::vector<std::uint8_t> encode(const std::vector<std::uint16_t>& v, LosslessSpec* spec_out = nullptr) {
  const LosslessSpec spec = lossless_plan(v.data(), v.size());
  std::vector<std::uint8_t> buf(spec.bytes(), 0xAB);  // the encoder must write every byte, padding too
  lossless_encode(spec, v.data(), buf.data());
  if (spec_out) *spec_out = spec;
  return buf;
}

std::vector<std::uint16_t> decode(const LosslessSpec& spec, const std::vector<std::uint8_t>& buf) {
  std::vector<std::uint16_t> out(spec.count, 0xFFFF);
  lossless_decode_host(spec, buf.data(), out.data());
  return out;
}

// The layout of lossless.h, one value at a time, for the table `spec` holds.
std::vector<std::uint8_t> reference_encoding(const LosslessSpec& spec, const std::vector<std::uint16_t>& v) {
  std::vector<std::uint8_t> buf(spec.bytes(), 0);
  std::vector<std::uint32_t> list;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const unsigned e = (v[i] >> 7) & 0xFF;
    buf[i] = static_cast<std::uint8_t>(((v[i] >> 8) & 0x80) | (v[i] & 0x7F));
    unsigned code = LosslessSpec::kException;
    for (unsigned c = 0; c < LosslessSpec::kException; ++c) {
      if (spec.exponent[c] == e) {
        code = c;
        break;
      }
    }
    buf[spec.codes_offset() + i / 2] |= static_cast<std::uint8_t>(code << (4 * (i % 2)));
    if (code == LosslessSpec::kException) {
      list.push_back(static_cast<std::uint32_t>(i));
      list.push_back(e);
    }
  }
  std::memcpy(buf.data() + spec.exceptions_offset(), list.data(), list.size() * 4);
  return buf;
}

TEST(Lossless, EveryBitPatternRoundTripsExactly) {
  // All 65536 patterns (NaNs with their payloads, infinities, subnormals, both zeros), shuffled: 256
  // exponents, so all but fifteen of them are exceptions.
  std::vector<std::uint16_t> v(65536);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint16_t>(i);
  std::shuffle(v.begin(), v.end(), std::mt19937(3));
  LosslessSpec spec;
  const std::vector<std::uint8_t> buf = encode(v, &spec);
  EXPECT_EQ(spec.exceptions, 65536u - 15u * 256u);  // every exponent holds 256 patterns
  EXPECT_EQ(decode(spec, buf), v);
  EXPECT_EQ(buf, reference_encoding(spec, v));
}

TEST(Lossless, WeightLikeValuesTakeThreeQuartersOfTheBytes) {
  const std::size_t n = 3 * 1024 * 1024 + 5;  // several encoder threads where there are cores; odd
  const std::vector<std::uint16_t> v = normal_bf16(n, 0.02f, 1);
  LosslessSpec spec;
  const std::vector<std::uint8_t> buf = encode(v, &spec);
  // Outside N(0, s)'s fifteen most frequent octaves: |x| below 2^-13 s or above 4 s, about 1.6e-4 of them.
  EXPECT_LT(spec.exceptions, n / 2000);
  EXPECT_EQ(spec.bytes(), align16(n) + align16((n + 1) / 2) + 8 * spec.exceptions);
  EXPECT_LT(static_cast<double>(spec.bytes()), 0.751 * 2.0 * static_cast<double>(n));
  EXPECT_EQ(buf, reference_encoding(spec, v));
  EXPECT_EQ(decode(spec, buf), v);
}

TEST(Lossless, TheTableHoldsTheFifteenMostFrequentExponents) {
  // Exponent 100 + k appears k + 1 times for k = 0..15: 100 (once) is the one left out.
  std::vector<std::uint16_t> v;
  for (unsigned k = 0; k < 16; ++k) {
    for (unsigned r = 0; r <= k; ++r) v.push_back(static_cast<std::uint16_t>(((100 + k) << 7) | (r & 0x7F)));
  }
  std::reverse(v.begin(), v.end());
  LosslessSpec spec;
  const std::vector<std::uint8_t> buf = encode(v, &spec);
  ASSERT_EQ(spec.exceptions, 1u);
  for (unsigned c = 0; c < 15; ++c) EXPECT_EQ(spec.exponent[c], 115 - c) << "code " << c;  // most frequent first
  std::uint32_t entry[2];
  std::memcpy(entry, buf.data() + spec.exceptions_offset(), sizeof entry);
  EXPECT_EQ(entry[0], v.size() - 1);
  EXPECT_EQ(entry[1], 100u);
  EXPECT_EQ(decode(spec, buf), v);
}

TEST(Lossless, FewExponentsNeedNoExceptionsAndShortTensorsWork) {
  for (std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{9}, std::size_t{17},
                        std::size_t{33}}) {
    std::vector<std::uint16_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = i % 3 == 0 ? 0x0000 : i % 3 == 1 ? 0x8000 : 0x3F80;  // 0, -0, 1
    LosslessSpec spec;
    const std::vector<std::uint8_t> buf = encode(v, &spec);
    EXPECT_EQ(spec.exceptions, 0u);
    EXPECT_EQ(decode(spec, buf), v) << n;
    EXPECT_EQ(buf, reference_encoding(spec, v)) << n;
  }
}

TEST(Lossless, TheEncodingIsTheSameForAnyNumberOfThreads) {
  // Several chunks (the encoder splits by a fixed length), an odd count, and spread exponents (exceptions
  // in every chunk): one thread, two, seven and one per core write the same bytes, the layout's own.
  std::vector<std::uint16_t> v = normal_bf16((std::size_t{3} << 20) + 12345, 0.02f, 21);
  std::mt19937 rng(4);
  for (std::size_t i = 0; i < v.size(); i += 997) v[i] = static_cast<std::uint16_t>(rng() & 0xFFFF);
  std::vector<std::vector<std::uint8_t>> seen;
  LosslessSpec spec;
  for (unsigned threads : {1u, 2u, 7u, 0u}) {
    lossless_set_threads(threads);
    seen.push_back(encode(v, &spec));
    EXPECT_GT(spec.exceptions, 0u);
  }
  lossless_set_threads(0);  // the default again
  for (const auto& buf : seen) EXPECT_EQ(buf, seen.front());
  EXPECT_EQ(seen.front(), reference_encoding(spec, v));
  EXPECT_EQ(decode(spec, seen.front()), v);
}

TEST(Lossless, RefusesNoValuesAndASpecOfOtherValues) {
  const std::uint16_t one = 0x3F80;
  EXPECT_THROW(lossless_plan(&one, 0), InvalidArgument);
  const std::vector<std::uint16_t> a(64, 0x3F80);
  std::vector<std::uint16_t> b(64);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint16_t>(i << 9);  // many exponents
  const LosslessSpec spec = lossless_plan(a.data(), a.size());
  std::vector<std::uint8_t> buf(spec.bytes() + 64 * 8);
  try {
    lossless_encode(spec, b.data(), buf.data());
    FAIL() << "encoded values with another tensor's spec";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("exceptions"), std::string::npos) << e.what();
  }
}

TEST(Lossless, ExceptionsAtChunkAndBlockEdgesAndOddSizesOnManyThreads) {
  // The encoder splits the values into chunks of 2^16 (blocks of 16 within them); exceptions on either side
  // of every edge, and counts that end a value before, on and after an edge, on more threads than chunks
  // and more than cores: every encoding is the layout's own.
  // Weight-like values take the encoder's window path (their table's exponents are 16 neighbours); with a
  // third of them exact zeros (exponent 0 in the table too) the per-value lookup.
  const std::size_t chunk = std::size_t{1} << 16;
  for (bool zeros : {false, true}) {
  for (std::size_t n : {chunk - 1, chunk, chunk + 1, 3 * chunk + 15, 3 * chunk + 16, 3 * chunk + 17,
                        (std::size_t{1} << 20) + 3}) {
    std::vector<std::uint16_t> v = normal_bf16(n, 0.02f, static_cast<unsigned>(n));
    if (zeros) {
      for (std::size_t i = 0; i < n; i += 3) v[i] = 0;
    }
    std::vector<std::size_t> at{0, 1, 15, 16, 17, n - 1, n - 2};
    for (std::size_t edge = chunk; edge < n + 1; edge += chunk) {
      for (std::size_t d : {std::size_t{0}, std::size_t{1}}) {
        if (edge - 1 - d < n) at.push_back(edge - 1 - d);
        if (edge + d < n) at.push_back(edge + d);
      }
    }
    for (std::size_t i : at) v[i] = static_cast<std::uint16_t>((v[i] & 0x807F) | (3u << 7));  // exponent 3: rare
    std::vector<std::vector<std::uint8_t>> seen;
    LosslessSpec spec;
    for (unsigned threads : {1u, 3u, 33u}) {
      lossless_set_threads(threads);
      seen.push_back(encode(v, &spec));
    }
    lossless_set_threads(0);
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
    EXPECT_GE(spec.exceptions, at.size()) << n;
    const std::vector<std::uint8_t> want = reference_encoding(spec, v);
    for (const auto& buf : seen) EXPECT_EQ(buf, want) << n << (zeros ? " with zeros" : "");
    EXPECT_EQ(decode(spec, seen.front()), v) << n;
    EXPECT_EQ(spec.exponent[0] == 0, zeros) << n;  // the zeros' exponent is the most frequent
    const auto [lowest, highest] = std::minmax_element(spec.exponent.begin(), spec.exponent.begin() + 15);
    EXPECT_EQ(*highest - *lowest <= 15, !zeros) << n;  // a window of 16 exponents, or not
  }
  }
}

TEST(Lossless, EveryShortCountAndEveryExceptionPlaceWithinABlock) {
  // Counts 1..40 (whole blocks, a block and a tail, tails alone), each with one exception at each place.
  for (std::size_t n = 1; n <= 40; ++n) {
    for (std::size_t at = 0; at < n; ++at) {
      std::vector<std::uint16_t> v(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint16_t>(((120 + i % 15) << 7) | (i * 37 & 0x807F));
      v[at] = static_cast<std::uint16_t>((v[at] & 0x807F) | (200u << 7));  // a sixteenth exponent, once
      LosslessSpec spec;
      const std::vector<std::uint8_t> buf = encode(v, &spec);
      if (n >= 30) {  // fifteen exponents, each left at least once (ties go to the smaller): 200 is out
        ASSERT_EQ(spec.exceptions, 1u) << n << " " << at;
      }
      EXPECT_EQ(buf, reference_encoding(spec, v)) << n << " " << at;
      EXPECT_EQ(decode(spec, buf), v) << n << " " << at;
    }
  }
}

TEST(Lossless, ConcurrentCallersGetTheirOwnEncodings) {
  // Two threads encode different tensors at once through the one worker pool.
  lossless_set_threads(4);
  const std::vector<std::uint16_t> a = normal_bf16((std::size_t{5} << 16) + 7, 0.02f, 31);
  const std::vector<std::uint16_t> b = normal_bf16((std::size_t{3} << 16) + 1, 1.0f, 32);
  std::vector<std::vector<std::uint8_t>> got_a(8), got_b(8);
  LosslessSpec spec_a, spec_b;
  std::thread other([&] {
    for (auto& g : got_b) g = encode(b, &spec_b);
  });
  for (auto& g : got_a) g = encode(a, &spec_a);
  other.join();
  lossless_set_threads(0);
  for (const auto& g : got_a) EXPECT_EQ(g, reference_encoding(spec_a, a));
  for (const auto& g : got_b) EXPECT_EQ(g, reference_encoding(spec_b, b));
}

#ifdef LAYERSTREAM_WITH_CUDA
class LosslessCuda : public testing::BackendTest {};

// The kernels against the reference: weight-like values (the wide path, few exceptions), every bit pattern
// (most values exceptions), odd counts (the scalar tail), and a buffer only 4-byte aligned (the narrow path).
TEST_P(LosslessCuda, KernelsEqualTheReferenceBitForBit) {
  if (GetParam() != "cuda") GTEST_SKIP() << "the kernels run on the cuda backend only";
  const StreamHandle stream = backend().stream_create();
  std::vector<std::vector<std::uint16_t>> inputs{normal_bf16(1 << 20, 0.02f, 2), normal_bf16(1001, 3.0f, 4)};
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  std::shuffle(all.begin(), all.end(), std::mt19937(5));
  inputs.push_back(all);
  for (const auto& v : inputs) {
    // max_blocks 0: as many as the values need; 1 and 3: each block loops over many groups (the derive
    // stream's narrow decode).
    for (auto [offset, max_blocks] : {std::pair<std::size_t, unsigned>{0, 0}, {4, 0}, {0, 1}, {0, 3}, {4, 3}}) {
      LosslessSpec spec;
      const std::vector<std::uint8_t> buf = encode(v, &spec);
      void* d_block = backend().device_alloc(buf.size() + offset);
      void* d_in = static_cast<unsigned char*>(d_block) + offset;
      void* d_out = backend().device_alloc(v.size() * 2);
      PinnedBuffer h_in(backend(), buf.size(), PinMethod::kHostAlloc);
      std::memcpy(h_in.data(), buf.data(), buf.size());
      backend().memcpy_h2d_async(d_in, h_in.data(), buf.size(), stream);
      lossless_decode_cuda(spec, d_in, d_out, stream.raw, max_blocks);
      const std::vector<unsigned char> got = read_back(d_out, v.size() * 2, stream);
      backend().device_free(d_block);
      backend().device_free(d_out);
      EXPECT_EQ(std::memcmp(got.data(), v.data(), got.size()), 0)
          << v.size() << " values, " << spec.exceptions << " exceptions, offset " << offset << ", at most "
          << max_blocks << " blocks";
    }
  }
  backend().stream_destroy(stream);
}

LS_INSTANTIATE_ON_BACKENDS(LosslessCuda);
#endif

}  // namespace
}  // namespace layerstream
