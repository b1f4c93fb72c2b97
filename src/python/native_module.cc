// layerstream._native: thin pybind11 bindings of the core, for the CLI (demo, doctor), tests and
// telemetry. Conversion and delegation only; calls that can block release the GIL.
//
// Ownership across the boundary: a Backend outlives everything made from it (py::keep_alive ties each
// Stream and TransferEngine to its backend). Device addresses are passed to Python as integers and are
// only meaningful to the backend they came from.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "layerstream/check.h"
#include "layerstream/cuda_backend.h"
#include "layerstream/log.h"
#include "layerstream/settings.h"
#include "layerstream/sim_backend.h"
#include "layerstream/transfer_engine.h"
#include "vc_runtime.h"

namespace py = pybind11;
using namespace layerstream;

namespace {

using release_gil = py::call_guard<py::gil_scoped_release>;

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// The fields by their names (layerstream/stats_fields.h).
#define LAYERSTREAM_TO_DICT(type, name) d[#name] = s.name;

py::dict arena_stats_dict(const ArenaStats& s) {
  py::dict d;
  LAYERSTREAM_ARENA_FIELDS(LAYERSTREAM_TO_DICT)
  return d;
}

py::dict engine_stats_dict(const EngineStats& s) {
  py::dict d;
  LAYERSTREAM_ENGINE_COUNTERS(LAYERSTREAM_TO_DICT)
  LAYERSTREAM_ENGINE_GAUGES(LAYERSTREAM_TO_DICT)
  d["arena"] = arena_stats_dict(s.arena);
  return d;
}

#undef LAYERSTREAM_TO_DICT

// Python-side owner of a stream (the RAII Stream, plus a way to synchronize it).
struct PyStream {
  Backend* backend;
  Stream stream;
};

void bind_platform(py::module_& m) {
  m.def("cuda_compiled", &cuda_compiled, "Whether this build includes the CUDA backend.");
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason);
  m.def(
      "set_log_sink",
      [](py::object sink) {
        if (sink.is_none()) {
          set_log_sink(nullptr);
          return;
        }
        // The sink is called from any thread; take the GIL for the call only.
        auto holder = std::make_shared<py::object>(std::move(sink));
        set_log_sink([holder](LogLevel level, const std::string& message) {
          py::gil_scoped_acquire gil;
          try {
            (*holder)(static_cast<int>(level), message);
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("layerstream log sink");
          }
        });
      },
      py::arg("sink"), "Route core log messages to sink(level: int, message: str); None restores stderr.");
  m.def("reset_log_once", &reset_log_once);
}

// The settings' declaration (layerstream/settings.h) and their parsers, for `layerstream status`, `set` and
// the AI-Toolkit hook, which check settings without importing manager_modules (whose import refuses them).
void bind_settings_table(py::module_& m) {
  m.def("settings_table", [] {
    py::list rows;
    for (const SettingSpec& s : Settings::table()) {
      const char* audience = s.audience == SettingAudience::kUser     ? "user"
                             : s.audience == SettingAudience::kTuning ? "tuning"
                                                                      : "tests";
      py::dict row;
      row["name"] = s.name;
      row["type"] = s.type;
      row["audience"] = audience;
      row["native"] = s.native;
      row["default"] = s.default_value;
      row["accepts"] = s.accepts;
      row["example"] = s.example;
      row["doc"] = s.doc;
      rows.append(row);
    }
    return rows;
  }, "Every setting's declaration, in the docs' order: name, type, audience, native, default, accepts, example, doc.");
  m.def("setting_refusal", &Settings::refusal, py::arg("name"), py::arg("value"), py::arg("origin") = "",
        "The one line refusing `value` for setting `name` (naming `origin`, e.g. '.env line 3'), or None when "
        "it is accepted; an unknown name is refused.");
  m.def("nearest_setting", &Settings::nearest, py::arg("name"), "The setting nearest to `name`, or ''.");
}

void bind_backends(py::module_& m) {
  py::class_<Backend, std::unique_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("kind",
                             [](const Backend& b) { return b.kind() == BackendKind::kCuda ? "cuda" : "sim"; })
      .def_property_readonly("device", &Backend::device)
      .def("memory_info", &Backend::device_memory_info, "(free, total) bytes of device memory.");

  m.def(
      "sim_backend",
      [](std::uint64_t seed, double delay_probability, unsigned max_delay_us, bool scramble_copies,
         std::size_t device_capacity_bytes, py::object pinned_capacity_bytes) {
        SimOptions o;
        o.seed = seed;
        o.delay_probability = delay_probability;
        o.max_delay_us = max_delay_us;
        o.scramble_copies = scramble_copies;
        o.device_capacity_bytes = device_capacity_bytes;
        if (!pinned_capacity_bytes.is_none()) o.pinned_capacity_bytes = pinned_capacity_bytes.cast<std::size_t>();
        return std::unique_ptr<Backend>(std::make_unique<SimBackend>(o));
      },
      py::arg("seed") = 0, py::arg("delay_probability") = 0.0, py::arg("max_delay_us") = 0,
      py::arg("scramble_copies") = false, py::arg("device_capacity_bytes") = std::size_t{1} << 30,
      py::arg("pinned_capacity_bytes") = py::none(),
      "A simulated device played by host threads, with optional fault injection.");
  m.def("cuda_backend", &make_cuda_backend, py::arg("device") = 0, "A backend bound to CUDA device N.");
  m.def("sim_race_count", [](Backend& b) -> std::size_t {
    auto* sim = dynamic_cast<SimBackend*>(&b);
    LS_CHECK_ARG(sim != nullptr, "sim_race_count: ", b.name(), " is not a sim backend");
    return sim->violation_count();
  });
  m.def("sim_races", [](Backend& b) {
    auto* sim = dynamic_cast<SimBackend*>(&b);
    LS_CHECK_ARG(sim != nullptr, "sim_races: ", b.name(), " is not a sim backend");
    return sim->violations();
  });
}

// Streams, leases and the engine.
void bind_engine(py::module_& m) {
  py::class_<PyStream>(m, "Stream")
      .def(py::init([](Backend& b) { return new PyStream{&b, Stream(b)}; }), py::keep_alive<1, 2>())
      .def("synchronize", [](PyStream& s) { s.backend->stream_synchronize(s.stream.get()); }, release_gil())
      .def(
          "read_device",
          [](PyStream& s, std::uintptr_t device_ptr, std::size_t bytes) {
            // Reads device bytes back through a pinned staging buffer, ordered after this stream's work.
            PinnedBuffer staging(*s.backend, bytes, PinMethod::kHostAlloc);
            {
              py::gil_scoped_release nogil;
              s.backend->memcpy_d2h_async(staging.data(), reinterpret_cast<const void*>(device_ptr), bytes,
                                          s.stream.get());
              s.backend->stream_synchronize(s.stream.get());
            }
            return py::bytes(static_cast<const char*>(staging.data()), bytes);
          },
          py::arg("device_ptr"), py::arg("bytes"));

  py::class_<Lease>(m, "Lease")
      .def_readonly("layer", &Lease::layer)
      .def_readonly("ticket", &Lease::ticket)
      .def_readonly("bytes", &Lease::bytes)
      .def_readonly("copied", &Lease::copied)
      .def_property_readonly("data", [](const Lease& l) { return address(l.data); });

  py::class_<TransferEngine>(m, "TransferEngine")
      .def(py::init([](Backend& b, std::size_t ring_bytes, std::size_t chunk_bytes, std::size_t pinned_cap_bytes,
                       std::string pin_method) {
             EngineOptions o;
             o.ring_bytes = ring_bytes;
             o.arena.chunk_bytes = chunk_bytes;
             o.arena.pinned_cap_bytes = pinned_cap_bytes;
             LS_CHECK_ARG(pin_method == "host_alloc" || pin_method == "register",
                          "pin_method must be 'host_alloc' or 'register', not '", pin_method, "'");
             o.arena.pin_method = pin_method == "register" ? PinMethod::kRegister : PinMethod::kHostAlloc;
             return new TransferEngine(b, o);
           }),
           py::arg("backend"), py::arg("ring_bytes"), py::arg("chunk_bytes") = std::size_t{256} << 20,
           py::arg("pinned_cap_bytes") = 0, py::arg("pin_method") = "host_alloc", py::keep_alive<1, 2>())
      .def("add_layer", &TransferEngine::add_layer, py::arg("bytes"), release_gil())
      .def("remove_layer", &TransferEngine::remove_layer, py::arg("layer"), release_gil())
      .def(
          "host_view",
          [](TransferEngine& e, LayerId layer) {
            const HostBlock b = e.host_block(layer);
            return py::memoryview::from_memory(b.data, static_cast<py::ssize_t>(b.bytes));
          },
          py::arg("layer"),
          "Writable view of the layer's host bytes. Call begin_host_write() before changing them after a fetch.")
      .def("host_pinned", [](TransferEngine& e, LayerId layer) { return e.host_block(layer).pinned; })
      .def("begin_host_write", &TransferEngine::begin_host_write, py::arg("layer"), release_gil())
      .def("on_device", &TransferEngine::on_device, py::arg("layer"))
      .def("fetch", &TransferEngine::fetch, py::arg("layer"), release_gil())
      .def(
          "wait_ready", [](TransferEngine& e, const Lease& l, PyStream& s) { e.wait_ready(l, s.stream.get()); },
          py::arg("lease"), py::arg("stream"), release_gil())
      .def(
          "device_data", [](const TransferEngine& e, const Lease& l) { return address(e.device_data(l)); },
          py::arg("lease"))
      .def(
          "release", [](TransferEngine& e, const Lease& l, PyStream& s) { e.release(l, s.stream.get()); },
          py::arg("lease"), py::arg("stream"), release_gil())
      .def("sync_downloads", &TransferEngine::sync_downloads, release_gil())
      .def("stats", [](const TransferEngine& e) { return engine_stats_dict(e.stats()); });
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  if (const std::string refused = vc_runtime::refusal(); !refused.empty()) throw py::import_error(refused);
  m.doc() = "layerstream native core (torch-free): backends, pinned arena, device ring, transfer engine";

  py::register_exception<Error>(m, "NativeError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  bind_platform(m);
  bind_settings_table(m);
  bind_backends(m);
  bind_engine(m);
}
