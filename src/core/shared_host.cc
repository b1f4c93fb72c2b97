#include "layerstream/shared_host.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <thread>

#include "layerstream/check.h"
#include "layerstream/log.h"

#ifndef _WIN32
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace layerstream {

namespace {
constexpr std::uint64_t kMagic = 0x6C73686172656431ull;  // "lshared1"
enum State : std::uint32_t { kFilling = 0, kReady = 1, kFailed = 2 };
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "shared-memory flags need lock-free atomics");
}  // namespace

// Lives at the start of the mapping; every process sees the same bytes.
struct SharedHostSegment::Header {
  std::atomic<std::uint64_t> magic;
  std::uint64_t bytes;
  std::uint32_t followers;
  std::atomic<std::uint32_t> state;
  std::atomic<std::uint32_t> joined;
};
static_assert(sizeof(std::atomic<std::uint64_t>) == 8, "unexpected atomic layout");

#ifdef _WIN32

std::unique_ptr<SharedHostSegment> SharedHostSegment::create(Backend&, const std::string&, std::size_t, std::uint32_t) {
  LS_FAIL("a host copy shared between processes needs POSIX shared memory; set LAYERSTREAM_SHARE_HOST=0");
}
std::unique_ptr<SharedHostSegment> SharedHostSegment::open(Backend&, const std::string&, std::size_t, double) {
  LS_FAIL("a host copy shared between processes needs POSIX shared memory; set LAYERSTREAM_SHARE_HOST=0");
}
SharedHostSegment::~SharedHostSegment() = default;
void SharedHostSegment::mark_ready() {}
void SharedHostSegment::pin() {}

#else

SharedHostSegment::SharedHostSegment(Backend& backend, std::string name, void* base, std::size_t mapped,
                                     std::size_t bytes, bool leader)
    : backend_(&backend), name_(std::move(name)), base_(base), mapped_(mapped), bytes_(bytes), leader_(leader) {
  if (mapped_ > kHeaderBytes) data_ = static_cast<char*>(base_) + kHeaderBytes;
}

SharedHostSegment::Header* SharedHostSegment::header() const { return static_cast<Header*>(base_); }

std::unique_ptr<SharedHostSegment> SharedHostSegment::create(Backend& backend, const std::string& name,
                                                             std::size_t bytes, std::uint32_t followers) {
  LS_CHECK_ARG(bytes > 0, "a shared segment needs a positive size");
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  LS_CHECK(fd >= 0, "cannot create the shared host segment ", name, ": ", std::strerror(errno),
           errno == EEXIST ? " (a leftover of an earlier run? remove /dev/shm" + name + ")" : std::string());
  const std::size_t total = kHeaderBytes + bytes;
  // The memory is reserved now (posix_fallocate), not at first touch: a /dev/shm too small for the model
  // (Docker's default is 64 MiB) is then a refusal here, where it can fall back, not a SIGBUS later.
  bool have_memory = ::ftruncate(fd, static_cast<off_t>(total)) == 0 &&
                     ::posix_fallocate(fd, 0, static_cast<off_t>(total)) == 0;
  if (!have_memory) {
    // Tell the followers (they fall back to a copy of their own) with a header-only segment.
    if (::ftruncate(fd, static_cast<off_t>(kHeaderBytes)) != 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      LS_FAIL("cannot size the shared host segment ", name, ": ", std::strerror(errno));
    }
  }
  const std::size_t mapped = have_memory ? total : kHeaderBytes;
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    LS_FAIL("cannot map the shared host segment ", name, ": ", std::strerror(errno));
  }
  auto* h = new (base) Header;
  h->bytes = bytes;
  h->followers = followers;
  h->joined.store(0);
  h->state.store(have_memory ? kFilling : kFailed, std::memory_order_release);
  h->magic.store(kMagic, std::memory_order_release);
  std::unique_ptr<SharedHostSegment> seg(new SharedHostSegment(backend, name, base, mapped, bytes, true));
  if (!have_memory) {
    seg->bytes_ = 0;
    if (followers == 0) {
      ::shm_unlink(name.c_str());
      seg->unlinked_ = true;
    }
  }
  return seg;
}

void SharedHostSegment::pin() {
  if (data_ == nullptr) return;
  pinned_ = backend_->host_register(data_, bytes_, /*read_only=*/true);
}

void SharedHostSegment::mark_ready() {
  LS_CHECK(leader_ && data_ != nullptr, "only the leader marks a filled segment ready");
  // From now on nobody writes: a stray in-place write to a shared weight faults instead of silently
  // changing every rank's model.
  LS_CHECK(::mprotect(data_, bytes_, PROT_READ) == 0, "cannot make the shared host segment ", name_,
           " read-only: ", std::strerror(errno));
  pin();
  header()->state.store(kReady, std::memory_order_release);
  if (header()->followers == 0) {
    ::shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

std::unique_ptr<SharedHostSegment> SharedHostSegment::open(Backend& backend, const std::string& name,
                                                           std::size_t bytes, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  auto nap = std::chrono::microseconds(200);
  auto wait_or_fail = [&](const char* what) {
    LS_CHECK(Clock::now() < deadline, "waited ", timeout_s, " s for the shared host copy ", name, " (", what,
             ") from this host's first rank: do all ranks attach the same model in the same order? "
             "LAYERSTREAM_SHARE_HOST=0 gives each rank a copy of its own");
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(20000));
  };
  int fd = -1;
  for (;;) {  // until the leader has created and sized it
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd >= 0) {
      struct stat st {};
      if (::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= kHeaderBytes) break;
      ::close(fd);
    } else {
      LS_CHECK(errno == ENOENT, "cannot open the shared host segment ", name, ": ", std::strerror(errno));
    }
    wait_or_fail("not created yet");
  }
  void* head = ::mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (head == MAP_FAILED) {
    ::close(fd);
    LS_FAIL("cannot map the shared host segment ", name, ": ", std::strerror(errno));
  }
  auto* h = static_cast<Header*>(head);
  std::uint32_t state = kFilling;
  try {
    while (h->magic.load(std::memory_order_acquire) != kMagic ||
           (state = h->state.load(std::memory_order_acquire)) == kFilling) {
      wait_or_fail("not filled yet");
    }
    LS_CHECK(state == kFailed || h->bytes == bytes, "the shared host copy ", name, " holds ", h->bytes,
             " bytes where this rank packs ", bytes, ": every rank must attach the same model in the same order");
  } catch (...) {
    ::munmap(head, kHeaderBytes);
    ::close(fd);
    throw;
  }
  const std::size_t mapped = state == kReady ? kHeaderBytes + bytes : kHeaderBytes;
  void* base = head;
  if (state == kReady) {
    ::munmap(head, kHeaderBytes);
    // Read-only data; the header stays writable for the join count (mprotect below).
    base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      ::close(fd);
      LS_FAIL("cannot map the shared host segment ", name, " (", bytes, " bytes): ", std::strerror(errno));
    }
    ::mprotect(static_cast<char*>(base) + kHeaderBytes, bytes, PROT_READ);
  }
  ::close(fd);
  std::unique_ptr<SharedHostSegment> seg(new SharedHostSegment(backend, name, base, mapped, state == kReady ? bytes : 0,
                                                               false));
  seg->pin();
  // The last follower to map it removes the name: from here on the memory is held by the mappings only.
  Header* sh = seg->header();
  if (sh->joined.fetch_add(1, std::memory_order_acq_rel) + 1 == sh->followers) {
    ::shm_unlink(name.c_str());
    seg->unlinked_ = true;
  }
  return seg;
}

SharedHostSegment::~SharedHostSegment() {
  if (pinned_) backend_->host_unregister(data_);
  if (base_ != nullptr) ::munmap(base_, mapped_);
  if (leader_ && !unlinked_) ::shm_unlink(name_.c_str());  // some follower never came: ENOENT is fine
}

#endif

}  // namespace layerstream
