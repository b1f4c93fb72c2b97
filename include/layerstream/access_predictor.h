// AccessPredictor: learns the order in which layers are used from the uses themselves, and predicts the
// next ones, so that their copies can be issued ahead of need.
//
// A training step calls the same layers in the same order every time (forward, the recomputed forward of
// each checkpointed block, backward), but a layer appears several times per step with different
// successors, and a block's forward and its recomputed forward are the same run of layers. So instead of
// a fixed-length context the predictor follows the history: while each use is the one that came next
// last time, it keeps following; on a surprise it re-anchors at the earlier occurrence of the current
// layer whose preceding uses match the present ones for longest (the start of the history counting as a
// match, so that a second step anchors at the first step's start). No step markers are needed; a changed
// order (another resolution, an inference pass) costs a few misses and is learned on the fly.
//
// Thread-safety: none; the owner serializes observe() and predict().
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "layerstream/stats_fields.h"

namespace layerstream {

// The fields and what they count: LAYERSTREAM_PREDICTOR_FIELDS (stats_fields.h).
struct PredictorStats {
  LAYERSTREAM_PREDICTOR_FIELDS(LAYERSTREAM_STATS_MEMBER)
};

class AccessPredictor {
 public:
  // Keeps at most `max_history` uses (older ones are forgotten in halves).
  explicit AccessPredictor(std::size_t max_history = std::size_t{1} << 20);

  void observe(std::uint64_t layer);
  // Up to `count` layers expected next, in order; empty when nothing is known.
  std::vector<std::uint64_t> predict(std::size_t count) const;
  const PredictorStats& stats() const { return stats_; }

 private:
  static constexpr std::size_t kMaxMatch = 64;        // how far back two contexts are compared
  static constexpr std::size_t kOccurrencesKept = 16; // per layer, the most recent ones

  // How many uses before `a` and before `b` agree (up to kMaxMatch; the start of history matches all).
  std::size_t match_length(std::size_t a, std::size_t b) const;
  void reanchor();
  void rebuild_index();

  std::size_t max_history_;
  std::vector<std::uint64_t> history_;
  std::unordered_map<std::uint64_t, std::vector<std::size_t>> occurrences_;
  std::size_t cursor_ = 0;  // history index of the predicted next use; 0 with valid_ false: none
  bool valid_ = false;
  PredictorStats stats_;
};

}  // namespace layerstream
