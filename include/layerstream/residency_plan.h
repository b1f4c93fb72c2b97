// Which layers stay on the device when not all of them fit (the VRAM budget's plan).
//
// Layers are given in the order a training step first uses them. The resident ones are spread evenly
// over that order instead of taken from its start: a streamed layer then sits between resident ones, whose
// compute hides its copy, where a run of streamed layers at the end of the step would leave the GPU waiting
// on the bus (their copies take longer than their compute). The bytes kept are the same.
#pragma once

#include <cstddef>
#include <vector>

namespace layerstream {

// keep[i]: layer i (of `bytes`, in first-use order) stays resident. At most `room` bytes are kept; every
// layer is kept when all fit. Layers are taken in a Bresenham-like sweep: layer i is kept when the bytes
// kept so far plus its own stay within room / total of the bytes seen so far including it; a second pass
// in order fills what rounding left.
std::vector<bool> spread_residency(const std::vector<std::size_t>& bytes, std::size_t room);

}  // namespace layerstream
