#include "backends.h"

#include "layerstream/cuda_backend.h"

namespace layerstream::testing {

std::string unavailable_reason(const std::string& kind) {
  if (kind == "sim") return "";
  if (kind == "cuda") {
    if (!cuda_compiled()) return cuda_unavailable_reason();
    if (cuda_device_count() == 0) return "no GPU on this machine: " + cuda_unavailable_reason();
    return "";
  }
  return "unknown backend kind " + kind;
}

std::unique_ptr<Backend> make_backend(const std::string& kind, const SimOptions& sim) {
  if (kind == "sim") return std::make_unique<SimBackend>(sim);
  return make_cuda_backend(0);
}

void BackendTest::SetUp() {
  const std::string reason = unavailable_reason(GetParam());
  if (!reason.empty()) GTEST_SKIP() << reason;
  backend_ = make_backend(GetParam());
}

std::vector<unsigned char> BackendTest::read_back(const void* src, std::size_t bytes,
                                                  StreamHandle stream) {
  PinnedBuffer host(backend(), bytes, PinMethod::kHostAlloc);
  backend().memcpy_d2h_async(host.data(), src, bytes, stream);
  backend().stream_synchronize(stream);
  const auto* p = static_cast<const unsigned char*>(host.data());
  return std::vector<unsigned char>(p, p + bytes);
}

}  // namespace layerstream::testing
