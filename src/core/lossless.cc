// Lossless bfloat16 packing: the table, the threaded host encoder and the host reference decoder (see
// lossless.h; the CUDA decoder is lossless.cu).
#include "layerstream/lossless.h"

#include <algorithm>
#include <cstring>
#include <atomic>
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

// The threads lossless_plan and lossless_encode use (lossless_set_threads; 0: one per core).
std::atomic<unsigned> g_threads{0};

unsigned threads_to_use() {
  const unsigned set = g_threads.load(std::memory_order_relaxed);
  return set != 0 ? set : std::max(1u, std::thread::hardware_concurrency());
}

// The values are split into chunks of a fixed length (the last one shorter), whatever the thread count,
// so that every output (the exception list's order included: chunk by chunk) is the same for any number of
// threads. Chunks are even-sized: a code byte (two values) never straddles two chunks.
constexpr std::size_t kChunk = std::size_t{1} << 20;

std::size_t chunk_count(std::size_t count) { return (count + kChunk - 1) / kChunk; }

// Runs fn(chunk, begin, end) for every chunk, on min(threads, chunks) threads (the caller's among them),
// each taking the next chunk not yet taken.
template <typename Fn>
void in_chunks(std::size_t count, Fn&& fn) {
  const std::size_t chunks = chunk_count(count);
  const std::size_t workers = std::min<std::size_t>(threads_to_use(), chunks);
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      fn(c, c * kChunk, std::min(count, (c + 1) * kChunk));
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers > 0 ? workers - 1 : 0);
  for (std::size_t t = 1; t < workers; ++t) threads.emplace_back(work);
  work();
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
  const std::size_t pieces = chunk_count(count);
  std::vector<std::array<std::size_t, 256>> partial(pieces);
  in_chunks(count, [&](std::size_t p, std::size_t begin, std::size_t end) {
    // Four histograms, summed at the end: consecutive equal exponents do not wait on one counter.
    std::array<std::array<std::uint32_t, 256>, 4> h{};
    std::size_t i = begin;
    for (; i + 4 <= end; i += 4) {
      ++h[0][exponent_of(values[i])];
      ++h[1][exponent_of(values[i + 1])];
      ++h[2][exponent_of(values[i + 2])];
      ++h[3][exponent_of(values[i + 3])];
    }
    for (; i < end; ++i) ++h[0][exponent_of(values[i])];
    for (std::size_t e = 0; e < 256; ++e) partial[p][e] = std::size_t{h[0][e]} + h[1][e] + h[2][e] + h[3][e];
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
  const std::size_t pieces = chunk_count(spec.count);
  std::vector<std::vector<std::uint32_t>> found(pieces);
  in_chunks(spec.count, [&](std::size_t p, std::size_t begin, std::size_t end) {
    std::vector<std::uint32_t>& mine = found[p];
    const auto except = [&](std::size_t k) {
      mine.push_back(static_cast<std::uint32_t>(k));
      mine.push_back(exponent_of(values[k]));
    };
    std::size_t i = begin;
    for (; i + 2 <= end; i += 2) {  // two values, one code byte
      const std::uint16_t v0 = values[i], v1 = values[i + 1];
      low[i] = low_byte_of(v0);
      low[i + 1] = low_byte_of(v1);
      const std::uint8_t c0 = code_of[exponent_of(v0)], c1 = code_of[exponent_of(v1)];
      codes[i / 2] = static_cast<std::uint8_t>(c0 | (c1 << 4));
      if (c0 == LosslessSpec::kException || c1 == LosslessSpec::kException) {  // rare
        if (c0 == LosslessSpec::kException) except(i);
        if (c1 == LosslessSpec::kException) except(i + 1);
      }
    }
    if (i < end) {  // an odd count: the last value alone in its byte
      low[i] = low_byte_of(values[i]);
      const std::uint8_t c0 = code_of[exponent_of(values[i])];
      codes[i / 2] = c0;
      if (c0 == LosslessSpec::kException) except(i);
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
