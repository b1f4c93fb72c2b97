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

std::string key_of(const std::string& name) {
  std::string key = name.substr(std::string("LAYERSTREAM_").size());
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return std::tolower(c); });
  return key;
}

// settings(): every setting Settings holds, as its declaration's type reads in Python (None: unset).
py::dict settings_dict() {
  const std::shared_ptr<const Settings> s = Settings::current();
  py::dict d;
  for (const SettingSpec& spec : Settings::table()) {
    if (!spec.native) continue;
    const std::string text = Settings::text_of(*s, spec.name);
    const std::string type = spec.type;
    py::object value;
    if (text.empty()) value = py::none();
    else if (type == "switch") value = py::bool_(text == "1");
    else if (type == "MiB" || type == "count") value = py::int_(py::str(text));
    else if (type == "seconds") value = py::float_(std::stod(text));
    else if (type == "size" && std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); })) {
      value = py::int_(py::str(text));  // bytes; otherwise a mode (min, auto)
    } else value = py::str(text);
    d[py::str(key_of(spec.name))] = value;
  }
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
