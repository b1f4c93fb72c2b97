#include "layerstream/settings.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <set>

#include "layerstream/check.h"
#include "layerstream/log.h"

extern char** environ;  // POSIX: the process's environment, scanned for unknown LAYERSTREAM_* names

namespace layerstream::torchglue {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::uint64_t kMostMiB = std::uint64_t{1} << 30;  // 1 PiB: more than any host or device holds
constexpr const char* kMiBRange = "MiB up to 1073741824 (1 PiB)";
constexpr double kMostTimeoutS = 365.0 * 24 * 3600;

// Digits only (no sign, space or exponent), within 64 bits; nullopt otherwise.
std::optional<std::uint64_t> digits(const std::string& text) {
  if (text.empty()) return std::nullopt;
  std::uint64_t n = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const std::uint64_t d = static_cast<std::uint64_t>(c - '0');
    if (n > (std::numeric_limits<std::uint64_t>::max() - d) / 10) return std::nullopt;
    n = n * 10 + d;
  }
  return n;
}

// A whole number from `least` to `most`; `what` says what it counts for the message ("positive whole
// number of layers").
std::uint64_t whole(const std::string& name, const std::string& text, std::uint64_t least, std::uint64_t most,
                    const std::string& what, const char* example) {
  const std::optional<std::uint64_t> n = digits(text);
  LS_CHECK_ARG(n && *n >= least && *n <= most, name, "=", text, " is not a ", what, "; unset it or give e.g. ", name,
               "=", example);
  return *n;
}

std::size_t mib(const std::string& name, const std::string& text, bool allow_zero, const char* example) {
  const std::string what = std::string(allow_zero ? "" : "positive ") + "whole number of " + kMiBRange;
  return static_cast<std::size_t>(whole(name, text, allow_zero ? 0 : 1, kMostMiB, what, example)) * kMiB;
}

// A plain decimal number (digits, one point, an exponent; no sign, hex, inf or nan) that is finite;
// `rest` receives what follows it (a unit). nullopt when the text does not start with one.
std::optional<double> decimal(const std::string& text, std::string& rest) {
  if (text.empty() || !(std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.')) return std::nullopt;
  if (text.find_first_of("xX") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(v)) return std::nullopt;
  rest = end;
  return v;
}

bool switch_value(const std::string& name, const std::string& text, const char* example) {
  std::string v = text;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  LS_CHECK_ARG(false, name, "=", text, " is not a switch: give 1, true, on or yes, or 0, false, off or no; unset it "
               "or give e.g. ", name, "=", example);
  return false;
}

using Parser = std::function<void(Settings&, const std::string& name, const std::string& text)>;

struct Entry {
  const char* name;
  Parser parse;
};

// The parsers too long for a line of the table.
void parse_ring_policy(Settings& s, const std::string& n, const std::string& t) {
  LS_CHECK_ARG(t == "fifo" || t == "lru", n, "=", t,
               " is not understood; give fifo (the default: a region goes at the ring's head) or lru (over "
               "the memory used longest ago)");
  s.ring_policy = t == "lru" ? RingPolicy::kLeastRecentlyUsed : RingPolicy::kFifo;
}

void parse_vram_peak(Settings& s, const std::string& n, const std::string& t) {
  LS_CHECK_ARG(t == "window" || t == "cycles", n, "=", t,
               " is not understood; give cycles (the default: each training cycle's step and gap measured apart) "
               "or window (the first steps' window, as before 2026-12-01)");
  s.vram_peak = t == "cycles" ? VramPeak::kCycles : VramPeak::kWindow;
}

void parse_vram_gap(Settings& s, const std::string& n, const std::string& t) {
  LS_CHECK_ARG(t == "peak" || t == "start" || t == "lend", n, "=", t,
               " is not understood; give peak (the default: the budget leaves a quarter of the device free on top "
               "of the peak between steps), start (a quarter above the training cycle's start, the headroom "
               "at the peak between steps; less room promised between steps) or lend (the quarter holds "
               "resident layers that are given back first when an allocation between steps needs it, and "
               "copied again in the next step)");
  s.vram_gap = t == "start" ? VramGap::kQuarterAboveStart : t == "lend" ? VramGap::kLend : VramGap::kQuarterAtPeak;
}

void parse_host_dtype(Settings& s, const std::string& n, const std::string& t) {
  if (t == "same") s.host_dtype = HostDtype::kSame;
  else if (t == "lossless") s.host_dtype = HostDtype::kLossless;
  else if (t == "float8_e4m3fn") s.host_dtype = HostDtype::kFloat8E4M3;
  else if (t == "float8_e5m2") s.host_dtype = HostDtype::kFloat8E5M2;
  else
    LS_CHECK_ARG(false, n, "=", t,
                 " is not a setting layerstream knows: use lossless (frozen bfloat16 weights kept and streamed "
                 "exactly, in about three quarters of their bytes), float8_e4m3fn or float8_e5m2 (frozen "
                 "weights kept and streamed as 8-bit codes with a scale per output channel), or unset it (or "
                 "'same') to stream weights as they are");
}

void parse_share_host(Settings& s, const std::string& n, const std::string& t) {
  if (t == "auto") s.share_host = ShareHost::kAuto;
  else if (t == "1" || t == "on") s.share_host = ShareHost::kOn;
  else if (t == "0" || t == "off") s.share_host = ShareHost::kOff;
  else LS_CHECK_ARG(false, n, "=", t, " is not a setting layerstream knows: auto (the default), 1 or 0");
}

void parse_share_timeout(Settings& s, const std::string& n, const std::string& t) {
  std::string rest;
  const std::optional<double> v = decimal(t, rest);
  LS_CHECK_ARG(v && rest.empty() && *v > 0 && *v <= kMostTimeoutS, n, "=", t,
               " is not a positive number of seconds up to 31536000 (a year); unset it or give e.g. ", n,
               "=600");
  s.share_timeout_s = *v;
}

void parse_share_token(Settings& s, const std::string& n, const std::string& t) {
  for (char c : t) {
    LS_CHECK_ARG(std::isalnum(static_cast<unsigned char>(c)) || c == '_', n,
                 " must be letters, digits and underscores, not '", t, "'; e.g. ", n, "=job_42");
  }
  s.share_token = t;
}

// Every setting, in the order of the docs' table (docs/ai-toolkit.md, "Modes and settings").
const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = {
      {"LAYERSTREAM_BACKEND",
       [](Settings& s, const std::string& n, const std::string& t) {
         LS_CHECK_ARG(t == "sim" || t == "cpu", n, "=", t, " is not understood; use 'sim' or 'cpu' (or unset it)");
         s.backend = t == "sim" ? CpuBackend::kSim : CpuBackend::kCpu;
       }},
      {"LAYERSTREAM_RING_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.ring_bytes = mib(n, t, false, "3072"); }},
      {"LAYERSTREAM_PREFETCH",
       [](Settings& s, const std::string& n, const std::string& t) { s.prefetch = switch_value(n, t, "0"); }},
      {"LAYERSTREAM_RING_POLICY", &parse_ring_policy},
      {"LAYERSTREAM_PREFETCH_LAYERS",
       [](Settings& s, const std::string& n, const std::string& t) {
         s.prefetch_layers = static_cast<std::size_t>(
             whole(n, t, 1, std::numeric_limits<std::size_t>::max(), "positive whole number of layers", "16"));
       }},
      {"LAYERSTREAM_RESIDENT_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.resident_bytes = mib(n, t, true, "4096"); }},
      {"LAYERSTREAM_VRAM_BUDGET",
       [](Settings& s, const std::string&, const std::string& t) { s.vram_budget = VramBudget::parse(t.c_str()); }},
      {"LAYERSTREAM_VRAM_PEAK", &parse_vram_peak},
      {"LAYERSTREAM_VRAM_GAP", &parse_vram_gap},
      {"LAYERSTREAM_HOST_DTYPE", &parse_host_dtype},
      {"LAYERSTREAM_OSTRIS_DECODE",
       [](Settings& s, const std::string& n, const std::string& t) { s.ostris_decode = switch_value(n, t, "0"); }},
      {"LAYERSTREAM_SHARE_HOST", &parse_share_host},
      {"LAYERSTREAM_SHARE_TIMEOUT_S", &parse_share_timeout},
      {"LAYERSTREAM_SHARE_TOKEN", &parse_share_token},
      {"LAYERSTREAM_CHUNK_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.chunk_bytes = mib(n, t, false, "256"); }},
      {"LAYERSTREAM_PINNED_CAP_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.pinned_cap_bytes = mib(n, t, false, "65536"); }},
      {"LAYERSTREAM_TIME_WAITS",
       [](Settings& s, const std::string& n, const std::string& t) { s.time_waits = switch_value(n, t, "1"); }},
      {"LAYERSTREAM_LOG_EVERY",
       [](Settings& s, const std::string& n, const std::string& t) {
         s.log_every = whole(n, t, 0, std::numeric_limits<std::uint64_t>::max(),
                             "whole number of optimizer steps (0: never)", "100");
       }},
      {"LAYERSTREAM_DECODE_BLOCKS",
       [](Settings& s, const std::string& n, const std::string& t) {
         s.decode_blocks = static_cast<unsigned>(
             whole(n, t, 0, kMostDecodeBlocks,
                   detail::concat("whole number of thread blocks from 0 (no limit) to ", kMostDecodeBlocks), "64"));
       }},
      {"LAYERSTREAM_SIM_FAULTS",
       [](Settings& s, const std::string& n, const std::string& t) {
         s.sim_faults = whole(n, t, 0, std::numeric_limits<std::uint64_t>::max(),
                              "whole number (the seed of the simulator's fault injector)", "1234");
       }},
      {"LAYERSTREAM_SIM_DEVICE_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.sim_device_bytes = mib(n, t, false, "2048"); }},
      {"LAYERSTREAM_SIM_PINNABLE_MB",
       [](Settings& s, const std::string& n, const std::string& t) { s.sim_pinnable_bytes = mib(n, t, true, "1"); }},
  };
  return table;
}

// LAYERSTREAM_* names that layerstream's build, tests and GPU scripts read (not this module): set in a
// shell, they reach the training process too and are not mistakes.
const std::set<std::string>& tool_names() {
  static const std::set<std::string> names = {
      "LAYERSTREAM_CUDA", "LAYERSTREAM_TORCH", "LAYERSTREAM_BUILD_TESTS", "LAYERSTREAM_BUILD_PYTHON",
      "LAYERSTREAM_GTEST_SOURCE", "LAYERSTREAM_TEST_BUILD", "LAYERSTREAM_TEST_DEADLINE_S", "LAYERSTREAM_SANITIZER_S",
      "LAYERSTREAM_REUSE_INSTALL", "LAYERSTREAM_SWEEP", "LAYERSTREAM_PERF_RINGS", "LAYERSTREAM_PERF_BUDGET",
      "LAYERSTREAM_PERF2_RUNS", "LAYERSTREAM_PERF2_RINGS", "LAYERSTREAM_LOSSLESS_RUNS", "LAYERSTREAM_LOSSLESS_ENVS",
      "LAYERSTREAM_QUANTO_RUNS", "LAYERSTREAM_DECODE_SWEEP", "LAYERSTREAM_BENCH_PRESET", "LAYERSTREAM_BENCH_CAP_GB",
      "LAYERSTREAM_REFERENCE_JSON", "LAYERSTREAM_REFERENCE_JSON_FLUX1", "LAYERSTREAM_REFERENCE_JSON_FLUX2",
      "LAYERSTREAM_MEM_RUNS", "LAYERSTREAM_PY_FILES", "LAYERSTREAM_AITKMM", "LAYERSTREAM_AITKMM_DIR",
      "LAYERSTREAM_TEST_CURRENT_QUANT", "LAYERSTREAM_OSTRIS_QTYPES", "LAYERSTREAM_OSTRIS_CAP_GB", "LAYERSTREAM_OSTRIS_DETERMINISTIC", "LAYERSTREAM_PY_K",
      "LAYERSTREAM_PY_TB", "LAYERSTREAM_AITKMM_CONFIGS", "LAYERSTREAM_AITKMM_PAIRS", "LAYERSTREAM_AITKMM_REPEAT",
      "LAYERSTREAM_MODEL_RUNS", "LAYERSTREAM_MODEL_STEPS", "LAYERSTREAM_MEM_STEPS", "LAYERSTREAM_AITKMM_ENGINES",
      // Read by the Python package (python/layerstream/_logging.py), not by this module.
      "LAYERSTREAM_LOG",
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
  auto s = std::make_shared<Settings>(Settings::parse(text_with(over)));
  s->local_rank = env("LOCAL_RANK");
  s->local_world_size = env("LOCAL_WORLD_SIZE");
  s->torchelastic_run_id = env("TORCHELASTIC_RUN_ID");
  s->master_port = env("MASTER_PORT");
  return s;
}

}  // namespace

VramBudget VramBudget::parse(const char* text) {
  VramBudget b;
  if (text == nullptr || *text == '\0') return b;
  const std::string v(text);
  if (v == "min") return b;  // the default, said explicitly
  b.enabled = true;
  if (v == "auto") {
    b.automatic = true;
    return b;
  }
  std::string unit;
  const std::optional<double> number = decimal(v, unit);
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB") scale = 1024.0;
  else if (unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  const double bytes = number ? *number * scale : 0;
  LS_CHECK_ARG(number && scale > 0 && bytes >= static_cast<double>(kMiB) &&
                   bytes <= static_cast<double>(kMostMiB) * static_cast<double>(kMiB),
               "LAYERSTREAM_VRAM_BUDGET=", v,
               " is not understood; give 'min' (the default: the least device memory, no layer kept), 'auto' (free "
               "device memory minus a headroom, given back when the process needs it) or a size from 1MiB to 1PiB "
               "such as 24GiB, 24GB, 20000MiB or a number of bytes");
  b.bytes = static_cast<std::size_t>(bytes);
  return b;
}

Settings Settings::parse(const Text& text) {
  Settings s;
  for (const Entry& e : entries()) {
    auto it = text.find(e.name);
    if (it != text.end() && !it->second.empty()) e.parse(s, e.name, it->second);
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
    const std::vector<std::string>& known = names();
    LS_CHECK_ARG(std::find(known.begin(), known.end(), name) != known.end(), name, " is not a layerstream setting");
    if (value) over[name] = *value;
    else over.erase(name);
  }
  snapshot() = read_locked(over);  // throws before anything changed
  overrides() = std::move(over);
}

const std::vector<std::string>& Settings::names() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> out;
    for (const Entry& e : entries()) out.emplace_back(e.name);
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

}  // namespace layerstream::torchglue
