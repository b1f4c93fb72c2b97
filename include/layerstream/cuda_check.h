// The CUDA error check, one form for the whole project (core backend, kernels, torch glue). Include it
// only from code built with CUDA (LAYERSTREAM_WITH_CUDA, .cu files, LAYERSTREAM_TORCH_CUDA blocks).
//
//   LS_CUDA_CHECK(call)                 throws layerstream::Error: "CUDA call `call` failed: NAME (text)"
//   LS_CUDA_CHECK_MSG(status, msg...)   throws layerstream::Error: "msg...: NAME (text)" (a status already
//                                       in hand, e.g. cudaGetLastError() after a kernel launch)
//   cuda_error_text(status)             "NAME (text)", for messages that are logged, not thrown
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "layerstream/check.h"

namespace layerstream {

inline std::string cuda_error_text(cudaError_t status) {
  return detail::concat(cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
}

}  // namespace layerstream

#define LS_CUDA_CHECK(call)                                                                    \
  do {                                                                                         \
    const cudaError_t ls_status_ = (call);                                                     \
    if (ls_status_ != cudaSuccess) {                                                           \
      LS_FAIL("CUDA call `", #call, "` failed: ", ::layerstream::cuda_error_text(ls_status_)); \
    }                                                                                          \
  } while (0)

#define LS_CUDA_CHECK_MSG(status, ...)                                                         \
  do {                                                                                         \
    const cudaError_t ls_status_ = (status);                                                   \
    if (ls_status_ != cudaSuccess) {                                                           \
      LS_FAIL(::layerstream::detail::concat(__VA_ARGS__), ": ",                                \
              ::layerstream::cuda_error_text(ls_status_));                                     \
    }                                                                                          \
  } while (0)
