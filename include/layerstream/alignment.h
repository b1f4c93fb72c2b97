// The one alignment layerstream places blocks at: pinned arena blocks, device ring regions, simulated
// device and pinned allocations, and the offsets inside a packed layer. 256 bytes is what cudaMalloc
// guarantees, so a block of ours may stand where a torch allocation would (every vectorized load fits).
#pragma once

#include <cstddef>

namespace layerstream {

inline constexpr std::size_t kBlockAlignment = 256;

}  // namespace layerstream
