#include "layerstream/settings.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <mutex>
#include <set>

#include "layerstream/check.h"
#include "layerstream/log.h"
#include "setting_text.h"

extern char** environ;  // POSIX: the process's environment, scanned for unknown LAYERSTREAM_* names

namespace layerstream {

namespace {

using namespace setting_text;

constexpr double kMostTimeoutS = 365.0 * 24 * 3600;
constexpr std::uint64_t kMostCount = std::numeric_limits<std::uint64_t>::max();

// A parser stores an accepted value and returns true, or returns false and changes nothing.
using Parser = bool (*)(Settings&, const std::string& text);
// A shower gives the value back as text the parser takes ("" when unset).
using Shower = std::string (*)(const Settings&);

// One setting, declared once: its spec (name, type, default, what it accepts, doc), its parser and its shower
// (null for the settings Settings does not hold).
struct Entry {
  SettingSpec spec;
  Parser parse;
  Shower show;
};

template <typename T>
bool store(T& field, const std::optional<T>& value) {
  if (value) field = *value;
  return value.has_value();
}
template <typename T>
bool store(std::optional<T>& field, const std::optional<T>& value) {
  if (value) field = value;
  return value.has_value();
}

constexpr const char* kSwitch = "1, true, on or yes, or 0, false, off or no";
constexpr const char* kMiBRange = "a positive whole number of MiB up to 1073741824 (1 PiB)";
constexpr const char* kMiBRangeOrZero = "a whole number of MiB up to 1073741824 (1 PiB)";
constexpr auto kUser = SettingAudience::kUser;
constexpr auto kTuning = SettingAudience::kTuning;
constexpr auto kTests = SettingAudience::kTests;

// A choice setting's words and what each means, read by its parser (exactly as written) and by its shower (the
// first word of a value).
template <typename E>
struct Named {
  const char* word;
  E value;
};
template <typename E, std::size_t N>
bool parse_choice(E& field, const Named<E> (&words)[N], const std::string& text) {
  for (const Named<E>& w : words) {
    if (text == w.word) {
      field = w.value;
      return true;
    }
  }
  return false;
}
template <typename E, std::size_t N>
std::string word_of(E value, const Named<E> (&words)[N]) {
  for (const Named<E>& w : words) {
    if (w.value == value) return w.word;
  }
  return "";
}

constexpr Named<HostDtype> kHostDtypes[] = {{"auto", HostDtype::kAuto},
                                            {"same", HostDtype::kSame},
                                            {"lossless", HostDtype::kLossless},
                                            {"float8_e4m3fn", HostDtype::kFloat8E4M3},
                                            {"float8_e5m2", HostDtype::kFloat8E5M2}};
constexpr Named<RingPolicy> kRingPolicies[] = {{"fifo", RingPolicy::kFifo}, {"lru", RingPolicy::kLeastRecentlyUsed}};
constexpr Named<VramPeak> kVramPeaks[] = {{"cycles", VramPeak::kCycles}, {"window", VramPeak::kWindow}};
constexpr Named<VramGap> kVramGaps[] = {
    {"peak", VramGap::kQuarterAtPeak}, {"start", VramGap::kQuarterAboveStart}, {"lend", VramGap::kLend}};
constexpr Named<ShareHost> kShareHosts[] = {{"auto", ShareHost::kAuto}, {"on", ShareHost::kOn}, {"1", ShareHost::kOn},
                                            {"off", ShareHost::kOff}, {"0", ShareHost::kOff}};
constexpr Named<CpuBackend> kBackends[] = {{"cpu", CpuBackend::kCpu}, {"sim", CpuBackend::kSim}};

// Every setting, in the order of the docs' tables (docs/ai-toolkit.md, "Modes and settings").
const Entry kEntries[] = {
  {{"LAYERSTREAM", "switch", kUser, false, "1",
    "1, on, true or yes (layerstream), or 0, off, false or no (AI-Toolkit's stock manager_modules.py)", "0",
    "patch mode's hook: 0 runs AI-Toolkit's own code in the same checkout, for a comparison"},
   [](Settings&, const std::string& t) { return switch_of(t).has_value(); },
   nullptr},
  {{"LAYERSTREAM_VRAM_BUDGET", "size", kUser, true, "auto",
    "auto (what the device has free, given back when the process needs it), min (no layer kept: the least "
    "device memory, the memory-first mode) or a size from 1 MiB to 1 PiB such as 24G, 24GB, 24GiB or '24 GiB' "
    "(case-insensitive, binary: 24GB is 24x2^30 bytes) or a number of bytes",
    "min", "device memory that layers may stay in after the first training step; the rest stream"},
   [](Settings& s, const std::string& t) { return store(s.vram_budget, VramBudget::parse(t)); },
   [](const Settings& s) {
     return !s.vram_budget.enabled ? std::string("min") : s.vram_budget.automatic ? std::string("auto") : std::to_string(s.vram_budget.bytes);
   }},
  {{"LAYERSTREAM_HOST_DTYPE", "choice", kUser, true, "auto",
    "auto (lossless for frozen bfloat16 weights of 1 MiB or more where this device and host can decode and "
    "pack them, the rest as they are; an INFO line says which), "
    "same (weights as they are), lossless (bfloat16 weights packed exactly, about 0.75x their bytes) or "
    "float8_e4m3fn or float8_e5m2 (8-bit codes with a scale per output channel: half the bytes to copy, "
    "not exact; host RAM 1.5x the bfloat16 weights)",
    "lossless", "the form frozen weights are kept in on the host and copied to the device in"},
   [](Settings& s, const std::string& t) { return parse_choice(s.host_dtype, kHostDtypes, t); },
   [](const Settings& s) { return word_of(s.host_dtype, kHostDtypes); }},
  {{"LAYERSTREAM_LOG", "choice", kUser, false, "info", "info, warning, debug or off", "warning",
    "which of layerstream's log lines are printed (info: the active line, the VRAM plan, the periodic summary)"},
   [](Settings&, const std::string& t) {
     const std::string v = lower(t);
     return v == "info" || v == "warning" || v == "debug" || v == "off";
   },
   nullptr},
  {{"LAYERSTREAM_RING_MB", "MiB", kTuning, true,
    "on a GPU four of the largest layer, never more than the layers take (the CPU modes: 3x); with a VRAM "
    "budget its plan's",
    kMiBRange, "3072", "the device ring's size, fixed"},
   [](Settings& s, const std::string& t) { return store(s.ring_bytes, mib(t, 1)); },
   [](const Settings& s) { return mib_text(s.ring_bytes); }},
  {{"LAYERSTREAM_PREFETCH", "switch", kTuning, true, "1", kSwitch, "0",
    "copies of the layers predicted next, ahead of need (see \"Prefetch\")"},
   [](Settings& s, const std::string& t) { return store(s.prefetch, switch_of(t)); },
   [](const Settings& s) { return on_off(s.prefetch); }},
  {{"LAYERSTREAM_PREFETCH_LAYERS", "count", kTuning, true, "8", "a positive whole number of layers", "16",
    "how many predicted layers a layer call may copy ahead, within a third of the ring's bytes"},
   [](Settings& s, const std::string& t) {
     const auto n = whole(t, 1, std::numeric_limits<std::size_t>::max());
     return store(s.prefetch_layers, n ? std::optional<std::size_t>(static_cast<std::size_t>(*n)) : std::nullopt);
   },
   [](const Settings& s) { return std::to_string(s.prefetch_layers); }},
  {{"LAYERSTREAM_RING_POLICY", "choice", kTuning, true, "fifo",
    "fifo (a copy goes at the ring's head) or lru (over the memory used longest ago; experimental)", "lru",
    "where the ring places a copy (the VRAM budget's plan models fifo)"},
   [](Settings& s, const std::string& t) { return parse_choice(s.ring_policy, kRingPolicies, t); },
   [](const Settings& s) { return word_of(s.ring_policy, kRingPolicies); }},
  {{"LAYERSTREAM_RESIDENT_MB", "MiB", kTuning, true, "0", kMiBRangeOrZero, "4096",
    "MiB of layers kept on the device for good (first used, first kept)"},
   [](Settings& s, const std::string& t) { return store(s.resident_bytes, mib(t, 0)); },
   [](const Settings& s) { return mib_text(s.resident_bytes); }},
  {{"LAYERSTREAM_VRAM_PEAK", "choice", kTuning, true, "cycles",
    "cycles (each training cycle's step and gap measured apart) or window (the first steps' window)", "window",
    "how the VRAM budget measures a training step's peak (see \"VRAM budget\")"},
   [](Settings& s, const std::string& t) { return parse_choice(s.vram_peak, kVramPeaks, t); },
   [](const Settings& s) { return word_of(s.vram_peak, kVramPeaks); }},
  {{"LAYERSTREAM_VRAM_GAP", "choice", kTuning, true, "peak",
    "peak (a quarter of the device left free on top of the peak between steps), start (a quarter above the "
    "training cycle's start; experimental) or lend (the quarter lent to resident layers that go back first; "
    "experimental)",
    "start", "where the VRAM budget keeps the room it promises between training steps (see \"VRAM budget\")"},
   [](Settings& s, const std::string& t) { return parse_choice(s.vram_gap, kVramGaps, t); },
   [](const Settings& s) { return word_of(s.vram_gap, kVramGaps); }},
  {{"LAYERSTREAM_OSTRIS_DECODE", "switch", kTuning, true, "1", kSwitch, "0",
    "layerstream decodes AI-Toolkit's OstrisLinear weights itself, each proven bitwise on its first call "
    "(0: every backend runs its own forward)"},
   [](Settings& s, const std::string& t) { return store(s.ostris_decode, switch_of(t)); },
   [](const Settings& s) { return on_off(s.ostris_decode); }},
  {{"LAYERSTREAM_SHARE_HOST", "choice", kTuning, true, "auto", "auto, 1 or on, or 0 or off", "0",
    "under torchrun or accelerate, the ranks of a host share one host copy of the frozen weights"},
   [](Settings& s, const std::string& t) { return parse_choice(s.share_host, kShareHosts, t); },
   [](const Settings& s) { return word_of(s.share_host, kShareHosts); }},
  {{"LAYERSTREAM_SHARE_TIMEOUT_S", "seconds", kTuning, true, "600",
    "a positive number of seconds up to 31536000 (a year)", "600",
    "how long a rank waits for local rank 0's copy of a layer"},
   [](Settings& s, const std::string& t) {
     std::string rest;
     const std::optional<double> v = decimal(t, rest);
     if (!v || !rest.empty() || !(*v > 0) || *v > kMostTimeoutS) return false;
     s.share_timeout_s = *v;
     return true;
   },
   [](const Settings& s) { return seconds_text(s.share_timeout_s); }},
  {{"LAYERSTREAM_SHARE_TOKEN", "token", kTuning, true, "torchrun's job id", "letters, digits and underscores",
    "job_42", "names the shared segments (the same in every rank of the job) where torchrun's environment does not"},
   [](Settings& s, const std::string& t) {
     for (char c : t) {
       if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
     }
     s.share_token = t;
     return true;
   },
   [](const Settings& s) { return s.share_token.value_or(""); }},
  {{"LAYERSTREAM_CHUNK_MB", "MiB", kTuning, true, "256", kMiBRange, "256", "the largest pinned chunk"},
   [](Settings& s, const std::string& t) { return store(s.chunk_bytes, mib(t, 1)); },
   [](const Settings& s) { return mib_text(s.chunk_bytes); }},
  {{"LAYERSTREAM_PINNED_CAP_MB", "MiB", kTuning, true, "no cap", kMiBRange, "65536",
    "pin at most this much host memory; the rest is pageable and staged through bounce buffers"},
   [](Settings& s, const std::string& t) { return store(s.pinned_cap_bytes, mib(t, 1)); },
   [](const Settings& s) { return mib_text(s.pinned_cap_bytes); }},
  {{"LAYERSTREAM_TIME_WAITS", "switch", kTuning, true, "0", kSwitch, "1",
    "time how long compute waits for copies (a few microseconds a layer call; `layerstream bench` turns it on)"},
   [](Settings& s, const std::string& t) { return store(s.time_waits, switch_of(t)); },
   [](const Settings& s) { return on_off(s.time_waits); }},
  {{"LAYERSTREAM_LOG_EVERY", "count", kTuning, true, "100", "a whole number of optimizer steps (0: never)", "100",
    "every N optimizer steps, an INFO line with what a step moved"},
   [](Settings& s, const std::string& t) { return store(s.log_every, whole(t, 0, kMostCount)); },
   [](const Settings& s) { return std::to_string(s.log_every); }},
  {{"LAYERSTREAM_DECODE_BLOCKS", "count", kTuning, true, "0",
    "a whole number of thread blocks from 0 (no limit) to 65536", "64",
    "lossless only: the most thread blocks of 256 a decode may use"},
   [](Settings& s, const std::string& t) {
     const auto n = whole(t, 0, kMostDecodeBlocks);
     return store(s.decode_blocks, n ? std::optional<unsigned>(static_cast<unsigned>(*n)) : std::nullopt);
   },
   [](const Settings& s) { return std::to_string(s.decode_blocks); }},
  {{"LAYERSTREAM_BACKEND", "choice", kTests, true, "cpu", "cpu or sim", "sim",
    "how a CPU process device runs: computed on the CPU as upstream, or through the engine on the simulator"},
   [](Settings& s, const std::string& t) { return parse_choice(s.backend, kBackends, t); },
   [](const Settings& s) { return word_of(s.backend, kBackends); }},
  {{"LAYERSTREAM_SIM_FAULTS", "count", kTests, true, "no faults",
    "a whole number (the seed of the simulator's fault injector)", "1234",
    "fault injection (delays, scrambled copies) on the simulator"},
   [](Settings& s, const std::string& t) { return store(s.sim_faults, whole(t, 0, kMostCount)); },
   [](const Settings& s) { return s.sim_faults ? std::to_string(*s.sim_faults) : std::string(); }},
  {{"LAYERSTREAM_SIM_DEVICE_MB", "MiB", kTests, true, "65536", kMiBRange, "2048", "the simulated device's memory"},
   [](Settings& s, const std::string& t) { return store(s.sim_device_bytes, mib(t, 1)); },
   [](const Settings& s) { return mib_text(s.sim_device_bytes); }},
  {{"LAYERSTREAM_SIM_PINNABLE_MB", "MiB", kTests, true, "no limit", kMiBRangeOrZero, "1",
    "the most host memory the simulator lets the process pin (a small `ulimit -l`; 0: none)"},
   [](Settings& s, const std::string& t) { return store(s.sim_pinnable_bytes, mib(t, 0)); },
   [](const Settings& s) { return mib_text(s.sim_pinnable_bytes); }},
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table(std::begin(kEntries), std::end(kEntries));
  return table;
}

const Entry* entry_of(const std::string& name) {
  for (const Entry& e : entries()) {
    if (name == e.spec.name) return &e;
  }
  return nullptr;
}

// LAYERSTREAM_* names that layerstream's build, tests and GPU scripts read (not this module): set in a
// shell, they reach the training process too and are not mistakes.
const std::set<std::string>& tool_names() {
  static const std::set<std::string> names = {
      "LAYERSTREAM_CUDA", "LAYERSTREAM_TORCH", "LAYERSTREAM_BUILD_TESTS", "LAYERSTREAM_BUILD_PYTHON",
      "LAYERSTREAM_GTEST_SOURCE", "LAYERSTREAM_TEST_BUILD", "LAYERSTREAM_TEST_DEADLINE_S", "LAYERSTREAM_SANITIZER_S",
      "LAYERSTREAM_REUSE_INSTALL", "LAYERSTREAM_SWEEP", "LAYERSTREAM_PERF_RINGS", "LAYERSTREAM_PERF_BUDGET",
      "LAYERSTREAM_PERF2_RUNS", "LAYERSTREAM_PERF2_RINGS", "LAYERSTREAM_LOSSLESS_RUNS", "LAYERSTREAM_LOSSLESS_ENVS",
      "LAYERSTREAM_DEFAULTS_RUNS", "LAYERSTREAM_DEFAULTS_ROWS", "LAYERSTREAM_DEFAULTS_STEPS",
      "LAYERSTREAM_STRESS_RUNS", "LAYERSTREAM_STRESS_STEPS",
      "LAYERSTREAM_STRESS_GB",
      "LAYERSTREAM_QUANTO_RUNS", "LAYERSTREAM_DECODE_SWEEP", "LAYERSTREAM_BENCH_PRESET", "LAYERSTREAM_BENCH_CAP_GB",
      "LAYERSTREAM_REFERENCE_JSON", "LAYERSTREAM_REFERENCE_JSON_FLUX1", "LAYERSTREAM_REFERENCE_JSON_FLUX2",
      "LAYERSTREAM_MEM_RUNS", "LAYERSTREAM_PY_FILES", "LAYERSTREAM_AITKMM", "LAYERSTREAM_AITKMM_DIR",
      "LAYERSTREAM_TEST_CURRENT_QUANT", "LAYERSTREAM_OSTRIS_QTYPES", "LAYERSTREAM_OSTRIS_CAP_GB", "LAYERSTREAM_OSTRIS_DETERMINISTIC", "LAYERSTREAM_PY_K",
      "LAYERSTREAM_PY_TB", "LAYERSTREAM_AITKMM_CONFIGS", "LAYERSTREAM_AITKMM_PAIRS", "LAYERSTREAM_AITKMM_REPEAT",
      "LAYERSTREAM_MODEL_RUNS", "LAYERSTREAM_MODEL_STEPS", "LAYERSTREAM_MEM_STEPS", "LAYERSTREAM_AITKMM_ENGINES",
      // scripts/gpu_check.sh: its AI-Toolkit jobs and the release wheel's architectures.
      "LAYERSTREAM_AITKJOBS", "LAYERSTREAM_WHEEL_ARCHS", "LAYERSTREAM_WHEEL_FILES", "LAYERSTREAM_WHEEL_PREBUILT",
      // scripts/gpu_check.sh ab: the two wheels compared and the runs; the benchmark modes' carried wheel.
      "LAYERSTREAM_AB_BEFORE", "LAYERSTREAM_AB_AFTER", "LAYERSTREAM_AB_RUNS", "LAYERSTREAM_AB_ROUNDS", "LAYERSTREAM_PREBUILT",
  };
  return names;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;  // empty: unset
  return std::string(v);
}

// Says once per name which LAYERSTREAM_* variables of the environment nothing reads.
void warn_unknown_names() {
  const std::vector<std::string>& known = Settings::names();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (name.rfind("LAYERSTREAM_", 0) != 0 || tool_names().count(name) != 0 ||
        std::find(known.begin(), known.end(), name) != known.end()) {
      continue;
    }
    const std::string near = Settings::nearest(name);
    log_once("unknown-setting-" + name, LogLevel::kWarning,
             detail::concat(name, " is not a layerstream setting and is ignored",
                            near.empty() ? std::string() : "; did you mean " + near + "?",
                            " (the settings: docs/ai-toolkit.md, \"Modes and settings\")"));
  }
}

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::shared_ptr<const Settings>& snapshot() {
  static auto* s = new std::shared_ptr<const Settings>();  // outlives static teardown
  return *s;
}
Settings::Text& overrides() {
  static auto* o = new Settings::Text();
  return *o;
}

// The environment's text with `over` on top (empty values dropped: unset).
Settings::Text text_with(const Settings::Text& over) {
  Settings::Text text;
  for (const std::string& name : Settings::names()) {
    if (auto v = env(name.c_str())) text[name] = *v;
  }
  for (const auto& [name, value] : over) text[name] = value;
  for (auto it = text.begin(); it != text.end();) it = it->second.empty() ? text.erase(it) : std::next(it);
  return text;
}

std::shared_ptr<const Settings> read_locked(const Settings::Text& over) {
  Settings::Text origins;
  for (const std::string& name : Settings::names()) {
    if (over.count(name) == 0) origins[name] = "the environment";
  }
  auto s = std::make_shared<Settings>(Settings::parse(text_with(over), origins));
  s->local_rank = env("LOCAL_RANK");
  s->local_world_size = env("LOCAL_WORLD_SIZE");
  s->torchelastic_run_id = env("TORCHELASTIC_RUN_ID");
  s->master_port = env("MASTER_PORT");
  return s;
}

}  // namespace

std::optional<std::string> Settings::refusal(const std::string& name, const std::string& text,
                                             const std::string& origin) {
  const std::string where = origin.empty() ? std::string() : " (" + origin + ")";
  const Entry* e = entry_of(name);
  if (e == nullptr) {
    if (tool_names().count(name) != 0) return std::nullopt;  // read by layerstream's own tools: no mistake
    const std::string near = nearest(name);
    return detail::concat(name, "=", text, where, " is not a layerstream setting",
                          near.empty() ? std::string() : "; did you mean " + near + "?",
                          " (the settings: docs/ai-toolkit.md, \"Modes and settings\")");
  }
  Settings scratch;
  if (text.empty() || e->parse(scratch, text)) return std::nullopt;
  return detail::concat(name, "=", text, where, " is not accepted; it takes ", e->spec.accepts, ", e.g. ", name, "=",
                        e->spec.example, " (unset: ", e->spec.default_value, ")");
}

Settings Settings::parse(const Text& text, const Text& origins) {
  Settings s;
  for (const Entry& e : entries()) {
    // The declared default, where it is a value (a description such as "no cap" is not: the member stays unset).
    e.parse(s, e.spec.default_value);
    auto it = text.find(e.spec.name);
    if (it == text.end() || it->second.empty() || e.parse(s, it->second)) continue;
    auto origin = origins.find(e.spec.name);
    throw InvalidArgument(*refusal(e.spec.name, it->second, origin == origins.end() ? "" : origin->second));
  }
  return s;
}

std::shared_ptr<const Settings> Settings::current() {
  std::lock_guard<std::mutex> lock(mu());
  if (!snapshot()) snapshot() = read_locked(overrides());
  return snapshot();
}

void Settings::refresh() {
  warn_unknown_names();  // outside the lock: the log sink may wait for Python's GIL
  std::lock_guard<std::mutex> lock(mu());
  snapshot() = read_locked(overrides());
}

void Settings::configure(const std::map<std::string, std::optional<std::string>>& values) {
  std::lock_guard<std::mutex> lock(mu());
  Text over = overrides();
  for (const auto& [name, value] : values) {
    const Entry* e = entry_of(name);
    LS_CHECK_ARG(e != nullptr && e->spec.native, name, " is not a setting of manager_modules");
    if (value) over[name] = *value;
    else over.erase(name);
  }
  snapshot() = read_locked(over);  // throws before anything changed
  overrides() = std::move(over);
}

std::string Settings::text_of(const Settings& s, const std::string& name) {
  const Entry* e = entry_of(name);
  LS_CHECK_ARG(e != nullptr, name, " is not a layerstream setting");
  return e->show == nullptr ? std::string() : e->show(s);
}

const std::vector<SettingSpec>& Settings::table() {
  static const std::vector<SettingSpec> specs = [] {
    std::vector<SettingSpec> out;
    for (const Entry& e : entries()) out.push_back(e.spec);
    return out;
  }();
  return specs;
}

const std::vector<std::string>& Settings::names() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> out;
    for (const Entry& e : entries()) out.emplace_back(e.spec.name);
    return out;
  }();
  return all;
}

std::string Settings::nearest(const std::string& name) {
  std::string best;
  std::size_t best_distance = 4;  // farther than three edits: no suggestion
  for (const std::string& known : names()) {
    const std::size_t d = edit_distance(name, known);
    if (d < best_distance) {
      best_distance = d;
      best = known;
    }
  }
  return best;
}

}  // namespace layerstream
