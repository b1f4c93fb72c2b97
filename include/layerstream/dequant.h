// Dequantization of 8-bit weight codes with a scale per row (or one scale for the whole tensor):
//
//   out[r, c] = to_out( to_math( float(code[r, c]) * float(scale[per_row ? r : 0]) ) )
//
// float(code) is exact for every code type here, and so is float(scale); the product is rounded once to
// the math type (as a torch multiply of two tensors of that type does: it computes in float and rounds),
// then once more to the output type. These are the formulas of optimum-quanto (scale * codes.to(scale
// dtype)) and torchao (codes.to(float32) * scale, then .to(output dtype)), so a result is bitwise the
// library's own dequantize() where the spec matches it.
//
// Two implementations with identical results: dequantize_host (the reference; the sim backend computes
// with it, so CI runs it) and dequantize_cuda (one fused kernel: read the codes once, write the output
// once; no temporaries). Neither allocates. Rows are `cols` codes each, row-major and contiguous; conv
// weights [out, in, kh, kw] are rows of in*kh*kw.
#pragma once

#include <cstddef>
#include <cstdint>

namespace layerstream {

enum class CodeType : std::uint8_t { kFloat8E4M3, kFloat8E5M2, kInt8 };
enum class RealType : std::uint8_t { kFloat32, kFloat16, kBFloat16 };

struct DequantSpec {
  CodeType code = CodeType::kFloat8E4M3;
  RealType scale = RealType::kFloat32;  // the scale tensor's type
  RealType math = RealType::kFloat32;   // the product is rounded to this type...
  RealType out = RealType::kBFloat16;   // ...and then to this one (the output tensor's type)
  std::size_t rows = 0;
  std::size_t cols = 0;
  bool per_row = true;  // false: scale holds one value for every row
};

// Throws InvalidArgument when the spec is not one the formula above computes exactly (the scale must be
// exact in the math type: the same type, or float32 math).
void check_dequant_spec(const DequantSpec& spec);

std::size_t real_size(RealType t);
const char* code_name(CodeType t);

// Scalar conversions used by the reference (round to nearest even, as torch and the CUDA intrinsics do).
float decode_code(CodeType t, std::uint8_t bits);
float decode_real(RealType t, const void* at);
std::uint16_t float_to_bf16_bits(float v);
std::uint16_t float_to_fp16_bits(float v);
float round_to(RealType t, float v);
// Writes v rounded to t (nearest even) at `at` (real_size(t) bytes, any alignment).
void store_real(RealType t, float v, void* at);

void dequantize_host(const DequantSpec& spec, const void* codes, const void* scale, void* out);

#ifdef LAYERSTREAM_WITH_CUDA
// Enqueues the kernel on `stream` (a cudaStream_t) of the current device; returns at once.
void dequantize_cuda(const DequantSpec& spec, const void* codes, const void* scale, void* out, void* stream);
#endif

}  // namespace layerstream
