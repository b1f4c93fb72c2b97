// Lossless packing of bfloat16 weights: the exact values in about 12 bits each instead of 16, so a
// streamed weight crosses the bus in three quarters of its bytes and is rebuilt on the device bit for bit.
//
// A bfloat16 is a sign bit, an 8-bit exponent and a 7-bit mantissa. Sign and mantissa carry about eight
// bits of information and are stored as they are, one byte per value. The exponent carries far fewer:
// trained and randomly initialised weights alike use a handful of exponents (a few octaves around the
// tensor's scale, and a tail of ever rarer small ones). Each tensor gets its own table of its fifteen most
// frequent exponents; a value's exponent is stored as its 4-bit index in that table, and code 15 marks a
// value whose exponent is not in it ("an exception": its index and exponent are listed at the end).
//
// Encoded buffer (every section starts 16-byte aligned, relative to the buffer's start):
//   [low bytes: count x (sign << 7 | mantissa)]
//   [codes: ceil(count / 2) bytes; value 2j in the low nibble of byte j, value 2j+1 in the high one]
//   [exceptions: `exceptions` entries of two uint32, the value's index then its exponent; by index]
// The table travels in the spec, not in the buffer.
//
// Two decoders with identical results: lossless_decode_host (the reference; the sim backend runs it, so
// CI does) and lossless_decode_cuda (two kernels on one stream: every value from the table, then the
// exceptions patched). Neither allocates. The encoder runs on the host, once per weight, on the process's
// persistent worker pool (src/core/worker_pool.h: no threads created per call).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace layerstream {

struct LosslessSpec {
  std::size_t count = 0;       // bfloat16 values
  std::size_t exceptions = 0;  // values whose exponent has no code of its own
  std::array<std::uint8_t, 16> exponent{};  // code -> exponent; code 15 is the exception mark

  static constexpr std::uint8_t kException = 15;

  std::size_t codes_offset() const;
  std::size_t exceptions_offset() const;
  std::size_t bytes() const;  // the encoded buffer
};

// The most values one spec describes (exception indices are 32-bit).
constexpr std::size_t kLosslessMaxCount = std::size_t{0xFFFFFFFFu};

// Counts the exponents of `values` (bfloat16 bit patterns) and picks the table. InvalidArgument when
// count is 0 or above kLosslessMaxCount.
LosslessSpec lossless_plan(const std::uint16_t* values, std::size_t count);

// Writes spec.bytes() bytes at `out` (padding zeroed). `spec` must be lossless_plan's for these values.
void lossless_encode(const LosslessSpec& spec, const std::uint16_t* values, void* out);

// How many threads lossless_plan and lossless_encode run on (0: one per core, the default), the caller's
// and the pool's; a tensor of fewer than 2^16 values takes one. Their output is the same for any number.
void lossless_set_threads(unsigned threads);
unsigned lossless_threads();

// Rebuilds spec.count bfloat16 bit patterns at `out` from an encoded buffer.
void lossless_decode_host(const LosslessSpec& spec, const void* encoded, std::uint16_t* out);

#ifdef LAYERSTREAM_WITH_CUDA
// Enqueues the decode on `stream` (a cudaStream_t) of the current device; returns at once. `encoded`
// should be 16-byte aligned and `out` 16-byte aligned for the wide path (any alignment works, slower).
// max_blocks: at most this many thread blocks of 256 (each loops over its share), so that a decode beside
// other work holds few of the GPU's SMs; 0: as many as the values need (the fastest alone).
void lossless_decode_cuda(const LosslessSpec& spec, const void* encoded, void* out, void* stream,
                          unsigned max_blocks = 0);
#endif

}  // namespace layerstream
