// manager_modules.settings() and configure(): Settings (settings.h) as seen from Python. The keys are the
// variables' names without LAYERSTREAM_, lowercase (LAYERSTREAM_RING_MB: ring_mb), in the variables' units.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cctype>

#include "bindings.h"
#include "layerstream/check.h"
#include "layerstream/settings.h"
#include "streamed_layer.h"

namespace py = pybind11;

namespace layerstream::torchglue {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::string key_of(const std::string& name) {
  std::string key = name.substr(std::string("LAYERSTREAM_").size());
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return std::tolower(c); });
  return key;
}

template <typename T>
py::object or_none(const std::optional<T>& v) {
  return v ? py::cast(*v) : py::none();
}
py::object mib_or_none(const std::optional<std::size_t>& bytes) {
  return bytes ? py::cast(*bytes / kMiB) : py::none();
}

const char* host_dtype_name(HostDtype d) {
  switch (d) {
    case HostDtype::kLossless: return "lossless";
    case HostDtype::kFloat8E4M3: return "float8_e4m3fn";
    case HostDtype::kFloat8E5M2: return "float8_e5m2";
    case HostDtype::kSame: return "same";
    case HostDtype::kAuto: break;
  }
  return "auto";
}

py::dict settings_dict() {
  const std::shared_ptr<const Settings> s = Settings::current();
  py::dict d;
  d["backend"] = s->backend == CpuBackend::kSim ? "sim" : "cpu";
  d["ring_mb"] = mib_or_none(s->ring_bytes);
  d["prefetch"] = s->prefetch;
  d["ring_policy"] = s->ring_policy == RingPolicy::kLeastRecentlyUsed ? "lru" : "fifo";
  d["prefetch_layers"] = s->prefetch_layers;
  d["resident_mb"] = s->resident_bytes / kMiB;
  d["vram_budget"] = !s->vram_budget.enabled ? py::none()
                     : s->vram_budget.automatic ? py::cast("auto")
                                                : py::cast(s->vram_budget.bytes);
  d["vram_peak"] = s->vram_peak == VramPeak::kCycles ? "cycles" : "window";
  d["vram_gap"] = s->vram_gap == VramGap::kQuarterAboveStart ? "start"
                 : s->vram_gap == VramGap::kLend               ? "lend"
                                                               : "peak";
  d["host_dtype"] = host_dtype_name(s->host_dtype);
  d["ostris_decode"] = s->ostris_decode;
  d["share_host"] = s->share_host == ShareHost::kAuto ? "auto" : s->share_host == ShareHost::kOn ? "on" : "off";
  d["share_timeout_s"] = s->share_timeout_s;
  d["share_token"] = or_none(s->share_token);
  d["chunk_mb"] = s->chunk_bytes / kMiB;
  d["pinned_cap_mb"] = mib_or_none(s->pinned_cap_bytes);
  d["time_waits"] = s->time_waits;
  d["log_every"] = s->log_every;
  d["decode_blocks"] = s->decode_blocks;
  d["sim_faults"] = or_none(s->sim_faults);
  d["sim_device_mb"] = mib_or_none(s->sim_device_bytes);
  d["sim_pinnable_mb"] = mib_or_none(s->sim_pinnable_bytes);
  return d;
}

// The declaration of the setting configure() calls `key`, when manager_modules reads it.
const SettingSpec* native_spec(const std::string& key) {
  for (const SettingSpec& spec : Settings::table()) {
    if (spec.native && key_of(spec.name) == key) return &spec;
  }
  return nullptr;
}

// What configure() takes for a setting of each type: the types settings() returns, and a str (the
// environment's text, checked by the same parser). A bool is no number (True is not 1 MiB).
const char* python_types(const std::string& type) {
  if (type == "switch") return "a bool or str";
  if (type == "MiB" || type == "count") return "an int or str";
  if (type == "size" || type == "seconds") return "an int, float or str";
  return "a str";
}

// A Python value as the text an environment variable would hold; a value of a type the setting does not
// take is refused.
std::optional<std::string> text_of(const std::string& key, const SettingSpec& spec, const py::handle& value) {
  if (value.is_none()) return std::nullopt;
  const std::string type = spec.type;
  const bool is_bool = py::isinstance<py::bool_>(value);
  const bool is_int = py::isinstance<py::int_>(value) && !is_bool;
  const bool is_float = py::isinstance<py::float_>(value);
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  if (is_bool && type == "switch") return value.cast<bool>() ? "1" : "0";
  if (is_int && (type == "MiB" || type == "count" || type == "size" || type == "seconds")) {
    return py::str(value).cast<std::string>();
  }
  if (is_float && (type == "size" || type == "seconds")) return py::str(value).cast<std::string>();
  LS_CHECK_ARG(false, "configure(", key, "=", py::repr(value).cast<std::string>(), "): ", key, " takes ",
               python_types(type), " (", spec.accepts, ") or None (back to the environment), not ",
               py::str(py::type::of(value).attr("__name__")).cast<std::string>());
  return std::nullopt;
}

void configure(const py::kwargs& kwargs) {
  std::map<std::string, std::optional<std::string>> values;
  for (auto item : kwargs) {
    const std::string key = item.first.cast<std::string>();
    const SettingSpec* spec = native_spec(key);
    if (spec == nullptr) {
      std::string name = "LAYERSTREAM_" + key;
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
      const std::string near = Settings::nearest(name);
      LS_CHECK_ARG(false, "configure(", key, "=...): ", key, " is not a layerstream setting",
                   near.empty() || native_spec(key_of(near)) == nullptr ? std::string()
                                                                        : "; did you mean " + key_of(near) + "?",
                   " (settings() lists them)");
    }
    values[spec->name] = text_of(key, *spec, item.second);
  }
  Settings::configure(values);
  if (kwargs.contains("decode_blocks")) set_decode_blocks(Settings::current()->decode_blocks);
}

}  // namespace

void bind_settings(py::module_& m) {
  m.def("settings", &settings_dict,
        "The settings in force, by name (LAYERSTREAM_RING_MB: 'ring_mb'), in the variables' units; None: unset. "
        "See docs/ai-toolkit.md, \"Modes and settings\".");
  m.def("configure", &configure,
        "Sets settings from Python, checked as the environment's are (ValueError naming the variable): e.g. "
        "configure(ring_mb=3072, prefetch=False). They take precedence over the environment; None gives a "
        "setting back to it. Device states created from now on use them (and the process-wide ones at once).");
}

}  // namespace layerstream::torchglue
