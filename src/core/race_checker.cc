#include "race_checker.h"

#include <algorithm>

#include "layerstream/check.h"

namespace layerstream::sim {

namespace {
// Beyond this many reported races only a count is kept: one broken rule can repeat thousands of times.
constexpr std::size_t kMaxReported = 64;

std::string actor_name(std::size_t actor) {
  return actor == 0 ? std::string("host") : detail::concat("stream#", actor);
}
}  // namespace

void join(VectorClock& clock, const VectorClock& other) {
  if (clock.size() < other.size()) clock.resize(other.size(), 0);
  for (std::size_t i = 0; i < other.size(); ++i) clock[i] = std::max(clock[i], other[i]);
}

void RaceChecker::access(std::size_t actor, const VectorClock& now, const void* ptr,
                         std::size_t bytes, bool is_write, const char* what) {
  if (bytes == 0) return;
  ++checked_;
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  const auto end = begin + bytes;
  const Access incoming{begin, end, actor, clock_at(now, actor), is_write, what};

  auto ordered_before_incoming = [&](const Access& a) { return a.clock <= clock_at(now, a.actor); };

  for (const Access& a : accesses_) {
    if (a.end <= begin || a.begin >= end) continue;
    if (!a.is_write && !is_write) continue;
    if (ordered_before_incoming(a)) continue;
    ++races_;
    if (violations_.size() < kMaxReported) {
      violations_.push_back(detail::concat(
          what, " (", is_write ? "write" : "read", " by ", actor_name(actor), ") of [0x", std::hex,
          begin, ", 0x", end, std::dec, ") races with an earlier ", a.what, " (",
          a.is_write ? "write" : "read", " by ", actor_name(a.actor), ", epoch ", a.clock,
          ") that no stream order or event places before it"));
    } else if (violations_.size() == kMaxReported) {
      violations_.push_back("... further races not listed");
    }
  }

  // Drop what the incoming access supersedes: an access inside its range, ordered before it, and either
  // a read or overwritten by it. Any later access that would race with the dropped one races with the
  // incoming one too, so no verdict is lost.
  accesses_.erase(std::remove_if(accesses_.begin(), accesses_.end(),
                                 [&](const Access& a) {
                                   return a.begin >= begin && a.end <= end &&
                                          ordered_before_incoming(a) && (is_write || !a.is_write);
                                 }),
                  accesses_.end());
  accesses_.push_back(incoming);
}

void RaceChecker::forget(const void* ptr, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  const auto end = begin + bytes;
  accesses_.erase(std::remove_if(accesses_.begin(), accesses_.end(),
                                 [&](const Access& a) { return a.begin >= begin && a.end <= end; }),
                  accesses_.end());
}

}  // namespace layerstream::sim
