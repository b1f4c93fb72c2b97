// Lossless bfloat16 packing: the table, the threaded host encoder and the host reference decoder (see
// lossless.h; the CUDA decoder is lossless.cu).
#include "layerstream/lossless.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <atomic>
#include <numeric>
#include <thread>
#include <vector>

#include "layerstream/check.h"
#include "worker_pool.h"

#if defined(__GNUC__) && defined(__x86_64__)  // GCC and Clang: an SSSE3 path chosen at run time
#define LS_LOSSLESS_SSSE3 1
#include <tmmintrin.h>
#endif

namespace layerstream {

namespace {

constexpr std::size_t kAlign = 16;

std::size_t align16(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::uint8_t exponent_of(std::uint16_t v) { return static_cast<std::uint8_t>((v >> 7) & 0xFFu); }
std::uint8_t low_byte_of(std::uint16_t v) { return static_cast<std::uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu)); }

std::uint16_t rebuild(std::uint8_t low, std::uint8_t exponent) {
  return static_cast<std::uint16_t>(((low & 0x80u) << 8) | (static_cast<unsigned>(exponent) << 7) | (low & 0x7Fu));
}

// The threads lossless_plan and lossless_encode use (lossless_set_threads; 0: one per core).
std::atomic<unsigned> g_threads{0};

unsigned threads_to_use() {
  const unsigned set = g_threads.load(std::memory_order_relaxed);
  return set != 0 ? set : std::max(1u, std::thread::hardware_concurrency());
}

// The values are split into chunks of a fixed length (the last one shorter), whatever the thread count.
// Each chunk's exceptions are listed in index order and the lists are joined in chunk order, so the list is
// in index order whatever the chunks; chunks are multiples of kBlock values (so a code byte never straddles
// two chunks) and small enough to share a mid-sized tensor among many threads.
constexpr std::size_t kBlock = 16;  // values the encoder's inner loop takes at once
constexpr std::size_t kChunk = std::size_t{1} << 16;
static_assert(kChunk % kBlock == 0, "whole blocks per chunk");

std::size_t chunk_count(std::size_t count) { return (count + kChunk - 1) / kChunk; }

std::size_t workers_for(std::size_t count) { return std::min<std::size_t>(threads_to_use(), chunk_count(count)); }

// Runs fn(worker, chunk, begin, end) for every chunk on `workers` threads (workers_for(count): the caller's
// thread and the shared pool's; worker is 0..workers-1), each taking the next chunk not yet taken.
template <typename Fn>
void in_chunks(std::size_t count, std::size_t workers, Fn&& fn) {
  const std::size_t chunks = chunk_count(count);
  std::atomic<std::size_t> next{0};
  auto work = [&](std::size_t worker) {
    for (std::size_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(worker, c, c * kChunk, std::min(count, (c + 1) * kChunk));
    }
  };
  if (workers <= 1) {
    work(0);
  } else {
    WorkerPool::shared().run(workers, work);
  }
}

// Adds the exponent counts of values [0, n) to `histogram`.
void count_exponents(const std::uint16_t* values, std::size_t n, std::uint64_t* histogram) {
  // Eight histograms, summed at the end: consecutive equal exponents do not wait on one counter.
  std::uint32_t h[8][256] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (std::size_t k = 0; k < 8; ++k) ++h[k][exponent_of(values[i + k])];
  }
  for (; i < n; ++i) ++h[0][exponent_of(values[i])];
  for (std::size_t e = 0; e < 256; ++e) {
    std::uint64_t sum = 0;
    for (std::size_t k = 0; k < 8; ++k) sum += h[k][e];
    histogram[e] += sum;
  }
}

// The low bytes (sign << 7 | mantissa) of 16 values to low[0, 16) and their exponents to exponents[0, 16).
inline void split_block(const std::uint16_t* __restrict values, std::uint8_t* __restrict low,
                        std::uint8_t* __restrict exponents) {
  for (std::size_t k = 0; k < kBlock; ++k) {  // the compiler vectorizes this (restrict: no aliasing)
    low[k] = low_byte_of(values[k]);
    exponents[k] = exponent_of(values[k]);
  }
}

// Exponent -> code | kExceptionFlag for code 15: two entries ORed as `a | b << 4` keep both codes in the
// low byte and both flags in bits 8 and 12, so a block needs one test for "any exception".
constexpr std::uint16_t kExceptionFlag = 0x100;
using CodeTable = std::array<std::uint16_t, 256>;

CodeTable code_table(const LosslessSpec& spec) {
  CodeTable table;
  table.fill(LosslessSpec::kException | kExceptionFlag);
  for (int code = LosslessSpec::kException - 1; code >= 0; --code) {
    // Walking down, a repeated exponent (an unused slot's 0) ends on its lowest code, the one in use
    // when exponent 0 is in the table (codes in use come first).
    table[spec.exponent[code]] = static_cast<std::uint16_t>(code);
  }
  return table;
}

// Encodes values [i, end), fewer than a block (the tensor's last ones), one at a time.
void encode_tail(const CodeTable& table, const std::uint16_t* values, std::size_t i, std::size_t end,
                 std::uint8_t* low, std::uint8_t* codes, std::vector<std::uint32_t>& found) {
  for (; i < end; ++i) {
    low[i] = low_byte_of(values[i]);
    const std::uint8_t e = exponent_of(values[i]);
    const auto code = static_cast<std::uint8_t>(table[e] & 0xFu);
    if (i % 2 == 0) {
      codes[i / 2] = code;
    } else {
      codes[i / 2] = static_cast<std::uint8_t>(codes[i / 2] | (code << 4));
    }
    if (table[e] & kExceptionFlag) {
      found.push_back(static_cast<std::uint32_t>(i));
      found.push_back(e);
    }
  }
}

// Encodes values [begin, end) (begin a multiple of kBlock): their low bytes and codes, and their exceptions
// (index, exponent) appended to `found` in index order.
void encode_chunk(const CodeTable& shared_table, const std::uint16_t* values, std::size_t begin, std::size_t end,
                  std::uint8_t* low, std::uint8_t* codes, std::vector<std::uint32_t>& found) {
  const CodeTable table = shared_table;  // a local copy: the stores below cannot alias it
  std::size_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    alignas(16) std::uint8_t exponents[kBlock];
    split_block(values + i, low + i, exponents);
    std::uint8_t packed[kBlock / 2];
    unsigned flags = 0;
    for (std::size_t k = 0; k < kBlock / 2; ++k) {
      const unsigned pair = table[exponents[2 * k]] | (unsigned{table[exponents[2 * k + 1]]} << 4);
      packed[k] = static_cast<std::uint8_t>(pair);
      flags |= pair;
    }
    std::memcpy(codes + i / 2, packed, sizeof packed);
    if (flags & (kExceptionFlag | kExceptionFlag << 4)) {  // rare: which ones
      for (std::size_t k = 0; k < kBlock; ++k) {
        if (table[exponents[k]] & kExceptionFlag) {
          found.push_back(static_cast<std::uint32_t>(i + k));
          found.push_back(exponents[k]);
        }
      }
    }
  }
  encode_tail(table, values, i, end, low, codes, found);
}

#if defined(LS_LOSSLESS_SSSE3)
// When every exponent with a code of its own lies in one window of 16 consecutive exponents (weights: the
// fifteen most frequent are neighbouring octaves), a 16-entry table of the window gives the codes of 16
// values in one SSSE3 shuffle. Otherwise (e.g. exponent 0 of many exact zeros beside the weights' octaves),
// or without SSSE3, encode_chunk's per-value lookup does. Both write the same bytes.
struct Window {
  bool usable = false;
  std::uint8_t base = 0;  // the window is base .. base + 15
  std::array<std::uint8_t, 16> code{};  // code of exponent base + k (15 for one without a code)
};

Window window_of(const CodeTable& table) {
  int lowest = 256, highest = -1;
  for (int e = 0; e < 256; ++e) {
    if ((table[e] & kExceptionFlag) == 0) {
      lowest = std::min(lowest, e);
      highest = std::max(highest, e);
    }
  }
  Window w;
  if (highest < 0 || highest - lowest > 15) return w;
  w.usable = true;
  w.base = static_cast<std::uint8_t>(std::min(lowest, 240));
  for (int k = 0; k < 16; ++k) w.code[k] = static_cast<std::uint8_t>(table[w.base + k] & 0xFu);
  return w;
}

bool have_ssse3() {
  static const bool have = __builtin_cpu_supports("ssse3");
  return have;
}

// encode_chunk for a usable window, 16 values at a time with SSSE3.
__attribute__((target("ssse3"))) void encode_chunk_window(const Window& w, const CodeTable& table,
                                                          const std::uint16_t* values, std::size_t begin,
                                                          std::size_t end, std::uint8_t* low, std::uint8_t* codes,
                                                          std::vector<std::uint32_t>& found) {
  const __m128i window_codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.code.data()));
  const __m128i base = _mm_set1_epi8(static_cast<char>(w.base));
  const __m128i fifteen = _mm_set1_epi8(LosslessSpec::kException);
  const __m128i mantissa = _mm_set1_epi16(0x007F), sign = _mm_set1_epi16(0x0080), byte = _mm_set1_epi16(0x00FF);
  std::size_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + i + 8));
    const __m128i low_a = _mm_or_si128(_mm_and_si128(a, mantissa), _mm_and_si128(_mm_srli_epi16(a, 8), sign));
    const __m128i low_b = _mm_or_si128(_mm_and_si128(b, mantissa), _mm_and_si128(_mm_srli_epi16(b, 8), sign));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + i), _mm_packus_epi16(low_a, low_b));
    const __m128i exponents =
        _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(a, 7), byte), _mm_and_si128(_mm_srli_epi16(b, 7), byte));
    // Offset in the window (wrapping: one outside it is above 15), its code, and 15 outside the window.
    const __m128i offset = _mm_sub_epi8(exponents, base);
    const __m128i inside = _mm_cmpeq_epi8(_mm_min_epu8(offset, fifteen), offset);
    const __m128i code = _mm_or_si128(_mm_and_si128(inside, _mm_shuffle_epi8(window_codes, offset)),
                                      _mm_andnot_si128(inside, fifteen));
    // Byte pairs (c0, c1) as 16-bit lanes c0 | c1 << 8 -> c0 | c1 << 4, packed to 8 bytes.
    const __m128i pairs = _mm_and_si128(_mm_or_si128(code, _mm_srli_epi16(code, 4)), byte);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 2), _mm_packus_epi16(pairs, pairs));
    unsigned marked = static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(code, fifteen)));
    if (marked != 0) {  // rare: list them in index order
      alignas(16) std::uint8_t e[kBlock];
      _mm_store_si128(reinterpret_cast<__m128i*>(e), exponents);
      for (; marked != 0; marked &= marked - 1) {
        const unsigned k = static_cast<unsigned>(__builtin_ctz(marked));
        found.push_back(static_cast<std::uint32_t>(i + k));
        found.push_back(e[k]);
      }
    }
  }
  encode_tail(table, values, i, end, low, codes, found);
}
#endif

}  // namespace

std::size_t LosslessSpec::codes_offset() const { return align16(count); }
std::size_t LosslessSpec::exceptions_offset() const { return codes_offset() + align16((count + 1) / 2); }
std::size_t LosslessSpec::bytes() const { return exceptions_offset() + exceptions * 2 * sizeof(std::uint32_t); }

LosslessSpec lossless_plan(const std::uint16_t* values, std::size_t count) {
  LS_CHECK_ARG(count > 0 && count <= kLosslessMaxCount, "lossless packing takes 1 to ", kLosslessMaxCount,
               " values per tensor, not ", count);
  LS_CHECK_ARG(values != nullptr, "lossless_plan: no values");
  // One histogram per worker (integer sums: the same whatever the split).
  const std::size_t workers = workers_for(count);
  std::vector<std::array<std::uint64_t, 256>> partial(workers, std::array<std::uint64_t, 256>{});
  in_chunks(count, workers, [&](std::size_t worker, std::size_t, std::size_t begin, std::size_t end) {
    count_exponents(values + begin, end - begin, partial[worker].data());
  });
  std::array<std::uint64_t, 256> histogram{};
  for (const auto& p : partial) {
    for (std::size_t e = 0; e < 256; ++e) histogram[e] += p[e];
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
  const CodeTable table = code_table(spec);
  auto* base = static_cast<std::uint8_t*>(out);
  std::uint8_t* low = base;
  std::uint8_t* codes = base + spec.codes_offset();
  // Only the padding between sections is zeroed here; the chunks write every other byte once (a chunk
  // starts at a multiple of kBlock values, so each code byte is written whole by one thread).
  std::memset(low + spec.count, 0, spec.codes_offset() - spec.count);
  const std::size_t code_bytes = (spec.count + 1) / 2;
  std::memset(codes + code_bytes, 0, spec.exceptions_offset() - spec.codes_offset() - code_bytes);
  const std::size_t pieces = chunk_count(spec.count);
  std::vector<std::vector<std::uint32_t>> found(pieces);
#if defined(LS_LOSSLESS_SSSE3)
  const Window window = window_of(table);
  if (window.usable && have_ssse3()) {
    in_chunks(spec.count, workers_for(spec.count), [&](std::size_t, std::size_t c, std::size_t begin, std::size_t end) {
      encode_chunk_window(window, table, values, begin, end, low, codes, found[c]);
    });
  } else
#endif
  {
    in_chunks(spec.count, workers_for(spec.count), [&](std::size_t, std::size_t c, std::size_t begin, std::size_t end) {
      encode_chunk(table, values, begin, end, low, codes, found[c]);
    });
  }
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

void lossless_set_threads(unsigned threads) { g_threads.store(threads, std::memory_order_relaxed); }

unsigned lossless_threads() { return threads_to_use(); }

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
