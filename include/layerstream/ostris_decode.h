// Decoders for AI-Toolkit's OstrisLinear weight formats (toolkit/util/*_quant.py at 27a03a91), so that
// a streamed layer's weight is built by one fused kernel instead of the backend's chain of torch operations
// (each a full pass over the weight, several per call). The result is bit for bit the weight the backend's
// own forward builds; the glue proves that on each layer's first call before it uses the decoder there.
//
// uintx (uint2..uint8): codes of `bits` bits, split into power-of-two shards in the order 8, 4, 2, 1 bits
//   (shard k present when bits & k; the first shard holds the code's lowest bits). A k-bit shard of n codes
//   is ceil(n / (8 / k)) bytes; code i's k bits are bits [j*k, j*k + k) of byte i % nbytes, j = i / nbytes.
//   One scale (in the weight's original type) and one uint8 zero point per `group` columns of a row:
//     w[r, c] = to_out( to_orig( float(code - zero[r, c / group]) * float(scale[r, c / group]) ) )
//   (the difference is an integer in [-255, 255], exact in every type here).
// codebook (orbit2..4, orbitvq2..4): indices of `bits` bits (at most 16) in one bitstream, most significant bit
//   first, each picking a row of `vec_dim` float32 values of a codebook; `n` indices pad to a multiple of 8, so
//   the stream is n_padded / 8 * bits bytes. One scale per `group` columns of a row (orbit: group = cols,
//   its row norms):
//     w[r, c] = to_out( float(to_out(cb[idx[e / vec_dim], e % vec_dim])) * float(to_out(scale[r, c / group])) ),
//   e = r * cols + c. A product of two values of the output type is rounded once to it, as a torch multiply of
//   two such tensors is (float math, one rounding); in float32 it is the float product.
// nvfp4 (nvfp4, and convrot4's rotated weight): e2m1 codes two per byte (the low nibble the even column; code
//   bits: sign 8, magnitude index 0..7 into [0, .5, 1, 1.5, 2, 3, 4, 6]), one e4m3 scale byte per 16 columns
//   of a row, one float32 tensor scale `pts`:
//     w[r, c] = to_out( e2m1(code) * (e4m3(scale[r, c / 16]) * pts) )   (float products, each rounded once)
//   where code 8 (a zero with the sign bit) is -0, as AI-Toolkit's torch path gives it (magnitude times -1), or
//   +0 with `plus_zero`, as its Triton kernel gives it (its negation of a zero magnitude is +0).
//
// And the straight-through activation of convrot4 where the GPU has no fp4 matmul (AI-Toolkit quantizes the
// rotated input to nvfp4 with per-16 amax scales and multiplies by the dequantized value): for x [rows, cols]
// (cols a multiple of 16), `pts` the float32 tensor scale the caller computed as the backend does (from
// amax |x|), and each block b of 16 values of a row:
//     d = 6 * pts;  s = e4m3(amax_b |x| / d);  q = float(s) * pts;  safe = q > 0 ? q : 1
//     z = clamp(x / safe, -6, 6);  m = #{edges e : !(e >= |z|)} over [.25, .75, 1.25, 1.75, 2.5, 3.5, 5]
//     x_dq = to_x( (z < 0 ? -e2m1(m) : e2m1(m)) * q );  delta = to_x( float(x_dq) - float(x) )
//   `delta` is what the backend's `x_dq - x` holds: the caller adds it to x (torch's add, so autograd and the
//   rounding are the backend's own). Every operation is float32 and correctly rounded, a NaN propagates
//   through the maxima and the clamp, and e4m3(v) is torch's conversion: nearest even, a NaN to 0x7f, and
//   from 464 up either 448 (`e4m3_saturates`, as recent torch releases do) or NaN (as older ones do; the glue
//   asks the running torch which).
//
// And the weight the ConvRot int backends' training backward multiplies the gradient by (convrot8,
// convrotint2..8, convrotbitnet, convrotcomfyw4a4: their forward is an int8 matmul, their backward the
// straight-through `grad @ (code8 * scale[r])`), from the stored codes:
//   int8:     one int8 code per value (convrot8).
//   bitfield: codes of `bits` bits (2..8), eight of them along a row in `bits` bytes: the bytes are one
//             little-endian word, code j its bits [j*bits, j*bits + bits), offset by qmax = 2^(bits-1) - 1
//             (code = field - qmax). A row is cols / 8 * bits bytes.
//   ternary:  five codes per byte in base 3 (digit j = byte / 3^j % 3, code = digit - 1); a row is
//             ceil(cols / 5) bytes (convrotbitnet).
//   With float32 ratios, one per `group` columns of a row (the widths up to 7 bits, bitnet), the code is put on
//   the row's int8 grid first: code8 = clamp(rint(float(code) * ratio[r, c / group]), -127, 127), an integer
//   (a product that rounds to zero gives +0, never -0: the backend holds these codes as int8); else
//   code8 = code. Then, with one float32 scale per row:
//     w[r, c] = to_out( float(code8) * float(to_out(scale[r])) )   (the product is exact in float; one rounding)
//
// Two implementations with identical results: the host reference (the sim backend computes with it, so CI
// runs it) and the CUDA kernels (one thread per output value; read the packed bytes once, write the weight
// once). Neither allocates. Pointers: every input is read only, `out` (rows * cols values of the output type,
// row-major) is written only; on CUDA all of them are device memory the caller keeps alive until the work
// enqueued on `stream` has run.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "layerstream/dequant.h"

namespace layerstream {

struct UintxSpec {
  std::size_t rows = 0;
  std::size_t cols = 0;
  int bits = 4;            // 2..8
  std::size_t group = 64;  // columns per scale and zero point; divides cols
  RealType orig = RealType::kBFloat16;  // the scale's type (the weight's original one)
  RealType out = RealType::kBFloat16;
};

struct CodebookSpec {
  std::size_t rows = 0;
  std::size_t cols = 0;
  int bits = 4;                 // index bits, 1..16
  std::size_t vec_dim = 1;      // values per index; divides rows * cols
  std::size_t entries = 16;     // codebook rows (indices must be below it)
  std::size_t group = 0;        // columns per scale; divides cols
  RealType scale = RealType::kBFloat16;
  RealType out = RealType::kBFloat16;
};

struct Nvfp4Spec {
  std::size_t rows = 0;
  std::size_t cols = 0;  // a multiple of 16
  RealType out = RealType::kBFloat16;
  bool plus_zero = false;  // code 8 decodes as +0 (else -0); see above
};

struct IntRowsSpec {
  enum class Codes : std::uint8_t { kInt8, kBitfield, kTernary };
  std::size_t rows = 0;
  std::size_t cols = 0;     // a multiple of 8 for bitfield codes
  Codes codes = Codes::kInt8;
  int bits = 8;             // bitfield: 2..8
  std::size_t group = 0;    // columns per ratio; 0: no ratios
  RealType out = RealType::kBFloat16;
};

struct FakeQuantSpec {
  std::size_t rows = 0;
  std::size_t cols = 0;  // a multiple of 16
  RealType type = RealType::kBFloat16;  // of x and delta
  bool e4m3_saturates = true;
};

// Bytes of the packed codes a spec reads (what the backend's buffer must hold); for uintx also per shard of
// 8, 4, 2 and 1 bits, in that order (0 for a shard the width has not).
std::array<std::size_t, 4> uintx_shard_bytes(const UintxSpec& spec);
std::size_t uintx_packed_bytes(const UintxSpec& spec);
std::size_t codebook_packed_bytes(const CodebookSpec& spec);
std::size_t int_rows_packed_bytes(const IntRowsSpec& spec);

// Throw InvalidArgument naming what is wrong when a spec is not one of the formats above.
void check_uintx_spec(const UintxSpec& spec);
void check_codebook_spec(const CodebookSpec& spec);
void check_nvfp4_spec(const Nvfp4Spec& spec);
void check_fake_quant_spec(const FakeQuantSpec& spec);
void check_int_rows_spec(const IntRowsSpec& spec);

// torch's float32 -> float8_e4m3fn conversion (see above); back is dequant.h's decode_code.
std::uint8_t e4m3_from_float(float v, bool saturates);

void decode_uintx_host(const UintxSpec& spec, const std::uint8_t* packed, const void* scale,
                       const std::uint8_t* zero, void* out);
// An index at or above spec.entries reads no memory: its values decode as NaN (the backend's own index_select
// would raise; the glue's first-call proof then turns the decoder off for that layer).
void decode_codebook_host(const CodebookSpec& spec, const std::uint8_t* packed, const float* codebook,
                          const void* scale, void* out);
// `packed` rows * cols / 2 bytes, `scales` rows * cols / 16 e4m3 bytes, `pts` one float.
void decode_nvfp4_host(const Nvfp4Spec& spec, const std::uint8_t* packed, const std::uint8_t* scales,
                       const float* pts, void* out);
void fake_quant_nvfp4_host(const FakeQuantSpec& spec, const void* x, const float* pts, void* delta);
// `ratio` rows * (cols / group) floats (null when spec.group is 0), `scale` rows floats; both any alignment on
// the host (byte views of the backend's buffers), 4-byte aligned on the device.
void decode_int_rows_host(const IntRowsSpec& spec, const std::uint8_t* packed, const float* ratio, const float* scale,
                          void* out);

#ifdef LAYERSTREAM_WITH_CUDA
// Enqueue the kernel on `stream` (a cudaStream_t) of the current device; return at once.
void decode_uintx_cuda(const UintxSpec& spec, const std::uint8_t* packed, const void* scale,
                       const std::uint8_t* zero, void* out, void* stream);
void decode_codebook_cuda(const CodebookSpec& spec, const std::uint8_t* packed, const float* codebook,
                          const void* scale, void* out, void* stream);
// `pts` is device memory here too (read by the kernel: no synchronization).
void decode_nvfp4_cuda(const Nvfp4Spec& spec, const std::uint8_t* packed, const std::uint8_t* scales,
                       const float* pts, void* out, void* stream);
void fake_quant_nvfp4_cuda(const FakeQuantSpec& spec, const void* x, const float* pts, void* delta, void* stream);
void decode_int_rows_cuda(const IntRowsSpec& spec, const std::uint8_t* packed, const float* ratio, const float* scale,
                          void* out, void* stream);
#endif

}  // namespace layerstream
