// What the VRAM budget knows of a CUDA device, from torch's caching allocator, and how it hears of memory
// pressure there.
//
// - The limit: free device memory plus what torch already holds, under set_per_process_memory_fraction.
// - A windowed peak: the most bytes the process asked of the allocator from the window's start (the first
//   training forward) until now, counted from the allocator's trace events; what the process held before
//   (the model placed on the device before attach, a text encoder, samples) does not count. torch's own
//   peak statistics are left as they are (they belong to the application).
// - Pressure: torch runs every registered free-memory callback when no cached block fits an allocation,
//   before it asks the driver. The callback here gives resident copies back (DeviceState::yield_for_pressure)
//   when the device's free memory is below the headroom the budget's plan left, so that the allocation can
//   have their memory; it runs under the allocator's (recursive) lock, on the allocating thread, and takes
//   no lock of layerstream's without trying.
// Thread-safety: the trace tracker and the callback run on any allocating thread; they touch atomics and
// the device states' try-locks only.
#pragma once

#include <cstddef>

namespace layerstream::torchglue {

// Installs the budget's memory resolver for CUDA devices (DeviceState::set_memory_resolver) and the
// allocator's trace tracker behind the windowed peak. Idempotent.
void install_cuda_memory_probe();
// What one new allocation on CUDA device `device` can still get without a yield: the driver's free memory and
// torch's wholly free cached segments, within the memory fraction (0 without a CUDA torch).
std::size_t room_for_allocation(int device);

}  // namespace layerstream::torchglue
