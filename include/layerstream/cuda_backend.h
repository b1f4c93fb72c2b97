// CudaBackend: the Backend over the CUDA runtime API.
//
// Every CUDA call is checked with LS_CUDA_CHECK (throws layerstream::Error with the CUDA error name, the
// call and file:line). Each call runs with the backend's device current and restores the caller's device
// afterwards, so a backend for cuda:1 never touches device 0's context or streams.
// Streams are created non-blocking (they do not synchronize with the legacy default stream). Events are
// created with timing disabled (cheapest to record and wait on).
//
// Built only when layerstream is configured with CUDA; otherwise make_cuda_backend() throws, and
// cuda_device_count() returns 0 with cuda_unavailable_reason() saying why.
#pragma once

#include <memory>
#include <string>

#include "layerstream/backend.h"

namespace layerstream {

// Whether this build of layerstream includes the CUDA backend.
bool cuda_compiled();
// Number of usable CUDA devices (0 when none, or when the driver cannot be reached).
int cuda_device_count();
// Why cuda_device_count() is 0: not compiled, no driver, no device. Empty when devices exist.
std::string cuda_unavailable_reason();
// A backend bound to CUDA device `device`. Throws layerstream::Error when CUDA is unavailable.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace layerstream
