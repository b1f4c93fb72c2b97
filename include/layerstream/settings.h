// Settings: every LAYERSTREAM_* environment variable, declared once and parsed into typed fields in one place.
//
// Settings::table() is the one declaration: each setting's name, type, default, who it is for, what it
// accepts and a line on what it does. The parsers, the refusal messages, `layerstream status` and `set`
// (through _native) and the tables of docs/ai-toolkit.md (checked by tests/python/test_settings.py) all come
// from it. Two settings are read by Python (LAYERSTREAM by the AI-Toolkit hook, LAYERSTREAM_LOG by the
// package) and declared here all the same, so that they are checked and listed like the others.
//
// The environment is read here and nowhere else in src/ (the launcher's LOCAL_RANK, LOCAL_WORLD_SIZE,
// TORCHELASTIC_RUN_ID and MASTER_PORT too). It is read when manager_modules is imported and again each time
// a device state is created (tests change the environment between device states), and each read is
// validated whole: a value that is not accepted throws InvalidArgument (a Python ValueError) with one line
// naming the variable, the value, what it takes and an example (refusal()). An empty value is the same as
// an unset one. A LAYERSTREAM_* name that is no setting (nor read by layerstream's build, tests or scripts)
// is warned about once, with the setting it is closest to.
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

namespace layerstream {

// LAYERSTREAM_VRAM_BUDGET, parsed: "min" (the default: no plan, the least ring), "auto", or a size such as
// 24G, 24GB, 24GiB, "24 GiB", 20000MiB (units case-insensitive and binary: GB is 2^30 bytes, as a "24 GB"
// card is) or 2.5e10 (bytes).
struct VramBudget {
  bool enabled = false;
  bool automatic = false;
  std::size_t bytes = 0;  // when not automatic
  static std::optional<VramBudget> parse(const std::string& text);  // nullopt: not accepted
};

// Who a setting is for: the user (the first table of the docs; `layerstream status` always lists it),
// tuning (listed when set), or layerstream's tests.
enum class SettingAudience { kUser, kTuning, kTests };

// One setting's declaration. `accepts` is a noun phrase ("a positive whole number of MiB up to ..."),
// `default_value` the value or behaviour when unset, `doc` one line on what it does.
struct SettingSpec {
  const char* name;
  const char* type;  // switch, choice, size, MiB, count, seconds, token
  SettingAudience audience;
  bool native;  // read by Settings (false: by layerstream's Python package or the AI-Toolkit hook)
  const char* default_value;
  const char* accepts;
  const char* example;
  const char* doc;
};

constexpr unsigned kMostDecodeBlocks = 1u << 16;  // LAYERSTREAM_DECODE_BLOCKS: the decode kernel's own limit

enum class CpuBackend { kCpu, kSim };  // LAYERSTREAM_BACKEND: how a CPU process device runs
// LAYERSTREAM_HOST_DTYPE; kAuto: lossless or as they are, per device and weight (host_form.h)
enum class HostDtype { kAuto, kSame, kLossless, kFloat8E4M3, kFloat8E5M2 };
enum class ShareHost { kAuto, kOn, kOff };
enum class VramPeak { kWindow, kCycles };  // LAYERSTREAM_VRAM_PEAK: how the budget measures a step's peak
// LAYERSTREAM_VRAM_GAP: where a gap's quarter is, or (kLend) whether the plan lends it to resident layers
enum class VramGap { kQuarterAtPeak, kQuarterAboveStart, kLend };

// Each member holds one setting of the table in settings.cc, which declares it once: its name, type, default,
// what it accepts and its doc, its parser and how its value reads back as text. parse() starts every member
// from its declared default (a default that is a description, such as "no cap", leaves it unset), so no
// default is written here; `layerstream status`, settings() and the docs' tables are derived from the table.
struct Settings {
  CpuBackend backend{};                       // LAYERSTREAM_BACKEND
  std::optional<std::size_t> ring_bytes;      // LAYERSTREAM_RING_MB (unset: sized from the layers)
  bool prefetch{};                            // LAYERSTREAM_PREFETCH
  RingPolicy ring_policy{};                   // LAYERSTREAM_RING_POLICY
  std::size_t prefetch_layers{};              // LAYERSTREAM_PREFETCH_LAYERS
  std::size_t resident_bytes{};               // LAYERSTREAM_RESIDENT_MB
  VramBudget vram_budget;                     // LAYERSTREAM_VRAM_BUDGET
  VramPeak vram_peak{};                       // LAYERSTREAM_VRAM_PEAK
  VramGap vram_gap{};                         // LAYERSTREAM_VRAM_GAP
  HostDtype host_dtype{};                     // LAYERSTREAM_HOST_DTYPE
  bool ostris_decode{};                       // LAYERSTREAM_OSTRIS_DECODE
  ShareHost share_host{};                     // LAYERSTREAM_SHARE_HOST
  double share_timeout_s{};                   // LAYERSTREAM_SHARE_TIMEOUT_S
  std::optional<std::string> share_token;     // LAYERSTREAM_SHARE_TOKEN
  std::size_t chunk_bytes{};                  // LAYERSTREAM_CHUNK_MB
  std::optional<std::size_t> pinned_cap_bytes;  // LAYERSTREAM_PINNED_CAP_MB (unset: no cap)
  bool time_waits{};                          // LAYERSTREAM_TIME_WAITS
  std::uint64_t log_every{};                  // LAYERSTREAM_LOG_EVERY (0: never)
  unsigned decode_blocks{};                   // LAYERSTREAM_DECODE_BLOCKS (0: no limit)
  std::optional<std::uint64_t> sim_faults;    // LAYERSTREAM_SIM_FAULTS (the injector's seed)
  std::size_t sim_device_bytes{};             // LAYERSTREAM_SIM_DEVICE_MB
  std::optional<std::size_t> sim_pinnable_bytes;  // LAYERSTREAM_SIM_PINNABLE_MB

  // The launcher's variables (torchrun, accelerate), as they are: host_share's resolver interprets them.
  std::optional<std::string> local_rank, local_world_size, torchelastic_run_id, master_port;

  // Every setting's text as given (the environment with configure()'s values over it), by variable name.
  using Text = std::map<std::string, std::string>;
  // Throws InvalidArgument (refusal()); `origins` says where each value came from, for the message.
  static Settings parse(const Text& text, const Text& origins = {});

  // The snapshot in force (read at the first call if nothing read it before).
  static std::shared_ptr<const Settings> current();
  // Reads the environment again (warning once about unknown LAYERSTREAM_* names) and replaces the snapshot;
  // on a bad value throws (its refusal, origin "the environment") and keeps the snapshot as it was.
  static void refresh();
  // Sets values by variable name (nullopt: back to the environment's), validated like the environment's;
  // on a bad value or a name Settings does not read (table().native false) throws and changes nothing.
  static void configure(const std::map<std::string, std::optional<std::string>>& values);

  // Every setting, in the docs' order.
  static const std::vector<SettingSpec>& table();
  // The value `s` holds for the setting `name`, as the text its parser takes back ("" when unset, and for the
  // settings Settings does not hold: table().native false); throws InvalidArgument for an unknown name.
  static std::string text_of(const Settings& s, const std::string& name);
  // The one line refusing `text` for `name` ("NAME=text (origin) is not accepted; it takes ..., e.g. ..."),
  // or nullopt when the setting accepts it; an unknown name is refused too (not the LAYERSTREAM_* names
  // layerstream's build, tests and scripts read). `origin` ("" for none) says
  // where the value came from: ".env line 3", "the environment".
  static std::optional<std::string> refusal(const std::string& name, const std::string& text,
                                            const std::string& origin = "");
  // The variables of the table, in its order; and the name of the setting nearest to `name` (empty when
  // none is close), for messages.
  static const std::vector<std::string>& names();
  static std::string nearest(const std::string& name);
};

}  // namespace layerstream
