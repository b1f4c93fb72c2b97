#include "layerstream/pinned_arena.h"

#include <algorithm>
#include <map>

#include "layerstream/check.h"
#include "layerstream/log.h"

namespace layerstream {

namespace {
constexpr std::size_t kPageBytes = 4096;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
}  // namespace

struct PinnedArena::Chunk {
  PinnedBuffer memory;
  bool dedicated = false;  // sized for one large block (ArenaOptions::dedicated_bytes)
  std::map<std::size_t, std::size_t> free_ranges;  // offset -> length, coalesced
  // offset -> {requested, rounded}
  std::map<std::size_t, std::pair<std::size_t, std::size_t>> blocks;

  char* base() const { return static_cast<char*>(memory.data()); }
  bool contains(const void* p) const {
    auto* c = static_cast<const char*>(p);
    return c >= base() && c < base() + memory.size();
  }
};

PinnedArena::PinnedArena(Backend& backend, ArenaOptions options)
    : backend_(backend), options_(options) {
  LS_CHECK_ARG(options_.alignment >= 16 && (options_.alignment & (options_.alignment - 1)) == 0,
               "PinnedArena: alignment must be a power of two >= 16, got ", options_.alignment);
  LS_CHECK_ARG(options_.chunk_bytes >= kPageBytes, "PinnedArena: chunk_bytes must be at least ",
               kPageBytes, ", got ", options_.chunk_bytes);
}

PinnedArena::~PinnedArena() = default;

HostBlock PinnedArena::allocate(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "PinnedArena::allocate: size must be positive");
  const std::size_t rounded = round_up(bytes, options_.alignment);
  std::lock_guard<std::mutex> lock(mu_);

  // Best fit over every chunk's free ranges: keeps large holes for large layers.
  Chunk* best_chunk = nullptr;
  std::map<std::size_t, std::size_t>::iterator best;
  for (auto& chunk : chunks_) {
    for (auto it = chunk->free_ranges.begin(); it != chunk->free_ranges.end(); ++it) {
      if (it->second >= rounded && (best_chunk == nullptr || it->second < best->second)) {
        best_chunk = chunk.get();
        best = it;
      }
    }
  }

  if (best_chunk == nullptr) {
    const bool dedicated = options_.dedicated_bytes != 0 && rounded >= options_.dedicated_bytes;
    const std::size_t regular =
        dedicated ? 0
        : options_.growth_divisor == 0
            ? options_.chunk_bytes
            : std::min(options_.chunk_bytes, round_up(shared_bytes_held_ / options_.growth_divisor, kPageBytes));
    const std::size_t chunk_size = std::max(regular, round_up(rounded, kPageBytes));
    const bool allow_pin = options_.pinned_cap_bytes == 0 ||
                           stats_.bytes_pinned + chunk_size <= options_.pinned_cap_bytes;
    auto chunk = std::make_unique<Chunk>();
    chunk->memory = PinnedBuffer(backend_, chunk_size, options_.pin_method, allow_pin);
    if (!chunk->memory.pinned()) {
      ++stats_.pin_fallbacks;
      log_once("pinned-arena-fallback", LogLevel::kWarning,
               detail::concat(
                   allow_pin ? "pinning host memory was refused by the platform"
                             : "the pinned-memory cap (pinned_cap_bytes) is reached",
                   " (chunk of ", chunk_size, " bytes, ", stats_.bytes_pinned,
                   " bytes pinned so far); continuing with pageable memory staged through pinned "
                   "bounce buffers, which is slower. Raise `ulimit -l` or the cap to pin everything."));
    } else {
      stats_.bytes_pinned += chunk_size;
    }
    stats_.bytes_held += chunk_size;
    stats_.peak_bytes_held = std::max(stats_.peak_bytes_held, stats_.bytes_held);
    ++stats_.chunks;
    chunk->dedicated = dedicated;
    if (dedicated) {
      ++stats_.dedicated_chunks;
    } else {
      shared_bytes_held_ += chunk_size;
    }
    chunk->free_ranges.emplace(0, chunk_size);
    best_chunk = chunk.get();
    best = best_chunk->free_ranges.begin();
    chunks_.push_back(std::move(chunk));
  }

  const std::size_t offset = best->first;
  const std::size_t length = best->second;
  best_chunk->free_ranges.erase(best);
  if (length > rounded) best_chunk->free_ranges.emplace(offset + rounded, length - rounded);
  best_chunk->blocks.emplace(offset, std::make_pair(bytes, rounded));
  stats_.bytes_requested += bytes;
  stats_.bytes_allocated += rounded;
  ++stats_.blocks;
  return HostBlock{best_chunk->base() + offset, bytes, best_chunk->memory.pinned()};
}

void PinnedArena::free(void* data) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = chunks_.begin(); it != chunks_.end(); ++it) {
    Chunk& chunk = **it;
    if (!chunk.contains(data)) continue;
    const std::size_t offset = static_cast<std::size_t>(static_cast<char*>(data) - chunk.base());
    auto block = chunk.blocks.find(offset);
    LS_CHECK_ARG(block != chunk.blocks.end(), "PinnedArena::free: ", data,
                 " is not the start of a live block (freed twice, or an interior pointer)");
    const auto [requested, rounded] = block->second;
    chunk.blocks.erase(block);
    stats_.bytes_requested -= requested;
    stats_.bytes_allocated -= rounded;
    --stats_.blocks;

    // Insert the range and merge it with free neighbours on both sides.
    std::size_t start = offset, length = rounded;
    auto next = chunk.free_ranges.lower_bound(offset);
    if (next != chunk.free_ranges.end() && next->first == offset + rounded) {
      length += next->second;
      next = chunk.free_ranges.erase(next);
    }
    if (next != chunk.free_ranges.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        start = prev->first;
        length += prev->second;
        chunk.free_ranges.erase(prev);
      }
    }
    chunk.free_ranges.emplace(start, length);

    if (chunk.blocks.empty()) {  // give the whole chunk back to the OS / driver
      stats_.bytes_held -= chunk.memory.size();
      if (chunk.memory.pinned()) stats_.bytes_pinned -= chunk.memory.size();
      --stats_.chunks;
      if (chunk.dedicated) {
        --stats_.dedicated_chunks;
      } else {
        shared_bytes_held_ -= chunk.memory.size();
      }
      chunks_.erase(it);
    }
    return;
  }
  LS_CHECK_ARG(false, "PinnedArena::free: ", data, " does not belong to this arena");
}

bool PinnedArena::owns(const void* data) const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(chunks_.begin(), chunks_.end(),
                     [&](const auto& c) { return c->contains(data); });
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace layerstream
