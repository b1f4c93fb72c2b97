// Settings: every LAYERSTREAM_* environment variable, parsed into typed fields in one place.
//
// The environment is read here and nowhere else in src/ (the launcher's LOCAL_RANK, LOCAL_WORLD_SIZE,
// TORCHELASTIC_RUN_ID and MASTER_PORT too). It is read when manager_modules is imported and again each time
// a device state is created (tests change the environment between device states), and each read is
// validated whole: a value that is negative, too large, not finite or not one of the choices throws
// InvalidArgument (a Python ValueError) naming the variable and giving a valid example. An empty value is
// the same as an unset one. A LAYERSTREAM_* name that is no setting (nor read by layerstream's build, tests
// or scripts) is warned about once, with the setting it is closest to.
//
// configure() (Python: manager_modules.configure) sets values from Python: they are checked by the same
// parsers and take precedence over the environment until configured back to None.
//
// Thread-safety: current() hands out an immutable snapshot; refresh() and configure() swap it under a lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "layerstream/device_ring.h"

namespace layerstream::torchglue {

// LAYERSTREAM_VRAM_BUDGET, parsed: "min" (the default: no plan, the least ring), "auto", or a size such as
// 24GiB, 24GB, 20000MiB or 2.5e10 (bytes).
struct VramBudget {
  bool enabled = false;
  bool automatic = false;
  std::size_t bytes = 0;  // when not automatic
  static VramBudget parse(const char* text);  // throws InvalidArgument with the accepted forms
};

constexpr unsigned kMostDecodeBlocks = 1u << 16;  // LAYERSTREAM_DECODE_BLOCKS: the decode kernel's own limit

enum class CpuBackend { kCpu, kSim };  // LAYERSTREAM_BACKEND: how a CPU process device runs
enum class HostDtype { kSame, kLossless, kFloat8E4M3, kFloat8E5M2 };
enum class ShareHost { kAuto, kOn, kOff };
enum class VramPeak { kWindow, kCycles };  // LAYERSTREAM_VRAM_PEAK: how the budget measures a step's peak
// LAYERSTREAM_VRAM_GAP: where a gap's quarter is, or (kLend) whether the plan lends it to resident layers
enum class VramGap { kQuarterAtPeak, kQuarterAboveStart, kLend };

struct Settings {
  CpuBackend backend = CpuBackend::kCpu;           // LAYERSTREAM_BACKEND
  std::optional<std::size_t> ring_bytes;           // LAYERSTREAM_RING_MB (unset: sized from the layers)
  bool prefetch = true;                            // LAYERSTREAM_PREFETCH
  RingPolicy ring_policy = RingPolicy::kFifo;      // LAYERSTREAM_RING_POLICY
  std::size_t prefetch_layers = 8;                 // LAYERSTREAM_PREFETCH_LAYERS
  std::size_t resident_bytes = 0;                  // LAYERSTREAM_RESIDENT_MB
  VramBudget vram_budget;                          // LAYERSTREAM_VRAM_BUDGET
  VramPeak vram_peak = VramPeak::kCycles;          // LAYERSTREAM_VRAM_PEAK
  VramGap vram_gap = VramGap::kQuarterAtPeak;      // LAYERSTREAM_VRAM_GAP
  HostDtype host_dtype = HostDtype::kSame;         // LAYERSTREAM_HOST_DTYPE
  bool ostris_decode = true;                       // LAYERSTREAM_OSTRIS_DECODE
  ShareHost share_host = ShareHost::kAuto;         // LAYERSTREAM_SHARE_HOST
  double share_timeout_s = 600;                    // LAYERSTREAM_SHARE_TIMEOUT_S
  std::optional<std::string> share_token;          // LAYERSTREAM_SHARE_TOKEN
  std::size_t chunk_bytes = std::size_t{256} << 20;  // LAYERSTREAM_CHUNK_MB
  std::optional<std::size_t> pinned_cap_bytes;     // LAYERSTREAM_PINNED_CAP_MB (unset: no cap)
  bool time_waits = false;                         // LAYERSTREAM_TIME_WAITS
  std::uint64_t log_every = 100;                   // LAYERSTREAM_LOG_EVERY (0: never)
  unsigned decode_blocks = 0;                      // LAYERSTREAM_DECODE_BLOCKS (0: no limit)
  std::optional<std::uint64_t> sim_faults;         // LAYERSTREAM_SIM_FAULTS (the injector's seed)
  std::optional<std::size_t> sim_device_bytes;     // LAYERSTREAM_SIM_DEVICE_MB
  std::optional<std::size_t> sim_pinnable_bytes;   // LAYERSTREAM_SIM_PINNABLE_MB

  // The launcher's variables (torchrun, accelerate), as they are: host_share's resolver interprets them.
  std::optional<std::string> local_rank, local_world_size, torchelastic_run_id, master_port;

  // Every setting's text as given (the environment with configure()'s values over it), by variable name.
  using Text = std::map<std::string, std::string>;
  static Settings parse(const Text& text);  // throws InvalidArgument (see above)

  // The snapshot in force (read at the first call if nothing read it before).
  static std::shared_ptr<const Settings> current();
  // Reads the environment again (warning once about unknown LAYERSTREAM_* names) and replaces the snapshot;
  // on a bad value throws and keeps the snapshot as it was.
  static void refresh();
  // Sets values by variable name (nullopt: back to the environment's), validated like the environment's;
  // on a bad value throws and changes nothing.
  static void configure(const std::map<std::string, std::optional<std::string>>& values);

  // The variables Settings reads, in the docs' order; and the name of the setting nearest to `name`
  // (empty when none is close), for messages.
  static const std::vector<std::string>& names();
  static std::string nearest(const std::string& name);
};

}  // namespace layerstream::torchglue
