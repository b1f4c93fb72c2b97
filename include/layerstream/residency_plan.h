// Which layers stay on the device when not all of them fit (the VRAM budget's plan).
//
// Layers are given in the order a training step first uses them. The resident ones are spread evenly
// over that order instead of taken from its start: a streamed layer then sits between resident ones, whose
// compute hides its copy, where a run of streamed layers at the end of the step would leave the GPU waiting
// on the bus (their copies take longer than their compute). The bytes kept are the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace layerstream {

// keep[i]: layer i (of `bytes`, in first-use order) stays resident. At most `room` bytes are kept; every
// layer is kept when all fit. Layers are taken in a Bresenham-like sweep: layer i is kept when the bytes
// kept so far plus its own stay within room / total of the bytes seen so far including it; a second pass
// in order fills what rounding left.
std::vector<bool> spread_residency(const std::vector<std::size_t>& bytes, std::size_t room);

// Bytes copied when the layers of `bytes` are used in the order `uses` (indices into `bytes`), the
// resident ones never copied, the others through a store of `capacity` bytes that places regions as
// DeviceRing's first-in-first-out placement does with no region held: at a head that moves forward, at
// the start when the rest of the store is too short for the region, evicting every region it overlaps (a
// hit does not move a region). A use copies unless the layer is still there since it was last copied. A
// layer larger than the store is copied every time. `footprint`: what each layer takes in the store (its
// bytes rounded to the ring's alignment, a quantized layer's scratch too); empty: the bytes.
std::uint64_t replay_copies(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                            const std::vector<bool>& resident, std::size_t capacity,
                            const std::vector<std::size_t>& footprint = {});

// Copies made ahead of need, as the torch glue's prefetch makes them (DeviceState::observe_and_prefetch):
// after each use, the next `layers` uses of the loop (what the access predictor predicts once it has
// learned the loop), the used layer itself skipped, while their `bytes` (what each takes in the ring, as
// the engine counts them) add up to at most a third of the store; each one not there is copied and placed
// as a fetch places it, past the used layer's region (held while its compute runs). layers 0: none.
struct Lookahead {
  std::size_t layers = 0;
  std::vector<std::size_t> bytes;  // per layer, as `bytes`
  std::vector<bool> never;         // per layer (or empty): never copied ahead, skipped as the used one is
};

// One step of a recorded sequence of uses that repeats: its shortest period (the whole sequence when it
// does not repeat). The budget records the first step and part of the second before it plans; a replay
// of that record from an empty ring would count the first step cold and the second from wherever the
// record stops.
std::vector<std::size_t> one_step(const std::vector<std::size_t>& uses);

// Bytes copied by a step of a loop that repeats `uses` through one store (as replay_copies), each step
// beginning with what the previous one left in the store: the passes are replayed until the store is left
// as an earlier pass left it (from there the passes repeat; a step's copies are their mean over that
// period), at most kLoopPasses (then the mean of the last two). Two passes in a row that copy the same are
// not enough: a region in a gap the head skips at the end of the store can outlive a whole pass (seen on
// the simulator: the second pass overestimated a step by 2.5%, the third was exact), and after a yield's
// re-plan the loop copied the same twice and then settled 11% lower.
constexpr int kLoopPasses = 16;
std::uint64_t replay_step_in_loop(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                                  const std::vector<bool>& resident, std::size_t capacity,
                                  const std::vector<std::size_t>& footprint = {}, const Lookahead& ahead = {});

// The ring's size and the resident layers, chosen together from one step's sequence of uses (`bytes` in
// first-use order). The ring and the resident copies share `room`. A ring too small for a checkpointed
// block's layers copies them twice per step (recomputed forward, then backward); a larger ring leaves less
// room for resident layers, which cross the bus never. For each size in `ring_sizes` that fits in `room`,
// the resident layers are spread_residency(bytes, room - ring) and the step is replayed through `fill` of
// the ring as a training loop runs it (replay_step_in_loop: each step starts with what the one before
// left in the ring; the end of a backward is the start of the next forward; a replay of one step from an
// empty ring misses that reuse and favoured the smallest ring: FLUX.2-shaped under 24 GiB it estimated
// 95.4 GiB per step for 1.9 GiB and 100.0 for 6.3 GiB, where a loop copies 95.4 and 95.1). The plan with
// the fewest bytes copied wins; among plans within 1% of it, the largest ring (the lookahead is a third of
// the ring: a deeper ring fetches further ahead at the same bytes; measured on FLUX.2 under 24 GiB,
// 2026-11-30: 1.9 GiB, the former plan's, 2.230 s/step; 4 GiB 2.194; 6 GiB 2.181; this plan's 6.33 GiB
// 2.169). With fill 1 (the whole ring; a copy issued ahead of need takes the oldest region as a copy on
// demand would) the replay picked the ring that the engine's measured bytes also found best, for two
// budgets on the simulator with a checkpointed model; with 2/3 it did not. `footprint` as for
// replay_copies (resident copies take `bytes`). `ahead`: the engine's copies ahead of need, replayed too
// (without them the estimate was up to 7% under what the simulator's engine then moved; with them its
// steps move exactly the estimate. On the H200, FLUX.2-shaped in AI-Toolkit's flow, 2026-12-02: 104,400 MiB
// estimated, 118,134 counted, of which the flow's one sample among four steps, a forward over the streamed
// layers, is about 13,700 a step; with samples counted apart, the flow without the earlier peak, 2026-12-02:
// 104,688 estimated, 107,262 moved).
struct RingPlan {
  std::size_t ring_bytes = 0;
  std::vector<bool> resident;
  std::uint64_t copied_bytes = 0;  // the replay's estimate for one step of the loop (the second pass)
};
RingPlan plan_ring_and_residency(const std::vector<std::size_t>& bytes, const std::vector<std::size_t>& uses,
                                 std::size_t room, const std::vector<std::size_t>& ring_sizes,
                                 double fill = 1.0, const std::vector<std::size_t>& footprint = {},
                                 const Lookahead& ahead = {});

}  // namespace layerstream
