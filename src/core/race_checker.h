// Happens-before race detection over byte ranges, for the simulator (internal header).
//
// Actors are the host (actor 0) and the streams. Each actor carries a vector clock; an access is stamped
// with its actor and that actor's own clock component. Access B is ordered after access A when
// A.clock <= B.now[A.actor], i.e. B's actor has (through stream order, events or host synchronization)
// seen A's epoch. Two accesses to overlapping bytes race when neither is ordered after the other and at
// least one is a write; since accesses arrive in host enqueue order, only "earlier not ordered before
// later" needs checking.
// Not thread-safe: the simulator calls it under its own lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace layerstream::sim {

using VectorClock = std::vector<std::uint64_t>;

// Component `actor` of `clock`, zero when the clock has not grown that far.
inline std::uint64_t clock_at(const VectorClock& clock, std::size_t actor) {
  return actor < clock.size() ? clock[actor] : 0;
}

// clock := elementwise max(clock, other).
void join(VectorClock& clock, const VectorClock& other);

class RaceChecker {
 public:
  // Checks an access of `bytes` at `ptr` by `actor` whose current clock is `now`, then remembers it.
  void access(std::size_t actor, const VectorClock& now, const void* ptr, std::size_t bytes,
              bool is_write, const char* what);
  // Forgets every access inside [ptr, ptr + bytes): the memory was freed and may be handed out again.
  void forget(const void* ptr, std::size_t bytes);

  // The first races found, described; `race_count()` counts all of them.
  const std::vector<std::string>& violations() const { return violations_; }
  std::uint64_t race_count() const { return races_; }
  void clear_violations() {
    violations_.clear();
    races_ = 0;
  }
  std::uint64_t checked() const { return checked_; }

 private:
  struct Access {
    std::uintptr_t begin;
    std::uintptr_t end;
    std::size_t actor;
    std::uint64_t clock;
    bool is_write;
    const char* what;
  };
  std::vector<Access> accesses_;
  std::vector<std::string> violations_;
  std::uint64_t checked_ = 0;
  std::uint64_t races_ = 0;
};

}  // namespace layerstream::sim
