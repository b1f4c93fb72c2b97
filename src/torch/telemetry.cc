#include "telemetry.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "host_share.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/stats_fields.h"
#include "layerstream/settings.h"
#include "streamed_layer.h"

namespace layerstream::torchglue {

py::dict stats_dict(const StateStats& s) {
  // Every field of the lists in layerstream/stats_fields.h, named as that file says.
  py::dict d;
#define LAYERSTREAM_ENGINE(type, name) d[#name] = s.engine.name;
#define LAYERSTREAM_ARENA(type, name) d["host_" #name] = s.engine.arena.name;
#define LAYERSTREAM_PREDICTOR(type, name) d["predictor_" #name] = s.predictor.name;
#define LAYERSTREAM_STATE(type, name) d[#name] = s.name;
#define LAYERSTREAM_ALIAS(old_name, name) d[#old_name] = py::object(d[#name]);
  LAYERSTREAM_ENGINE_COUNTERS(LAYERSTREAM_ENGINE)
  LAYERSTREAM_ENGINE_GAUGES(LAYERSTREAM_ENGINE)
  LAYERSTREAM_ARENA_FIELDS(LAYERSTREAM_ARENA)
  LAYERSTREAM_PREDICTOR_FIELDS(LAYERSTREAM_PREDICTOR)
  LAYERSTREAM_STATE_FIELDS(LAYERSTREAM_STATE)
  LAYERSTREAM_STATS_ALIASES(LAYERSTREAM_ALIAS)
#undef LAYERSTREAM_ENGINE
#undef LAYERSTREAM_ARENA
#undef LAYERSTREAM_PREDICTOR
#undef LAYERSTREAM_STATE
#undef LAYERSTREAM_ALIAS
  d["device_bytes"] = s.engine.ring_capacity + s.engine.resident_bytes;  // what layerstream holds on the device
  return d;
}

py::dict stats() {
  // Every counter summed over the live device states, plus how many there are and which.
  py::dict total = stats_dict(StateStats{});
  py::list devices;
  for (const auto& state : DeviceState::live()) {
    for (auto item : stats_dict(state->stats())) {
      const std::string key = item.first.cast<std::string>();
      const std::uint64_t value = item.second.cast<std::uint64_t>();
      total[key.c_str()] = total[key.c_str()].cast<std::uint64_t>() + value;
    }
    devices.append(state->describe());
  }
  total["device_states"] = devices.size();
  total["devices"] = devices;
  // Host memory this process holds through the copy the host's ranks share (in no arena's counts).
  total["host_shared_bytes"] = HostShare::bytes_live();
  total["host_shared_blocks"] = HostShare::blocks_live();
  // Host memory the managed layers hold (streamed_layer.h, HostMemoryCounts): pinned arena bytes of packed
  // weights, pinned arena bytes stored as they are, pageable bytes (unpinned blocks, plain copies kept
  // beside packed weights).
  const HostMemoryCounts host = host_memory_counts();
  total["host_pinned_packed_bytes"] = host.pinned_packed;
  total["host_pinned_plain_bytes"] = host.pinned_plain;
  total["host_pageable_bytes"] = host.pageable;
  return total;
}


void route_log_to_python() {
  set_log_sink([](LogLevel level, const std::string& message) {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      std::fprintf(stderr, "layerstream: %s\n", message.c_str());
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::module_::import("logging").attr("getLogger")("layerstream").attr("log")(static_cast<int>(level), message);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("layerstream log sink");
    }
  });
}

void log_step_telemetry() {
  static std::uint64_t steps = 0;
  static py::dict* last = nullptr;
  static auto last_time = std::chrono::steady_clock::now();
  const std::uint64_t every = Settings::current()->log_every;
  if (every == 0 || ++steps % every != 0) return;
  py::dict now = stats();
  const auto now_time = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now_time - last_time).count();
  if (last == nullptr) last = new py::dict(stats_dict(StateStats{}));
  auto delta = [&](const char* key) {
    return (now[key].cast<double>() - (*last)[key].cast<double>()) / static_cast<double>(every);
  };
  // Bytes over the wall-clock time of the interval: what the step achieved on the bus, overlap included
  // (not the bus's own rate, which `layerstream doctor` measures).
  const double gb_per_s = seconds > 0 ? delta("bytes_h2d") * static_cast<double>(every) / seconds / 1e9 : 0.0;
  log(LogLevel::kInfo,
      layerstream::detail::concat("layerstream, per step over the last ", every, " steps (", seconds / every,
                     " s/step): ", delta("fetches"), " layer calls, ", delta("copies_h2d"), " copies (",
                     delta("bytes_h2d") / 1e9, " GB, ", gb_per_s, " GB/s over the steps), ", delta("reuse_hits"),
                     " served from the ring, ", delta("prefetch_hits"), " prefetch hits, ", delta("resident_hits"),
                     " resident, ", delta("bytes_d2h") / 1e9, " GB of gradients back",
                     now["copy_waits_timed"].cast<double>() > 0
                         ? layerstream::detail::concat(", compute waited ", delta("copy_wait_us") / 1e3, " ms for copies")
                         : std::string(),
                     "; pinned ",
                     now["pinned_bytes"].cast<double>() / 1e9, " GB, device ",
                     now["device_bytes"].cast<double>() / 1e9, " GB (ring + resident)"));
  *last = now;
  last_time = now_time;
}

}  // namespace layerstream::torchglue
