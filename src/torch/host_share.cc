#include "host_share.h"

#include "layerstream/check.h"
#include "layerstream/log.h"

#include <cstdlib>

#ifndef _WIN32
#include <sys/mman.h>
#else
static int shm_unlink(const char*) { return 0; }
#endif

namespace layerstream::torchglue {

namespace {
HostShare::Resolver& resolver() {
  static HostShare::Resolver r;
  return r;
}
std::atomic<std::int64_t> g_bytes{0};
std::atomic<std::int64_t> g_blocks{0};
}  // namespace

void HostShare::set_resolver(Resolver r) { resolver() = std::move(r); }

HostShare* HostShare::get() {
  // Resolved once: every block of the process must follow the same decision (the ranks count blocks).
  static HostShare* share = [] () -> HostShare* {
    if (!resolver()) return nullptr;
    std::optional<ShareConfig> config = resolver()();
    if (!config) return nullptr;
    log(LogLevel::kInfo, detail::concat("layerstream: local rank ", config->local_rank, " of ", config->local_world,
                                        config->local_rank == 0 ? " keeps the host copy of the frozen weights that "
                                                                  "this host's ranks share"
                                                                : " maps the host copy of local rank 0"));
    auto* made = new HostShare(std::move(*config));  // for the process's lifetime
    if (made->leader()) std::atexit(&HostShare::unlink_created);
    return made;
  }();
  return share;
}

std::unique_ptr<SharedHostSegment> HostShare::next(Backend& backend, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string name = "/ls-" + config_.token + "-" + std::to_string(++seq_);
  if (leader()) {
    auto segment = SharedHostSegment::create(backend, name, bytes, static_cast<std::uint32_t>(config_.local_world - 1));
    created_.push_back(name);
    return segment;
  }
  return SharedHostSegment::open(backend, name, bytes, config_.timeout_s);
}

void HostShare::unlink_created() noexcept {
  HostShare* share = get();
  if (share == nullptr) return;
  std::lock_guard<std::mutex> lock(share->mu_);
  for (const auto& name : share->created_) ::shm_unlink(name.c_str());  // ENOENT (already gone) is fine
  share->created_.clear();
}

std::int64_t HostShare::bytes_live() { return g_bytes.load(); }
std::int64_t HostShare::blocks_live() { return g_blocks.load(); }
void HostShare::note_block(std::int64_t bytes, int sign) {
  g_bytes += sign * bytes;
  g_blocks += sign;
}

}  // namespace layerstream::torchglue
