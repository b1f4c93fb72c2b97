// What the TransferEngine's source files share (transfer_engine.cc, transfer_engine_resident.cc,
// transfer_engine_downloads.cc); not part of the public header.
#pragma once

#include <cstdint>

namespace layerstream::detail {

// Lease::fill numbers, unique in the process (a rebuilt engine must not repeat an old engine's).
std::uint64_t next_fill();

}  // namespace layerstream::detail
