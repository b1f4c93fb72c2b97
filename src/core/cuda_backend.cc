#include "layerstream/cuda_backend.h"

#include "layerstream/check.h"

#ifdef LAYERSTREAM_WITH_CUDA

#include <cuda_runtime_api.h>

#include <functional>

#include "layerstream/cuda_check.h"
#include "layerstream/log.h"

namespace layerstream {

namespace {

// Makes `device` current for the scope and restores the previous device; a no-op when it already is.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) LS_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);  // destructor: best effort, never throws
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Called from noexcept paths (destroy/free): a failure there cannot be thrown, so it is logged.
void warn_on_error(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    log(LogLevel::kWarning, detail::concat(what, " failed: ", cuda_error_text(status)));
  }
}

cudaStream_t as_stream(StreamHandle h) {
  LS_CHECK_ARG(h, "cuda backend: null stream handle");
  return static_cast<cudaStream_t>(h.raw);
}
cudaEvent_t as_event(EventHandle h) {
  LS_CHECK_ARG(h, "cuda backend: null event handle");
  return static_cast<cudaEvent_t>(h.raw);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int count = 0;
    LS_CUDA_CHECK(cudaGetDeviceCount(&count));
    LS_CHECK_ARG(device >= 0 && device < count, "CUDA device ", device, " does not exist (",
                 count, " visible); check CUDA_VISIBLE_DEVICES");
    cudaDeviceProp prop{};
    LS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    name_ = detail::concat("cuda:", device, " (", prop.name, ")");
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string name() const override { return name_; }
  int device() const override { return device_; }

  StreamHandle stream_create() override {
    DeviceGuard guard(device_);
    cudaStream_t s = nullptr;
    LS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return StreamHandle{s};
  }
  void stream_destroy(StreamHandle stream) noexcept override {
    if (!stream) return;
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    cudaSetDevice(device_);
    warn_on_error(cudaStreamDestroy(static_cast<cudaStream_t>(stream.raw)), "cudaStreamDestroy");
    cudaSetDevice(previous);
  }
  void stream_synchronize(StreamHandle stream) override {
    LS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
  void stream_wait_event(StreamHandle stream, EventHandle event) override {
    DeviceGuard guard(device_);
    LS_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
  }

  EventHandle event_create() override {
    DeviceGuard guard(device_);
    cudaEvent_t e = nullptr;
    LS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return EventHandle{e};
  }
  EventHandle event_create_timed() override {
    DeviceGuard guard(device_);
    cudaEvent_t e = nullptr;
    LS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
    return EventHandle{e};
  }
  double event_elapsed_ms(EventHandle start, EventHandle end) override {
    float ms = 0.0f;
    LS_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
    return ms;
  }
  void event_destroy(EventHandle event) noexcept override {
    if (!event) return;
    warn_on_error(cudaEventDestroy(static_cast<cudaEvent_t>(event.raw)), "cudaEventDestroy");
  }
  void event_record(EventHandle event, StreamHandle stream) override {
    DeviceGuard guard(device_);
    LS_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
  }
  bool event_query(EventHandle event) override {
    const cudaError_t status = cudaEventQuery(as_event(event));
    if (status == cudaErrorNotReady) return false;  // not an error: the capture is still pending
    LS_CUDA_CHECK(status);
    return true;
  }
  void event_synchronize(EventHandle event) override {
    LS_CUDA_CHECK(cudaEventSynchronize(as_event(event)));
  }

  void* host_alloc_pinned(std::size_t bytes) override {
    LS_CHECK_ARG(bytes > 0, "host_alloc_pinned: size must be positive");
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      log(LogLevel::kDebug, detail::concat("cudaHostAlloc(", bytes, ") refused: ",
                                           cudaGetErrorName(status)));
      return nullptr;
    }
    return p;
  }
  void host_free_pinned(void* ptr) noexcept override {
    if (ptr != nullptr) warn_on_error(cudaFreeHost(ptr), "cudaFreeHost");
  }
  bool host_register(void* ptr, std::size_t bytes, bool read_only) override {
    DeviceGuard guard(device_);
    const unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0u);
    const cudaError_t status = cudaHostRegister(ptr, bytes, flags);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      log(LogLevel::kDebug, detail::concat("cudaHostRegister(", bytes, ") refused: ",
                                           cudaGetErrorName(status)));
      return false;
    }
    return true;
  }
  void host_unregister(void* ptr) noexcept override {
    if (ptr != nullptr) warn_on_error(cudaHostUnregister(ptr), "cudaHostUnregister");
  }

  void* device_alloc(std::size_t bytes) override {
    LS_CHECK_ARG(bytes > 0, "device_alloc: size must be positive");
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    LS_CUDA_CHECK(status);
    return p;
  }
  void device_free(void* ptr) noexcept override {
    if (ptr == nullptr) return;
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    cudaSetDevice(device_);
    warn_on_error(cudaFree(ptr), "cudaFree");
    cudaSetDevice(previous);
  }
  std::pair<std::size_t, std::size_t> device_memory_info() override {
    DeviceGuard guard(device_);
    std::size_t free_bytes = 0, total_bytes = 0;
    LS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return {free_bytes, total_bytes};
  }

  void memcpy_h2d_async(void* device_dst, const void* host_src, std::size_t bytes,
                        StreamHandle stream) override {
    DeviceGuard guard(device_);
    LS_CUDA_CHECK(
        cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, as_stream(stream)));
  }
  void memcpy_d2h_async(void* host_dst, const void* device_src, std::size_t bytes,
                        StreamHandle stream) override {
    DeviceGuard guard(device_);
    LS_CUDA_CHECK(
        cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)));
  }
  void launch_host_func(StreamHandle stream, std::function<void()> fn) override {
    DeviceGuard guard(device_);
    auto* payload = new std::function<void()>(std::move(fn));
    const cudaError_t status = cudaLaunchHostFunc(
        as_stream(stream),
        [](void* data) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(data));
          (*f)();
        },
        payload);
    if (status != cudaSuccess) delete payload;
    LS_CUDA_CHECK(status);
  }

 private:
  int device_;
  std::string name_;
};

}  // namespace

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return "the CUDA runtime found no usable device: " + cuda_error_text(status);
  }
  return count == 0 ? "no CUDA device is visible" : "";
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace layerstream

#else  // !LAYERSTREAM_WITH_CUDA

namespace layerstream {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_unavailable_reason() {
  return "layerstream was built without CUDA (LAYERSTREAM_CUDA=OFF or nvcc not found)";
}
std::unique_ptr<Backend> make_cuda_backend(int device) {
  LS_FAIL("cannot create a CUDA backend for device ", device, ": ", cuda_unavailable_reason(),
          "; rebuild with -DLAYERSTREAM_CUDA=ON");
}

}  // namespace layerstream

#endif
