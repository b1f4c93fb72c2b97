// LAYERSTREAM_HOST_DTYPE=auto (the default): which form frozen weights are kept in on the host, decided once
// per process device from facts about the process and once per weight from its dtype and size.
//
// The rule (docs/ai-toolkit.md, "Lossless packing"): frozen bfloat16 weights of kAutoLosslessLeastBytes or
// more are packed losslessly (exact, about 0.75x their bytes in host RAM and over the bus; the decode on
// the device is bit for bit), other weights are stored as they are; and every weight is stored as it is
// where the process device has no decoder (a CPU-only build) or, on a GPU, where the encoder would have
// fewer than kAutoLosslessLeastThreads threads (packing at attach runs on the host's cores).
//
// Pure functions of their arguments: no state, no logging (the caller logs `reason` once per process).
#pragma once

#include <cstddef>
#include <string>

namespace layerstream {

// A weight below this many bytes is stored as it is under `auto`: the quarter lossless saves of 1 MiB
// crosses a 25-55 GB/s bus in 5-10 us, about what a decode's two kernel launches cost on the device (an
// estimate: no break-even size has been measured).
constexpr std::size_t kAutoLosslessLeastBytes = std::size_t{1} << 20;
// Fewer encoder threads than this, on a GPU: stored as they are. The encoder measured 0.72 GB/s on one
// thread and 1.41 on two (a 2-core VM), 1.92-2.21 GB/s on the H200 host's 16 cores (benchmarks/log.md): at
// 2-3 threads a FLUX.1-sized model (22 GiB) takes about a quarter of a minute more to attach.
constexpr unsigned kAutoLosslessLeastThreads = 4;

// What auto decides from for a process device.
struct HostFormFacts {
  bool decoder = false;    // this build can decode packed weights for this device
  bool simulated = false;  // the simulator or the CPU (no attach time to save: the thread rule is a GPU's)
  unsigned encoder_threads = 0;  // the threads lossless_encode runs on (lossless_threads())
};

// auto's choice for a process device: whether bfloat16 weights are packed, and the INFO line saying so.
struct HostFormChoice {
  bool lossless = false;
  std::string reason;  // one line: "layerstream: LAYERSTREAM_HOST_DTYPE=auto: ..."
};
HostFormChoice choose_auto_host_form(const HostFormFacts& facts);

// Whether auto packs one weight, given the device's choice: bfloat16 (`is_bfloat16`) of at least
// kAutoLosslessLeastBytes.
bool auto_packs_weight(const HostFormChoice& choice, bool is_bfloat16, std::size_t bytes);

}  // namespace layerstream
