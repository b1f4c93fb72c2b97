// SharedHostSegment: one block of frozen weights in named shared memory, so that the processes (ranks) of
// one host hold ONE host copy of a model instead of one each.
//
// Protocol (one segment per block, named by the caller the same way in every process):
//   * the host's leader create()s it, fills data(), and mark_ready()s it;
//   * the other processes open() it: they wait until it exists and is ready (or time out with a clear
//     error), check its size, and map the same bytes; the last of them to join unlinks the name, so that
//     nothing is left in /dev/shm once everyone holds a mapping (the memory goes when the last unmaps).
//   * each process registers (pins) its own mapping with its backend; where pinning is refused the
//     mapping is used pageable (pinned() says which), as the arena does.
// The leader also unlinks the name when it goes, in case some process never came.
//
// Ownership: the segment owns its mapping and its registration; the destructor undoes both and never
// throws. Layout: a 4 KiB header (magic, size, ready flag, join count), then the data (page aligned).
// Thread-safety: one object per thread at a time; the cross-process fields are atomics.
// POSIX only (shm_open + mmap); on other platforms create() and open() throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "layerstream/backend.h"

namespace layerstream {

class SharedHostSegment {
 public:
  // `followers`: how many other processes will open() it (0: the name is unlinked at mark_ready()).
  // Throws Error when the name exists already or the memory is refused.
  static std::unique_ptr<SharedHostSegment> create(Backend& backend, const std::string& name, std::size_t bytes,
                                                   std::uint32_t followers);
  // Waits up to `timeout_s` for the leader's segment to exist and be ready. Throws Error on timeout, or
  // when its size is not `bytes` (the processes did not pack the same model).
  static std::unique_ptr<SharedHostSegment> open(Backend& backend, const std::string& name, std::size_t bytes,
                                                 double timeout_s);
  ~SharedHostSegment();
  SharedHostSegment(const SharedHostSegment&) = delete;
  SharedHostSegment& operator=(const SharedHostSegment&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }
  bool leader() const { return leader_; }
  const std::string& name() const { return name_; }
  // Leader: the data is written; followers may use it.
  void mark_ready();

  // Bytes of the header before the data.
  static constexpr std::size_t kHeaderBytes = 4096;

 private:
  struct Header;
  SharedHostSegment(Backend& backend, std::string name, void* base, std::size_t mapped, std::size_t bytes, bool leader);
  Header* header() const;
  void pin();

  Backend* backend_;
  std::string name_;
  void* base_ = nullptr;  // the whole mapping (header + data)
  std::size_t mapped_ = 0;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool leader_ = false;
  bool pinned_ = false;
  bool unlinked_ = false;
};

}  // namespace layerstream
