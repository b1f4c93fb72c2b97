// HostShare: the ranks of one host keep ONE host copy of the frozen weights (torch.distributed jobs,
// one process per GPU, launched by torchrun or accelerate).
//
// Every process packs its layers in the same order (they attach the same model), so the n-th shareable
// block has the same size everywhere. Local rank 0 (the leader) creates the n-th block as a named shared
// segment and fills it; the other local ranks map it read-only, check that it holds the bytes they would
// have packed, and free their own copy. Host memory for N ranks is then about 1x the weights, not Nx.
//
// Shareable: blocks of frozen weights and biases only (a trainable one is written by its optimizer). A
// segment the host refuses (a small /dev/shm) falls back to a copy of each rank's own, said once.
//
// Settings: LAYERSTREAM_SHARE_HOST=auto (default: on when LOCAL_WORLD_SIZE > 1 and the ranks can agree on
// a name: torchrun's environment, LAYERSTREAM_SHARE_TOKEN, or torch.distributed initialized) | 0 (off);
// LAYERSTREAM_SHARE_TIMEOUT_S (default 600): how long a rank waits for the leader's copy of a block.
// Thread-safety: next() is guarded; the config is resolved once per process.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "layerstream/backend.h"
#include "layerstream/shared_host.h"

namespace layerstream::torchglue {

struct ShareConfig {
  std::string token;  // the same in every rank of the job (names the segments)
  int local_rank = 0;
  int local_world = 1;
  double timeout_s = 600.0;
};

class HostShare {
 public:
  // Resolves the process's configuration (environment, torch.distributed): installed by the Python
  // module; returns nullopt when the ranks do not share.
  using Resolver = std::function<std::optional<ShareConfig>()>;
  static void set_resolver(Resolver resolver);
  // The process's share, resolved at the first call; nullptr when this process does not share.
  static HostShare* get();

  // The segment for the next shareable block of `bytes` (leader: created, to be filled and marked ready;
  // others: opened, filled by the leader). Its data() is null when the host refused the memory: keep a
  // copy of your own then.
  std::unique_ptr<SharedHostSegment> next(Backend& backend, std::size_t bytes);
  bool leader() const { return config_.local_rank == 0; }
  const ShareConfig& config() const { return config_; }

  // What this process holds through shared segments (live), for stats().
  static std::int64_t bytes_live();
  static std::int64_t blocks_live();
  static void note_block(std::int64_t bytes, int sign);
  // Leader, at process exit: removes the names of the segments it made that a rank never came for (the
  // memory itself goes with the last mapping). A killed process cannot: `rm /dev/shm/ls-*` then.
  static void unlink_created() noexcept;

 private:
  explicit HostShare(ShareConfig config) : config_(std::move(config)) {}
  ShareConfig config_;
  std::mutex mu_;
  std::uint64_t seq_ = 0;
  std::vector<std::string> created_;
};

// LAYERSTREAM_SHARE_HOST: whether this process shares, and the name its host's ranks agree on
// (share_handshake.cc): torchrun's run id, LAYERSTREAM_SHARE_TOKEN, or a name drawn by global rank 0 and
// broadcast through torch.distributed. Takes the GIL for the broadcast. The resolver the module installs.
std::optional<ShareConfig> resolve_share();

// The id of the process that started this one (torchrun's agent for its ranks), on POSIX and Windows alike;
// 0 when Windows cannot tell.
long parent_process_id();

}  // namespace layerstream::torchglue
