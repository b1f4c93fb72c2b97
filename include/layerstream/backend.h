// The GPU seen through a small interface, so that everything above it runs unchanged on a real device
// (CudaBackend) and on host threads that play the device (SimBackend).
//
// Ownership: a Backend owns nothing on behalf of its callers. Handles it returns are raw; wrap them in the
// move-only RAII types below (Stream, Event, DeviceBuffer, PinnedBuffer), which give them back on
// destruction. A Backend must outlive every handle made from it.
//
// Device: a Backend is bound to one device for its lifetime; every call it makes is made on that device
// (the CUDA implementation guards the current device and restores the caller's).
//
// Streams and events follow CUDA's rules exactly:
//   * work enqueued on one stream runs in order; work on different streams is unordered unless an event
//     orders it;
//   * event_record(e, s) captures the work enqueued on s so far; a later record of the same event
//     replaces what the event refers to, but waits already enqueued keep the capture they saw;
//   * stream_wait_event(s, e) makes later work on s wait for e's capture, without blocking the host;
//   * event_query is true when the capture has completed (and for an event never recorded);
//   * host memory passed to an async copy must stay untouched by the host until the copy completes.
// StreamHandle{} (null) is not a valid stream for any call here.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace layerstream {

struct StreamHandle {
  void* raw = nullptr;
  explicit operator bool() const { return raw != nullptr; }
  friend bool operator==(StreamHandle a, StreamHandle b) { return a.raw == b.raw; }
  friend bool operator!=(StreamHandle a, StreamHandle b) { return a.raw != b.raw; }
};

struct EventHandle {
  void* raw = nullptr;
  explicit operator bool() const { return raw != nullptr; }
  friend bool operator==(EventHandle a, EventHandle b) { return a.raw == b.raw; }
};

enum class BackendKind { kCuda, kSim };

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  // Human-readable, e.g. "cuda:0 (NVIDIA H200)" or "sim:0".
  virtual std::string name() const = 0;
  virtual int device() const = 0;

  virtual StreamHandle stream_create() = 0;
  virtual void stream_destroy(StreamHandle stream) noexcept = 0;
  virtual void stream_synchronize(StreamHandle stream) = 0;
  virtual void stream_wait_event(StreamHandle stream, EventHandle event) = 0;

  virtual EventHandle event_create() = 0;
  virtual void event_destroy(EventHandle event) noexcept = 0;
  virtual void event_record(EventHandle event, StreamHandle stream) = 0;
  virtual bool event_query(EventHandle event) = 0;
  virtual void event_synchronize(EventHandle event) = 0;
  // Events that also keep the time they completed at (cudaEventDefault; the others have timing off, which
  // makes them cheaper), and the milliseconds between two completed ones.
  virtual EventHandle event_create_timed() = 0;
  virtual double event_elapsed_ms(EventHandle start, EventHandle end) = 0;

  // Page-locked host memory. Returns nullptr when the platform refuses (not an error: callers fall back).
  virtual void* host_alloc_pinned(std::size_t bytes) = 0;
  virtual void host_free_pinned(void* ptr) noexcept = 0;
  // Pins memory the caller already owns (cudaHostRegister). Returns false when refused.
  // `read_only`: the range is mapped read-only (shared weights); the device only reads it.
  virtual bool host_register(void* ptr, std::size_t bytes, bool read_only = false) = 0;
  virtual void host_unregister(void* ptr) noexcept = 0;

  // Device memory. Returns nullptr when the device is out of memory.
  virtual void* device_alloc(std::size_t bytes) = 0;
  virtual void device_free(void* ptr) noexcept = 0;
  // Free and total bytes of device memory, as the driver reports them.
  virtual std::pair<std::size_t, std::size_t> device_memory_info() = 0;

  virtual void memcpy_h2d_async(void* device_dst, const void* host_src, std::size_t bytes,
                                StreamHandle stream) = 0;
  virtual void memcpy_d2h_async(void* host_dst, const void* device_src, std::size_t bytes,
                                StreamHandle stream) = 0;
  // Runs `fn` on a host thread once all earlier work on `stream` is done; later work waits for it.
  // `fn` must not call back into the Backend.
  virtual void launch_host_func(StreamHandle stream, std::function<void()> fn) = 0;

  // Declarations of memory accesses made by work the Backend cannot see (kernels launched elsewhere on
  // `stream`, or the host thread itself). The simulator's race checker uses them; CUDA ignores them.
  virtual void annotate_stream_access(StreamHandle stream, const void* ptr, std::size_t bytes,
                                      bool is_write) {
    (void)stream, (void)ptr, (void)bytes, (void)is_write;
  }
  virtual void annotate_host_access(const void* ptr, std::size_t bytes, bool is_write) {
    (void)ptr, (void)bytes, (void)is_write;
  }
};

// ---- Move-only RAII owners of backend resources --------------------------------------------------------
// Each remembers its Backend (and through it, its device). Destructors never throw.

class Stream {
 public:
  Stream() = default;
  explicit Stream(Backend& backend) : backend_(&backend), handle_(backend.stream_create()) {}
  ~Stream() { reset(); }
  Stream(Stream&& other) noexcept { *this = std::move(other); }
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = std::exchange(other.backend_, nullptr);
      handle_ = std::exchange(other.handle_, StreamHandle{});
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamHandle get() const { return handle_; }
  explicit operator bool() const { return static_cast<bool>(handle_); }
  void reset() noexcept {
    if (handle_) backend_->stream_destroy(handle_);
    handle_ = StreamHandle{};
  }

 private:
  Backend* backend_ = nullptr;
  StreamHandle handle_;
};

class Event {
 public:
  Event() = default;
  explicit Event(Backend& backend, bool timed = false)
      : backend_(&backend), handle_(timed ? backend.event_create_timed() : backend.event_create()) {}
  ~Event() { reset(); }
  Event(Event&& other) noexcept { *this = std::move(other); }
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = std::exchange(other.backend_, nullptr);
      handle_ = std::exchange(other.handle_, EventHandle{});
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  EventHandle get() const { return handle_; }
  explicit operator bool() const { return static_cast<bool>(handle_); }
  void record(StreamHandle stream) { backend_->event_record(handle_, stream); }
  bool query() const { return backend_->event_query(handle_); }
  void synchronize() const { backend_->event_synchronize(handle_); }
  void reset() noexcept {
    if (handle_) backend_->event_destroy(handle_);
    handle_ = EventHandle{};
  }

 private:
  Backend* backend_ = nullptr;
  EventHandle handle_;
};

// An alternative source of device memory (allocate returns nullptr when out of memory). `allocate` is told
// the stream that will write the memory first: a stream-ordered allocator (PyTorch's caching allocator) must
// hand out memory that is free in that stream's order. Memory freed by another stream with its kernels
// still queued is not: a copy on our stream could land before (or under) them. The owner frees a buffer
// only after every use on any stream is done, so what goes back is free in every stream's order.
struct DeviceAllocator {
  std::function<void*(std::size_t, StreamHandle)> allocate;
  std::function<void(void*)> deallocate;
  explicit operator bool() const { return static_cast<bool>(allocate); }
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Allocates `bytes` on the backend's device (through `allocator` when given, for use first on
  // `first_writer`); throws layerstream::Error naming the size when refused.
  DeviceBuffer(Backend& backend, std::size_t bytes, DeviceAllocator allocator = {},
               StreamHandle first_writer = {});
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = std::exchange(other.backend_, nullptr);
      allocator_ = std::exchange(other.allocator_, DeviceAllocator{});
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }
  void reset() noexcept {
    if (ptr_) {
      if (allocator_) {
        allocator_.deallocate(ptr_);
      } else {
        backend_->device_free(ptr_);
      }
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  Backend* backend_ = nullptr;
  DeviceAllocator allocator_;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Host memory that is pinned when the platform allows it and pageable otherwise (PinnedBuffer::pinned()
// tells which). Pageable memory is page-aligned.
enum class PinMethod {
  kHostAlloc,  // cudaHostAlloc
  kRegister,   // anonymous mmap + cudaHostRegister (pins memory the process already owns)
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  // Never fails for lack of pinning; throws layerstream::Error only when even pageable memory is refused.
  // `allow_pin` false skips the pin attempt (host cap reached).
  PinnedBuffer(Backend& backend, std::size_t bytes, PinMethod method, bool allow_pin = true);
  ~PinnedBuffer() { reset(); }
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }
  bool pinned() const { return how_ != How::kPageable; }
  void reset() noexcept;

 private:
  enum class How { kHostAlloc, kRegistered, kPageable };
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  How how_ = How::kPageable;
};

}  // namespace layerstream
