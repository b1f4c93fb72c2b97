// Lossless bfloat16 packing: the table, the threaded host encoder and the host reference decoder (see
// lossless.h; the CUDA decoder is lossless.cu).
#include "layerstream/lossless.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "layerstream/check.h"

namespace layerstream {

namespace {

constexpr std::size_t kAlign = 16;

std::size_t align16(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::uint8_t exponent_of(std::uint16_t v) { return static_cast<std::uint8_t>((v >> 7) & 0xFFu); }
std::uint8_t low_byte_of(std::uint16_t v) { return static_cast<std::uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu)); }

std::uint16_t rebuild(std::uint8_t low, std::uint8_t exponent) {
  return static_cast<std::uint16_t>(((low & 0x80u) << 8) | (static_cast<unsigned>(exponent) << 7) | (low & 0x7Fu));
}

// How many pieces in_pieces splits `count` values into: one per core, each of at least a few MiB.
std::size_t piece_count(std::size_t count) {
  constexpr std::size_t kMinPiece = std::size_t{1} << 21;
  const std::size_t cores = std::max<std::size_t>(1, std::thread::hardware_concurrency());
  return std::max<std::size_t>(1, std::min(cores, count / kMinPiece));
}

// Splits [0, count) into piece_count(count) even-sized pieces (a nibble byte never straddles two pieces:
// every piece but the last has an even length) and runs fn(piece, begin, end), one thread per piece.
template <typename Fn>
void in_pieces(std::size_t count, Fn&& fn) {
  const std::size_t pieces = piece_count(count);
  const std::size_t length = (count / pieces + 1) & ~std::size_t{1};
  std::vector<std::thread> threads;
  threads.reserve(pieces);
  for (std::size_t p = 0; p < pieces; ++p) {
    const std::size_t begin = std::min(count, p * length);
    const std::size_t end = p + 1 == pieces ? count : std::min(count, begin + length);
    if (p + 1 == pieces) {
      fn(p, begin, end);  // the calling thread takes the last piece
    } else {
      threads.emplace_back([&fn, p, begin, end] { fn(p, begin, end); });
    }
  }
  for (auto& t : threads) t.join();
}

}  // namespace

std::size_t LosslessSpec::codes_offset() const { return align16(count); }
std::size_t LosslessSpec::exceptions_offset() const { return codes_offset() + align16((count + 1) / 2); }
std::size_t LosslessSpec::bytes() const { return exceptions_offset() + exceptions * 2 * sizeof(std::uint32_t); }

LosslessSpec lossless_plan(const std::uint16_t* values, std::size_t count) {
  LS_CHECK_ARG(count > 0 && count <= kLosslessMaxCount, "lossless packing takes 1 to ", kLosslessMaxCount,
               " values per tensor, not ", count);
  LS_CHECK_ARG(values != nullptr, "lossless_plan: no values");
  const std::size_t pieces = piece_count(count);
  std::vector<std::array<std::size_t, 256>> partial(pieces);
  in_pieces(count, [&](std::size_t p, std::size_t begin, std::size_t end) {
    std::array<std::size_t, 256> h{};
    for (std::size_t i = begin; i < end; ++i) ++h[exponent_of(values[i])];
    partial[p] = h;
  });
  std::array<std::size_t, 256> histogram{};
  for (std::size_t p = 0; p < pieces; ++p) {
    for (std::size_t e = 0; e < 256; ++e) histogram[e] += partial[p][e];
  }
  // The fifteen most frequent exponents (ties: the smaller exponent first, so the table is deterministic).
  std::array<int, 256> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return histogram[a] > histogram[b]; });
  LosslessSpec spec;
  spec.count = count;
  std::size_t covered = 0;
  for (std::uint8_t code = 0; code < LosslessSpec::kException && histogram[order[code]] > 0; ++code) {
    spec.exponent[code] = static_cast<std::uint8_t>(order[code]);
    covered += histogram[order[code]];
  }
  spec.exceptions = count - covered;
  return spec;
}

void lossless_encode(const LosslessSpec& spec, const std::uint16_t* values, void* out) {
  LS_CHECK_ARG(values != nullptr && out != nullptr, "lossless_encode: no values or no output");
  LS_CHECK_ARG(spec.count > 0 && spec.count <= kLosslessMaxCount, "lossless_encode: a spec of ", spec.count,
               " values");
  // Exponent -> code; the table's unused slots repeat exponent 0, so map only the codes in use.
  std::array<std::uint8_t, 256> code_of;
  code_of.fill(LosslessSpec::kException);
  for (int code = LosslessSpec::kException - 1; code >= 0; --code) {
    // Walking down, a repeated exponent (an unused slot's 0) ends on its lowest code, the one in use
    // when exponent 0 is in the table (codes in use come first).
    code_of[spec.exponent[code]] = static_cast<std::uint8_t>(code);
  }
  auto* base = static_cast<std::uint8_t*>(out);
  std::uint8_t* low = base;
  std::uint8_t* codes = base + spec.codes_offset();
  // Only the padding between sections is zeroed here; the pieces write every other byte once (a piece
  // starts at an even value, so each code byte is written whole by one thread).
  std::memset(low + spec.count, 0, spec.codes_offset() - spec.count);
  const std::size_t code_bytes = (spec.count + 1) / 2;
  std::memset(codes + code_bytes, 0, spec.exceptions_offset() - spec.codes_offset() - code_bytes);
  const std::size_t pieces = piece_count(spec.count);
  std::vector<std::vector<std::uint32_t>> found(pieces);
  in_pieces(spec.count, [&](std::size_t p, std::size_t begin, std::size_t end) {
    std::vector<std::uint32_t>& mine = found[p];
    for (std::size_t i = begin; i < end; i += 2) {
      std::uint8_t byte = 0;
      for (std::size_t k = i; k < std::min(i + 2, end); ++k) {
        const std::uint16_t v = values[k];
        low[k] = low_byte_of(v);
        const std::uint8_t code = code_of[exponent_of(v)];
        byte |= static_cast<std::uint8_t>(code << (4 * (k - i)));
        if (code == LosslessSpec::kException) {
          mine.push_back(static_cast<std::uint32_t>(k));
          mine.push_back(exponent_of(v));
        }
      }
      codes[i / 2] = byte;
    }
  });
  std::size_t listed = 0;
  for (std::size_t p = 0; p < pieces; ++p) listed += found[p].size() / 2;
  LS_CHECK_ARG(listed == spec.exceptions, "lossless_encode: the spec counts ", spec.exceptions,
               " exceptions but these values have ", listed, " (a spec of other values?)");
  auto* list = reinterpret_cast<std::uint32_t*>(base + spec.exceptions_offset());
  for (std::size_t p = 0; p < pieces; ++p) {
    std::memcpy(list, found[p].data(), found[p].size() * sizeof(std::uint32_t));
    list += found[p].size();
  }
}

void lossless_decode_host(const LosslessSpec& spec, const void* encoded, std::uint16_t* out) {
  LS_CHECK_ARG(encoded != nullptr && out != nullptr, "lossless_decode_host: no input or no output");
  const auto* base = static_cast<const std::uint8_t*>(encoded);
  const std::uint8_t* low = base;
  const std::uint8_t* codes = base + spec.codes_offset();
  for (std::size_t i = 0; i < spec.count; ++i) {
    const std::uint8_t code = (codes[i / 2] >> (4 * (i % 2))) & 0xFu;
    out[i] = rebuild(low[i], spec.exponent[code]);
  }
  std::uint32_t entry[2];
  for (std::size_t j = 0; j < spec.exceptions; ++j) {
    std::memcpy(entry, base + spec.exceptions_offset() + j * sizeof entry, sizeof entry);
    LS_CHECK(entry[0] < spec.count, "lossless_decode_host: exception ", j, " names value ", entry[0], " of ",
             spec.count);
    out[entry[0]] = rebuild(low[entry[0]], static_cast<std::uint8_t>(entry[1]));
  }
}

}  // namespace layerstream
