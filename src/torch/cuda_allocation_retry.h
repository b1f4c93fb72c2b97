// A tensor allocation that runs out of device memory while a VRAM budget keeps layers resident: the layers
// are given back and the allocation is tried again, so that the memory the budget borrowed returns on demand
// (issue 45: the elastic budget is safe for any single allocation that fits beside the smallest ring).
//
// torch's free-memory callback (cuda_memory.cc) is not told an allocation's size, and its out-of-memory
// observer runs only before the error is raised. So torch's CUDA allocator is wrapped: every call goes to the
// allocator torch had (the native caching allocator, or cudaMallocAsync), and a tensor allocation that raises
// torch's out-of-memory error gives back resident layers on its device, at least its size, and is tried again,
// then once more after all of them. The wrapper is installed the first time a budget starts measuring (never
// with the default "min" budget's nothing-resident plan), and only on torch releases whose allocator interface
// it delegates in full (2.11 to 2.13); elsewhere the observer alone remains.
// Thread-safety: allocate() runs on any allocating thread, outside torch's allocator lock; the yield takes the
// device states' locks only by trying (DeviceState::yield_for_pressure), and logs nothing.
#pragma once

#include <cstddef>

namespace layerstream::torchglue {

// Wraps torch's CUDA allocator once per process. Idempotent; a no-op where the wrapper is not built.
void install_allocation_retry();
// True on a thread whose allocation is on its first try inside the wrapper (the out-of-memory observer
// leaves the yield to the wrapper, which knows the size).
bool allocation_retry_armed();
bool allocation_retry_installed();
// Allocations tried again after a yield, in this process.
std::size_t allocation_retries();

}  // namespace layerstream::torchglue
