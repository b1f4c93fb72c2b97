// PinnedArena: exact-size host memory for layer weights, carved out of large pinned chunks.
//
// Why: pinning each tensor separately through PyTorch's host allocator rounds every request up to a
// power of two (31.9 GB pinned for 22 GB of FLUX.1 weights). The arena pins a few large chunks and
// sub-allocates them at the requested size rounded up to `alignment`, so host memory held is about the
// bytes of the weights.
//
// Ownership: the arena owns every chunk; a block is the caller's from allocate() until free(). Freeing a
// block that an async copy still reads is the caller's bug: callers (TransferEngine) wait for the copy's
// event first. Chunks that become empty are returned to the OS at once, so an arena with no live blocks
// holds no memory.
//
// Fallback: when the platform refuses to pin (ulimit -l, Windows limits, containers) or the optional
// `pinned_cap_bytes` is reached, chunks are pageable memory instead; the arena logs this once per process
// and keeps working. HostBlock::pinned tells which a block got.
//
// Thread-safety: all methods may be called from any thread (one internal mutex).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "layerstream/alignment.h"
#include "layerstream/backend.h"
#include "layerstream/stats_fields.h"

namespace layerstream {

struct ArenaOptions {
  // Blocks of at least this many bytes get a chunk of their own, sized to them (rounded to a page) and
  // returned when they are freed: large layers then waste nothing. Sharing chunks between large blocks
  // does not pack: FLUX.1's repeating 126/90/54 MiB layers left a tail in nearly every 256 MiB chunk
  // (9% more pinned than the weights). 0: every block shares chunks.
  std::size_t dedicated_bytes = std::size_t{16} << 20;
  // Largest shared chunk (for blocks under dedicated_bytes). A block larger than this gets a chunk of
  // its own, sized to it.
  std::size_t chunk_bytes = std::size_t{256} << 20;
  // Shared chunks grow with what the shared chunks hold: a new one is that / growth_divisor (at least
  // the block, at most chunk_bytes), so the unused tail of the last one stays under 1/growth_divisor of
  // the total (about 3% by default) for small models and large ones alike. 0: always chunk_bytes.
  std::size_t growth_divisor = 32;
  // Every block starts at a multiple of this (a power of two, at least 16).
  std::size_t alignment = kBlockAlignment;
  // Most bytes the arena will pin; chunks beyond it are pageable. 0 means no cap.
  std::size_t pinned_cap_bytes = 0;
  PinMethod pin_method = PinMethod::kHostAlloc;
};

struct HostBlock {
  void* data = nullptr;
  std::size_t bytes = 0;  // as requested
  bool pinned = false;
};

// The fields and what they count: LAYERSTREAM_ARENA_FIELDS (stats_fields.h).
struct ArenaStats {
  LAYERSTREAM_ARENA_FIELDS(LAYERSTREAM_STATS_MEMBER)
};

class PinnedArena {
 public:
  PinnedArena(Backend& backend, ArenaOptions options = {});
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // A block of exactly `bytes` usable bytes (the size is rounded up to the alignment internally).
  // Throws InvalidArgument for 0 bytes, Error when even pageable memory is refused.
  HostBlock allocate(std::size_t bytes);
  // Returns a block; throws InvalidArgument for a pointer the arena did not hand out (or freed twice).
  void free(void* data);
  bool owns(const void* data) const;

  ArenaStats stats() const;
  const ArenaOptions& options() const { return options_; }

 private:
  struct Chunk;
  Backend& backend_;
  ArenaOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::size_t shared_bytes_held_ = 0;  // chunk memory of the shared (not dedicated) chunks
  ArenaStats stats_;
};

}  // namespace layerstream
