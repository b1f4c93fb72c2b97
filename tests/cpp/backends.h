// Test helpers: every backend-agnostic test runs on "sim" and on "cuda"; cuda skips with the reason when
// this build or this machine has no GPU.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "layerstream/backend.h"
#include "layerstream/sim_backend.h"

namespace layerstream::testing {

// Empty when `kind` can run here, else why not.
std::string unavailable_reason(const std::string& kind);
std::unique_ptr<Backend> make_backend(const std::string& kind, const SimOptions& sim = {});

// Base fixture: GetParam() is the backend kind. backend() is ready in the test body.
class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  Backend& backend() { return *backend_; }
  SimBackend* sim() { return dynamic_cast<SimBackend*>(backend_.get()); }
  // Copies `bytes` at device address `src` to a new host vector, ordered after `stream`'s work.
  std::vector<unsigned char> read_back(const void* src, std::size_t bytes, StreamHandle stream);

  std::unique_ptr<Backend> backend_;
};

// Every stream, event and byte of device and pinned memory went back to the simulator.
inline void expect_all_returned(const SimBackend& sim) {
  const SimMemoryStats m = sim.memory_stats();
  EXPECT_EQ(m.device_bytes, 0u);
  EXPECT_EQ(m.pinned_bytes, 0u);
  EXPECT_EQ(m.streams, 0u);
  EXPECT_EQ(m.events, 0u);
}

#define LS_INSTANTIATE_ON_BACKENDS(suite)                                            \
  INSTANTIATE_TEST_SUITE_P(Backends, suite, ::testing::Values("sim", "cuda"),        \
                           [](const auto& info) { return info.param; })

}  // namespace layerstream::testing
