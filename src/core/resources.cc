// DeviceBuffer and PinnedBuffer: the RAII owners whose acquisition can fail or fall back.
#include <utility>

#include "layerstream/backend.h"
#include "layerstream/check.h"

#ifdef _WIN32
#include <windows.h>
#else
#include <sys/mman.h>
#endif

namespace layerstream {

namespace {

// Page-aligned anonymous memory straight from the OS, so that freeing it really returns it (no heap
// fragmentation, nothing for malloc_trim to find).
void* os_alloc(std::size_t bytes) {
#ifdef _WIN32
  return VirtualAlloc(nullptr, bytes, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE);
#else
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
#endif
}

void os_free(void* ptr, std::size_t bytes) noexcept {
#ifdef _WIN32
  (void)bytes;
  VirtualFree(ptr, 0, MEM_RELEASE);
#else
  munmap(ptr, bytes);
#endif
}

}  // namespace

DeviceBuffer::DeviceBuffer(Backend& backend, std::size_t bytes, DeviceAllocator allocator,
                           StreamHandle first_writer)
    : backend_(&backend), allocator_(std::move(allocator)), bytes_(bytes) {
  LS_CHECK_ARG(bytes > 0, "DeviceBuffer: size must be positive");
  LS_CHECK_ARG(!allocator_ || first_writer, "DeviceBuffer: an allocator needs the stream that writes first");
  ptr_ = allocator_ ? allocator_.allocate(bytes, first_writer) : backend.device_alloc(bytes);
  if (ptr_ == nullptr) {
    const auto [free_bytes, total_bytes] = backend.device_memory_info();
    bytes_ = 0;
    throw OutOfDeviceMemory(detail::concat(
        "out of device memory on ", backend.name(), ": could not allocate ", bytes, " bytes (", free_bytes,
        " of ", total_bytes, " bytes free); lower the ring size or the VRAM budget, or free memory first"));
  }
}

PinnedBuffer::PinnedBuffer(Backend& backend, std::size_t bytes, PinMethod method, bool allow_pin)
    : backend_(&backend), bytes_(bytes) {
  LS_CHECK_ARG(bytes > 0, "PinnedBuffer: size must be positive");
  if (allow_pin && method == PinMethod::kHostAlloc) {
    ptr_ = backend.host_alloc_pinned(bytes);
    if (ptr_ != nullptr) {
      how_ = How::kHostAlloc;
      return;
    }
  }
  ptr_ = os_alloc(bytes);
  LS_CHECK(ptr_ != nullptr, "out of host memory: could not allocate ", bytes,
           " bytes of pageable memory; free host RAM or offload fewer layers");
  how_ = How::kPageable;
  if (allow_pin && method == PinMethod::kRegister && backend.host_register(ptr_, bytes)) {
    how_ = How::kRegistered;
  }
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = std::exchange(other.backend_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    how_ = std::exchange(other.how_, How::kPageable);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (ptr_ != nullptr) {
    switch (how_) {
      case How::kHostAlloc:
        backend_->host_free_pinned(ptr_);
        break;
      case How::kRegistered:
        backend_->host_unregister(ptr_);
        os_free(ptr_, bytes_);
        break;
      case How::kPageable:
        os_free(ptr_, bytes_);
        break;
    }
  }
  ptr_ = nullptr;
  bytes_ = 0;
  how_ = How::kPageable;
}

}  // namespace layerstream
