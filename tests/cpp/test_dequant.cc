// The dequantization reference (exact conversions, round-to-nearest-even) and, on a GPU, the fused
// kernel against it bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends.h"
#include "layerstream/check.h"
#include "layerstream/dequant.h"

namespace layerstream {
namespace {

TEST(Dequant, DecodesFloat8E4M3) {
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0x38), 1.0f);
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0xB8), -1.0f);
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0x7E), 448.0f);            // largest finite
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(decode_code(CodeType::kFloat8E4M3, 0x3D), 1.625f);
  EXPECT_TRUE(std::isnan(decode_code(CodeType::kFloat8E4M3, 0x7F)));
  EXPECT_TRUE(std::isnan(decode_code(CodeType::kFloat8E4M3, 0xFF)));
}

TEST(Dequant, DecodesFloat8E5M2AndInt8) {
  EXPECT_EQ(decode_code(CodeType::kFloat8E5M2, 0x3C), 1.0f);
  EXPECT_EQ(decode_code(CodeType::kFloat8E5M2, 0x7B), 57344.0f);
  EXPECT_EQ(decode_code(CodeType::kFloat8E5M2, 0x01), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(decode_code(CodeType::kFloat8E5M2, 0x7C)));
  EXPECT_EQ(decode_code(CodeType::kInt8, 0x80), -128.0f);
  EXPECT_EQ(decode_code(CodeType::kInt8, 0x7F), 127.0f);
  EXPECT_EQ(decode_code(CodeType::kInt8, 0xFF), -1.0f);
}

TEST(Dequant, RoundsToNearestEven) {
  // bfloat16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (odd): goes to 1.
  EXPECT_EQ(round_to(RealType::kBFloat16, 1.0f + std::ldexp(1.0f, -8)), 1.0f);
  EXPECT_EQ(round_to(RealType::kBFloat16, 1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(round_to(RealType::kBFloat16, 1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  // float16: 11 significant bits, largest finite 65504, subnormals down to 2^-24.
  EXPECT_EQ(round_to(RealType::kFloat16, 1.0f + std::ldexp(1.0f, -11)), 1.0f);
  EXPECT_EQ(round_to(RealType::kFloat16, 1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(round_to(RealType::kFloat16, 65519.0f), 65504.0f);
  EXPECT_TRUE(std::isinf(round_to(RealType::kFloat16, 65520.0f)));
  EXPECT_EQ(round_to(RealType::kFloat16, std::ldexp(1.0f, -25)), 0.0f);  // tie with 0: even
  EXPECT_EQ(round_to(RealType::kFloat16, std::ldexp(1.5f, -25)), std::ldexp(1.0f, -24));
  EXPECT_EQ(round_to(RealType::kFloat16, std::ldexp(3.0f, -25)), std::ldexp(1.0f, -23));  // tie: even
  EXPECT_EQ(round_to(RealType::kFloat16, std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), std::ldexp(1.0f, -14));
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_TRUE(std::isnan(round_to(RealType::kFloat16, std::nanf(""))));
}

TEST(Dequant, HostAppliesTheScalePerRowThenRoundsTwice) {
  // int8 codes, bfloat16 scales and math, float32 output: out = bf16(code * scale) exactly.
  const std::int8_t codes[6] = {1, -2, 3, 127, -128, 0};
  const std::uint16_t scales[2] = {float_to_bf16_bits(0.5f), float_to_bf16_bits(1.0f / 3.0f)};
  float out[6];
  DequantSpec spec;
  spec.code = CodeType::kInt8;
  spec.scale = spec.math = RealType::kBFloat16;
  spec.out = RealType::kFloat32;
  spec.rows = 2;
  spec.cols = 3;
  dequantize_host(spec, codes, scales, out);
  const float third = decode_real(RealType::kBFloat16, &scales[1]);
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -1.0f);
  EXPECT_EQ(out[2], 1.5f);
  EXPECT_EQ(out[3], round_to(RealType::kBFloat16, 127.0f * third));
  EXPECT_EQ(out[4], round_to(RealType::kBFloat16, -128.0f * third));
  EXPECT_EQ(out[5], 0.0f);
  // One scale for every row.
  spec.per_row = false;
  dequantize_host(spec, codes, scales, out);
  EXPECT_EQ(out[3], 63.5f);
}

TEST(Dequant, RefusesASpecItCannotComputeExactly) {
  DequantSpec spec;
  spec.rows = spec.cols = 1;
  spec.scale = RealType::kFloat32;
  spec.math = RealType::kBFloat16;  // a float32 scale is not exact in bfloat16
  EXPECT_THROW(check_dequant_spec(spec), InvalidArgument);
  spec.math = RealType::kFloat32;
  spec.rows = 0;
  EXPECT_THROW(check_dequant_spec(spec), InvalidArgument);
}

#ifdef LAYERSTREAM_WITH_CUDA
class DequantCuda : public testing::BackendTest {};

// Every code type x output type x math type, rows of 16k codes (16-wide path), of 8k (8-wide path) and of
// odd lengths (scalar path), codes at an address aligned to 16 or only to 8 (the 8-wide path again), per-row
// and single scales: the kernel's bytes equal the reference's.
TEST_P(DequantCuda, KernelEqualsTheReferenceBitForBit) {
  if (GetParam() != "cuda") GTEST_SKIP() << "the kernel runs on the cuda backend only";
  std::mt19937 rng(7);
  const StreamHandle stream = backend().stream_create();
  for (CodeType code : {CodeType::kFloat8E4M3, CodeType::kFloat8E5M2, CodeType::kInt8}) {
    for (RealType out_type : {RealType::kFloat32, RealType::kFloat16, RealType::kBFloat16}) {
      for (RealType scale_type : {RealType::kFloat32, RealType::kBFloat16, RealType::kFloat16}) {
        for (std::size_t cols : {std::size_t{64}, std::size_t{24}, std::size_t{13}}) {
          for (std::size_t offset : {std::size_t{0}, std::size_t{8}}) {
            for (bool per_row : {true, false}) {
              DequantSpec spec;
              spec.code = code;
              spec.scale = scale_type;
              spec.math = scale_type;
              spec.out = out_type;
              spec.rows = 37;
              spec.cols = cols;
              spec.per_row = per_row;
              const std::size_t n = spec.rows * cols;
              std::vector<std::uint8_t> codes(n);
              for (auto& c : codes) c = static_cast<std::uint8_t>(rng());
              std::vector<unsigned char> scales(spec.rows * real_size(scale_type));
              std::uniform_real_distribution<float> dist(1e-4f, 3.0f);
              for (std::size_t r = 0; r < spec.rows; ++r) {
                const float s = dist(rng);
                if (scale_type == RealType::kFloat32) std::memcpy(&scales[r * 4], &s, 4);
                if (scale_type == RealType::kBFloat16) {
                  const std::uint16_t h = float_to_bf16_bits(s);
                  std::memcpy(&scales[r * 2], &h, 2);
                }
                if (scale_type == RealType::kFloat16) {
                  const std::uint16_t h = float_to_fp16_bits(s);
                  std::memcpy(&scales[r * 2], &h, 2);
                }
              }
              const std::size_t out_bytes = n * real_size(out_type);
              std::vector<unsigned char> expected(out_bytes);
              dequantize_host(spec, codes.data(), scales.data(), expected.data());

              void* d_codes_block = backend().device_alloc(n + offset);
              void* d_codes = static_cast<unsigned char*>(d_codes_block) + offset;
              void* d_scales = backend().device_alloc(scales.size());
              void* d_out = backend().device_alloc(out_bytes);
              PinnedBuffer h_codes(backend(), n, PinMethod::kHostAlloc);
              PinnedBuffer h_scales(backend(), scales.size(), PinMethod::kHostAlloc);
              std::memcpy(h_codes.data(), codes.data(), n);
              std::memcpy(h_scales.data(), scales.data(), scales.size());
              backend().memcpy_h2d_async(d_codes, h_codes.data(), n, stream);
              backend().memcpy_h2d_async(d_scales, h_scales.data(), scales.size(), stream);
              dequantize_cuda(spec, d_codes, d_scales, d_out, stream.raw);
              const std::vector<unsigned char> got = read_back(d_out, out_bytes, stream);
              backend().device_free(d_codes_block);
              backend().device_free(d_scales);
              backend().device_free(d_out);
              // NaN codes decode to a NaN whose payload may differ; compare the rest bit for bit.
              std::size_t mismatches = 0;
              const std::size_t width = real_size(out_type);
              for (std::size_t i = 0; i < n; ++i) {
                const float e = decode_real(out_type, &expected[i * width]);
                if (std::isnan(e) && std::isnan(decode_real(out_type, &got[i * width]))) continue;
                if (std::memcmp(&expected[i * width], &got[i * width], width) != 0) ++mismatches;
              }
              EXPECT_EQ(mismatches, 0u) << code_name(code) << " out " << static_cast<int>(out_type) << " scale "
                                        << static_cast<int>(scale_type) << " cols " << cols << " per_row "
                                        << per_row << " offset " << offset;
            }
          }
        }
      }
    }
  }
  backend().stream_destroy(stream);
}

LS_INSTANTIATE_ON_BACKENDS(DequantCuda);
#endif

}  // namespace
}  // namespace layerstream
