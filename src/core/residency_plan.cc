#include "layerstream/residency_plan.h"

#include <algorithm>
#include <array>
#include <cstddef>

#include "layerstream/check.h"

namespace layerstream {

std::vector<bool> spread_residency(const std::vector<std::size_t>& bytes, std::size_t room) {
  std::vector<bool> keep(bytes.size(), false);
  long double total = 0;
  for (std::size_t b : bytes) total += static_cast<long double>(b);
  if (total == 0) return keep;
  const long double share = static_cast<long double>(room) / total;  // the fraction of bytes that fits
  std::size_t kept = 0;
  long double seen = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    seen += static_cast<long double>(bytes[i]);
    if (kept + bytes[i] <= room && static_cast<long double>(kept + bytes[i]) <= share * seen) {
      keep[i] = true;
      kept += bytes[i];
    }
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {  // what the sweep's rounding left
    if (!keep[i] && kept + bytes[i] <= room) {
      keep[i] = true;
      kept += bytes[i];
    }
  }
  return keep;
}

namespace {

// The store of replay_copies, kept across passes over a sequence of uses.
class RingModel {
 public:
  RingModel(const std::vector<std::size_t>& bytes, const std::vector<bool>& resident, std::size_t capacity,
            const std::vector<std::size_t>& footprint)
      : bytes_(bytes), resident_(resident), held_by_(footprint.empty() ? bytes : footprint),
        capacity_(capacity), present_(bytes.size(), false) {
    LS_CHECK_ARG(resident.size() == bytes.size(), "replay_copies: ", resident.size(), " residency flags for ",
                 bytes.size(), " layers");
    LS_CHECK_ARG(footprint.empty() || footprint.size() == bytes.size(), "replay_copies: ", footprint.size(),
                 " footprints for ", bytes.size(), " layers");
  }

  // What the next pass starts from: the head and the regions (by offset). Two passes from equal states copy
  // the same, and so does every pass after them.
  struct State {
    std::size_t head = 0;
    std::vector<std::array<std::size_t, 3>> regions;  // offset, size, layer
    bool operator==(const State& o) const { return head == o.head && regions == o.regions; }
  };
  State state() const {
    State s{head_, {}};
    s.regions.reserve(live_.size());
    for (const Placed& r : live_) s.regions.push_back({r.offset, r.size, r.layer});
    std::sort(s.regions.begin(), s.regions.end());
    return s;
  }

  // Bytes copied by these uses, from the store as the previous calls left it; with `ahead`, the copies
  // made ahead of need too (the next uses looked at wrap around to the sequence's start: a loop's next step).
  std::uint64_t run(const std::vector<std::size_t>& uses, const Lookahead& ahead = {}) {
    LS_CHECK_ARG(ahead.layers == 0 || ahead.bytes.size() == bytes_.size(), "replay: ", ahead.bytes.size(),
                 " lookahead sizes for ", bytes_.size(), " layers");
    LS_CHECK_ARG(ahead.never.empty() || ahead.never.size() == bytes_.size(), "replay: ", ahead.never.size(),
                 " lookahead flags for ", bytes_.size(), " layers");
    std::uint64_t copied = 0;
    for (std::size_t i = 0; i < uses.size(); ++i) {
      const std::size_t layer = uses[i];
      LS_CHECK_ARG(layer < bytes_.size(), "replay_copies: use of layer ", layer, " of ", bytes_.size());
      if (!resident_[layer] && !present_[layer]) {
        copied += bytes_[layer];
        place(layer, kNoLayer);
      }
      std::size_t planned = 0;
      for (std::size_t k = 1; k <= ahead.layers; ++k) {
        const std::size_t next = uses[(i + k) % uses.size()];
        if (next == layer || (!ahead.never.empty() && ahead.never[next])) continue;
        planned += ahead.bytes[next];
        if (planned > capacity_ / 3) break;
        if (resident_[next] || present_[next]) continue;
        if (place(next, present_[layer] ? layer : kNoLayer)) copied += bytes_[next];
      }
    }
    return copied;
  }

 private:
  struct Placed {
    std::size_t offset, size, layer;
  };
  static constexpr std::size_t kNoLayer = static_cast<std::size_t>(-1);

  static bool overlaps(std::size_t a, std::size_t a_size, std::size_t b, std::size_t b_size) {
    return a < b + b_size && b < a + a_size;
  }

  // As DeviceRing's first-in-first-out placement: at the head, or at the start when the end is short, past
  // the region of `held` (kNoLayer: none) when it is in the way. False when nothing was placed: a layer
  // larger than the store (copied at every use) or, past the held region, no room.
  bool place(std::size_t layer, std::size_t held) {
    const std::size_t size = held_by_[layer];
    if (size > capacity_ || size == 0) return false;  // larger than the store: copied at every use
    std::size_t at = head_ + size <= capacity_ ? head_ : 0;
    if (held != kNoLayer) {
      const auto it = std::find_if(live_.begin(), live_.end(), [&](const Placed& r) { return r.layer == held; });
      std::size_t scanned = 0;
      while (it != live_.end() && overlaps(at, size, it->offset, it->size)) {
        scanned += it->offset + it->size - at;
        at = it->offset + it->size;
        if (at + size > capacity_) {
          scanned += capacity_ - at;
          at = 0;
        }
        if (scanned > capacity_ + size) return false;
      }
    }
    live_.erase(std::remove_if(live_.begin(), live_.end(),
                               [&](const Placed& r) {
                                 const bool hit = overlaps(at, size, r.offset, r.size);
                                 if (hit) present_[r.layer] = false;
                                 return hit;
                               }),
                live_.end());
    live_.push_back({at, size, layer});
    present_[layer] = true;
    head_ = at + size == capacity_ ? 0 : at + size;
    return true;
  }

  const std::vector<std::size_t>& bytes_;
  const std::vector<bool>& resident_;
  const std::vector<std::size_t>& held_by_;
  std::size_t capacity_;
  std::vector<bool> present_;
  std::vector<Placed> live_;  // the store's regions, in no particular order
  std::size_t head_ = 0;
};

}  // namespace

std::uint64_t replay_copies(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                            const std::vector<bool>& resident, std::size_t capacity,
                            const std::vector<std::size_t>& footprint) {
  return RingModel(bytes, resident, capacity, footprint).run(uses);
}

std::vector<std::size_t> one_step(const std::vector<std::size_t>& uses) {
  // Knuth-Morris-Pratt's failure function: border[i] is the length of the longest proper prefix of
  // uses[0..i] that is also its suffix; n - border[n - 1] is the shortest period.
  const std::size_t n = uses.size();
  if (n == 0) return {};
  std::vector<std::size_t> border(n, 0);
  for (std::size_t i = 1; i < n; ++i) {
    std::size_t k = border[i - 1];
    while (k > 0 && uses[i] != uses[k]) k = border[k - 1];
    border[i] = uses[i] == uses[k] ? k + 1 : 0;
  }
  const std::size_t period = n - border[n - 1];
  return std::vector<std::size_t>(uses.begin(), uses.begin() + static_cast<std::ptrdiff_t>(period));
}

std::uint64_t replay_step_in_loop(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                                  const std::vector<bool>& resident, std::size_t capacity,
                                  const std::vector<std::size_t>& footprint, const Lookahead& ahead) {
  RingModel ring(bytes, resident, capacity, footprint);
  ring.run(uses, ahead);  // the first step, from an empty store
  std::vector<RingModel::State> after{ring.state()};  // after[k]: the store after pass k + 1
  std::vector<std::uint64_t> copied;                  // copied[k]: by pass k + 2, from after[k]
  for (int pass = 2; pass <= kLoopPasses; ++pass) {
    copied.push_back(ring.run(uses, ahead));
    RingModel::State now = ring.state();
    for (std::size_t k = 0; k < after.size(); ++k) {
      if (!(after[k] == now)) continue;
      // The passes from after[k] on repeat forever: a step's copies are their mean over one period.
      const std::size_t period = after.size() - k;
      std::uint64_t sum = 0;
      for (std::size_t j = k; j < copied.size(); ++j) sum += copied[j];
      return sum / period;
    }
    after.push_back(std::move(now));
  }
  // Not settled within kLoopPasses: the mean of the last two passes.
  return (copied[copied.size() - 1] + copied[copied.size() - 2]) / 2;
}

RingPlan plan_ring_and_residency(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                                 std::size_t room, const std::vector<std::size_t>& ring_sizes, double fill,
                                 const std::vector<std::size_t>& footprint, const Lookahead& ahead) {
  LS_CHECK_ARG(!ring_sizes.empty(), "plan_ring_and_residency: no ring size to choose from");
  LS_CHECK_ARG(fill > 0 && fill <= 1, "plan_ring_and_residency: fill must be in (0, 1], got ", fill);
  std::vector<RingPlan> plans;
  for (std::size_t ring : ring_sizes) {
    if (ring > room && !plans.empty()) continue;  // the first size is taken even when nothing fits beside it
    RingPlan plan;
    plan.ring_bytes = ring;
    plan.resident = spread_residency(bytes, room > ring ? room - ring : 0);
    plan.copied_bytes = replay_step_in_loop(
        bytes, uses, plan.resident, static_cast<std::size_t>(static_cast<double>(ring) * fill), footprint, ahead);
    plans.push_back(std::move(plan));
  }
  std::uint64_t fewest = plans.front().copied_bytes;
  for (const RingPlan& plan : plans) fewest = std::min(fewest, plan.copied_bytes);
  const std::uint64_t within = fewest + fewest / 100;  // 1%: see the header
  const RingPlan* best = nullptr;
  for (const RingPlan& plan : plans) {
    if (plan.copied_bytes > within) continue;
    // Nothing copied: no lookahead to deepen; the smallest ring leaves the most of the room free.
    if (!best || (fewest == 0 ? plan.ring_bytes < best->ring_bytes : plan.ring_bytes > best->ring_bytes)) {
      best = &plan;
    }
  }
  return *best;
}

}  // namespace layerstream
