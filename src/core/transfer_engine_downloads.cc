// TransferEngine (transfer_engine.h): device-to-host copies (gradients), on the engine's D2H stream,
// each after the producer stream's work, joined by ticket or all at once.
#include "layerstream/transfer_engine.h"

#include "layerstream/check.h"

namespace layerstream {

std::uint64_t TransferEngine::download(void* host_dst, const void* device_src, std::size_t bytes,
                                       StreamHandle producer) {
  LS_CHECK_ARG(bytes > 0, "download: size must be positive");
  LS_CHECK_ARG(producer, "download: null producer stream");
  std::lock_guard<std::mutex> lock(mu_);
  Event produced = events_.take();
  produced.record(producer);
  backend_.stream_wait_event(d2h_.get(), produced.get());
  events_.give(std::move(produced));  // the wait is enqueued; the event may be reused
  backend_.memcpy_d2h_async(host_dst, device_src, bytes, d2h_.get());
  Event done = events_.take();
  done.record(d2h_.get());
  const std::uint64_t ticket = next_ticket_++;
  downloads_.emplace(ticket, std::move(done));
  ++stats_.downloads;
  stats_.bytes_d2h += bytes;
  return ticket;
}

void TransferEngine::wait_download(std::uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = downloads_.find(ticket);
  LS_CHECK_ARG(it != downloads_.end(), "wait_download: no pending download ", ticket);
  it->second.synchronize();
  events_.give(std::move(it->second));
  downloads_.erase(it);
}

void TransferEngine::sync_downloads() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [ticket, done] : downloads_) {
    done.synchronize();
    events_.give(std::move(done));
  }
  downloads_.clear();
}

}  // namespace layerstream
