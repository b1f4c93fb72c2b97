// The counters layerstream reports, listed once. Every surface is generated from these X-macro lists:
// the C++ structs (ArenaStats, EngineStats, the torch glue's StateStats), EngineStats::add_counters, the
// dicts of layerstream._native and of manager_modules' stats().
//
// Each entry is X(type, name). Names in Python:
// - _native: an engine's fields by their names, its arena's in a nested dict "arena";
// - manager_modules (one flat dict per device state): an engine's fields by their names, its arena's as
//   host_<name>, the access predictor's as predictor_<name>, the state's own by their names, plus
//   LAYERSTREAM_STATS_ALIASES (the names those fields had before, kept for readers of older outputs) and
//   device_bytes (ring_capacity + resident_bytes: what layerstream holds on the device).
#pragma once

#include <cstddef>
#include <cstdint>

// Declares a zero-initialized member, for the lists below inside a struct.
#define LAYERSTREAM_STATS_MEMBER(type, name) type name = 0;

// PinnedArena's accounting (ArenaStats).
#define LAYERSTREAM_ARENA_FIELDS(X)                                                                    \
  X(std::size_t, bytes_requested)  /* sum of the sizes asked for by live blocks */                     \
  X(std::size_t, bytes_allocated)  /* the same, each rounded up to the alignment */                    \
  X(std::size_t, bytes_held)       /* chunk memory held (pinned + pageable) */                         \
  X(std::size_t, bytes_pinned)     /* part of bytes_held that is pinned */                             \
  X(std::size_t, peak_bytes_held)                                                                      \
  X(std::size_t, chunks)                                                                               \
  X(std::size_t, dedicated_chunks) /* part of `chunks` that hold one large block each */               \
  X(std::size_t, blocks)                                                                               \
  X(std::size_t, pin_fallbacks)    /* chunks that could not be pinned */

// TransferEngine's cumulative counters (EngineStats; add_counters sums them over retired engines).
#define LAYERSTREAM_ENGINE_COUNTERS(X)                                                                 \
  X(std::uint64_t, fetches)                                                                            \
  X(std::uint64_t, copies_h2d)                                                                         \
  X(std::uint64_t, bytes_h2d)                                                                          \
  X(std::uint64_t, reuse_hits)       /* fetches served from the ring (prefetch hits included) */       \
  X(std::uint64_t, prefetches)       /* copies issued by prefetch() */                                 \
  X(std::uint64_t, prefetch_hits)    /* prefetched layers later fetched while still in the ring */     \
  X(std::uint64_t, prefetch_wasted)  /* prefetched layers evicted before any fetch */                  \
  X(std::uint64_t, resident_hits)    /* fetches served by a resident layer */                          \
  X(std::uint64_t, evictions)                                                                          \
  X(std::uint64_t, bounce_chunks)    /* pieces staged through bounce buffers (pageable layers) */      \
  X(std::uint64_t, downloads)                                                                          \
  X(std::uint64_t, bytes_d2h)                                                                          \
  /* EngineOptions::time_waits: time the consumers spent waiting for copies (microseconds, summed */   \
  /* over the waits measured so far), and how many waits that covers. */                              \
  X(std::uint64_t, copy_wait_us)                                                                       \
  X(std::uint64_t, copy_waits_timed)

// TransferEngine's gauges (EngineStats: the engine's state now, not summed over retired engines).
#define LAYERSTREAM_ENGINE_GAUGES(X)                                                                   \
  X(std::size_t, resident_layers)                                                                      \
  X(std::size_t, resident_bytes)                                                                       \
  X(std::size_t, layers)                                                                               \
  X(std::size_t, leases_outstanding)                                                                   \
  X(std::size_t, downloads_pending)  /* gradient copies not yet joined */                              \
  X(std::size_t, ring_capacity)                                                                        \
  X(std::size_t, ring_bytes_live)

// AccessPredictor's counters (PredictorStats).
#define LAYERSTREAM_PREDICTOR_FIELDS(X)                                                                \
  X(std::uint64_t, observed)                                                                           \
  X(std::uint64_t, predicted)  /* observations for which a prediction existed */                       \
  X(std::uint64_t, correct)    /* ... and the layer used was the first one predicted */

// The torch glue's DeviceState, beside its engine's (StateStats).
#define LAYERSTREAM_STATE_FIELDS(X)                                                                    \
  /* Quantized layers: dequantized into the ring region's scratch, found there again, or into memory */ \
  /* of their own (resident layers, layouts the kernel does not take); losslessly packed layers: found */ \
  /* decoded in the scratch, by the engine's derive stream after the copy. */                          \
  X(std::uint64_t, dequant_into_scratch)                                                               \
  X(std::uint64_t, dequant_reused)                                                                     \
  X(std::uint64_t, dequant_own_memory)                                                                 \
  X(std::uint64_t, dequant_on_copy)                                                                    \
  /* OstrisLinear calls whose weight layerstream decoded (uintx, orbit/VQ, nvfp4, convrot4) itself */     \
  X(std::uint64_t, ostris_decoded)                                                                     \
  /* bytes of OstrisLinear buffers its forward read in place that outlived the call (autograd kept */   \
  /* them), copied out of the ring (StreamedLayer::with_staged_tensors) */                              \
  X(std::uint64_t, ostris_kept_bytes)                                                                  \
  X(std::uint64_t, engines_built)                                                                      \
  X(std::uint64_t, sim_races)             /* sim mode: unordered accesses the race checker found */    \
  X(std::uint64_t, vram_budget_planned)   /* 1 once the VRAM budget planned from a training step */    \
  X(std::size_t, vram_budget_room)        /* bytes the budget let stay resident (0 before the plan) */ \
  /* Bytes per step the plan's replay expects to cross the bus (residency_plan.h), beside bytes_h2d. */ \
  X(std::uint64_t, vram_budget_estimate)                                                               \
  /* Memory pressure: how often resident copies were given back to an allocation that did not fit, */ \
  /* and how many bytes in all (yield_for_pressure). */                                                \
  X(std::uint64_t, pressure_yields)                                                                    \
  X(std::uint64_t, pressure_yielded_bytes)                                                             \
  /* LAYERSTREAM_VRAM_GAP=lend: how often the layers lent the gap's quarter were given back between */ \
  /* steps (without a new plan; copied again in the next step), and how many bytes in all. */          \
  X(std::uint64_t, gap_lends)                                                                          \
  X(std::uint64_t, gap_lent_bytes)

// manager_modules' older names of generated keys: X(old name, generated name). Both are in the dict.
#define LAYERSTREAM_STATS_ALIASES(X)            \
  X(pinned_bytes, host_bytes_pinned)            \
  X(ring_bytes, ring_capacity)                  \
  X(predicted_uses, predictor_predicted)        \
  X(predicted_correctly, predictor_correct)
