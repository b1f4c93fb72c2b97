// manager_modules: the drop-in replacement of AI-Toolkit's toolkit/memory_management/manager_modules.py.
//
// The surface (names, attributes, side effects) is the one AI-Toolkit's manager.py relies on, for the
// 2025-11 and 2026-08 versions alike; see docs/ai-toolkit.md. What is done per call runs in C++: the
// forward installed on a managed layer is a C++ callable that reads the layer's weight and bias, checks
// them against the packed copy, and calls the StreamedLayer's autograd function. Python code runs only at
// attach time, on the generic path for tensor-subclass weights layerstream does not know, and in the
// layer's own forward on the OstrisLinear path.
//
// Lifetime: the installed forward holds the StreamedLayer (C++) and weak references to the layer and to
// its `_layer_memory_manager` object, so no reference cycle hides from Python's garbage collector.
//
// The parts, one concept a file: device_registry (the _DEVICE_STATE dict), layer_kinds (which weights
// stream how), forward_paths and module_tensors (what a call does, per LayerManager::form), telemetry
// (stats() and the log), share_handshake (HostShare's resolver), settings_binding and testing_hooks (the
// `_testing` submodule).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "bindings.h"
#include "cuda_memory.h"
#include "device_registry.h"
#include "forward_paths.h"
#include "host_share.h"
#include "layer_kinds.h"
#include "layer_manager.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/settings.h"
#include "module_tensors.h"
#include "packed_weight_glue.h"
#include "py_torch.h"
#include "streamed_layer.h"
#include "telemetry.h"
#include "vc_runtime.h"

namespace py = pybind11;
using namespace layerstream;
using namespace layerstream::torchglue;

namespace {

struct LinearManager : LayerManager {};
struct ConvManager : LayerManager {};
struct OstrisManager : LayerManager {};

enum class Which { kLinear, kConv, kOstris };

// The manager classes as this module defined them (it may be imported under another name, e.g. as
// toolkit.memory_management.manager_modules in copy mode).
py::handle& class_of(Which which) {
  static py::handle classes[3];
  return classes[static_cast<int>(which)];
}

void attach(const py::object& module, const py::object& manager, Which which) {
  if (py::hasattr(module, "_layer_memory_manager")) return;  // second attach: a no-op, as upstream
  py::object device = torch_module().attr("device")(manager.attr("process_device"));
  std::shared_ptr<DeviceState> state = state_for(device);

  py::object manager_obj = class_of(which)();
  LayerManager& core = manager_obj.cast<LayerManager&>();
  manager_obj.attr("module") = module;
  manager_obj.attr("manager") = manager;
  py::object ara = py::hasattr(module, "ara_lora_ref") ? module.attr("ara_lora_ref")() : py::none();
  manager_obj.attr("_original_forward") = ara.is_none() ? module.attr("forward") : ara.attr("org_forward");

  if (which == Which::kOstris) {
    // OstrisLinear: the quantized buffers and the bias go into one arena block, as stored.
    attach_form(module, core, state, false, recognise_ostris_layer(module));
  } else {
    attach_weighted(module, core, state, which == Which::kConv);
  }

  module.attr("_layer_memory_manager") = manager_obj;
  mark_params_managed(module);
  module.attr("_memory_management_device") = manager.attr("process_device");
  py::cpp_function forward = make_forward(module, manager_obj, state, which == Which::kConv);
  if (ara.is_none()) {
    module.attr("forward") = forward;
  } else {
    ara.attr("org_forward") = forward;
  }
}

void check_torch_version() {
  const std::string running = torch_module().attr("__version__").cast<std::string>();
  const std::string built = LAYERSTREAM_TORCH_BUILT_WITH;
  if (running != built) {
    throw py::import_error("layerstream.manager_modules was built against torch " + built +
                           " but this process runs torch " + running +
                           "; install the layerstream wheel built for torch " + running +
                           " (docs/install.md), or rebuild it in this environment: pip install "
                           "--no-build-isolation --force-reinstall /path/to/layerstream");
  }
}

void bind_layer_managers(py::module_& m) {
  py::class_<LayerManager>(m, "BaseLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_property_readonly(
          "path", [](const LayerManager& lm) { return path_name(lm); },
          "How calls run: streamed, cpu, quantized, generic or ostris.")
      .def_property_readonly(
          "form",
          [](const LayerManager& m) -> py::object {
            if (m.form == nullptr) return py::none();
            // A plain weight may be kept compressed by LAYERSTREAM_HOST_DTYPE: the form pack() gave it.
            const StoredForm* stored =
                m.form->parts == ArenaParts::kWeightBias && m.layer ? m.layer->weight_form() : nullptr;
            return py::str(std::string((stored != nullptr ? stored : m.form)->name));
          },
          "The weight's stored form (layerstream/stored_form.h): plain, lossless-bf16, quanto-qbytes, bnb-4bit, ...")
      .def_property_readonly(
          "stored_as", [](const LayerManager& m) -> py::object {
            return m.layer ? py::cast(m.layer->stored_as()) : py::none();
          },
          "The dtype of the weight bytes in the arena (float8/int8 codes when quantized or compressed).")
      .def_property_readonly("packed_bytes", [](const LayerManager& lm) -> std::size_t {
        return lm.layer ? lm.layer->packed_bytes() : 0;
      });
  py::class_<LinearManager, LayerManager>(m, "LinearLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kLinear);
      }, py::arg("module"), py::arg("manager"));
  py::class_<ConvManager, LayerManager>(m, "ConvLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kConv);
      }, py::arg("module"), py::arg("manager"));
  py::class_<OstrisManager, LayerManager>(m, "OstrisLinearLayerMemoryManager", py::dynamic_attr())
      .def(py::init<>())
      .def_static("attach", [](const py::object& module, const py::object& manager) {
        attach(module, manager, Which::kOstris);
      }, py::arg("module"), py::arg("manager"));

  class_of(Which::kLinear) = m.attr("LinearLayerMemoryManager");
  class_of(Which::kConv) = m.attr("ConvLayerMemoryManager");
  class_of(Which::kOstris) = m.attr("OstrisLinearLayerMemoryManager");
}

}  // namespace

PYBIND11_MODULE(manager_modules, m) {
  if (const std::string refused = vc_runtime::refusal(); !refused.empty()) throw py::import_error(refused);
  check_torch_version();
  route_log_to_python();
  // The settings are read and checked now: a bad value fails the import, not the first layer call minutes
  // into a run. pybind11 turns a C++ exception of the init into an ImportError with its message, the one line
  // of the refusal, which is then the last line of the traceback (a Python error would become the cause of
  // an ImportError "initialization failed", and that line is all a log's last line would show).
  Settings::refresh();
  m.doc() = "layerstream's drop-in replacement for AI-Toolkit's toolkit/memory_management/manager_modules.py";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OutOfDeviceMemory& e) {
      // torch.OutOfMemoryError (a RuntimeError), so that trainers' OOM handling sees it as one.
      py::object oom = torch_module().attr("OutOfMemoryError");
      PyErr_SetString(oom.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const c10::Error&) {
      // torch's own refusal (a layer call torch would refuse, run uncast): the type and message torch gives it.
      torch::translate_exception_to_python(p);
    }
  });

  bind_layer_managers(m);
  py::class_<DeviceStateHandle>(m, "DeviceState")
      .def_property_readonly("description", [](const DeviceStateHandle& h) { return h.state->describe(); })
      .def("stats", [](DeviceStateHandle& h) { return stats_dict(h.state->stats()); },
           "This device's counters: bytes moved, reuse, host memory, leases outstanding.")
      .def("__repr__", [](const DeviceStateHandle& h) { return "<layerstream DeviceState " + h.state->describe() + ">"; });

  m.attr("_DEVICE_STATE") = device_state_dict();
  HostShare::set_resolver(&resolve_share);
  install_cuda_memory_probe();
  m.def("sync_grad_transfers", [] {
    {
      auto states = DeviceState::live();
      py::gil_scoped_release nogil;
      for (const auto& s : states) s->sync_downloads();
    }
    log_step_telemetry();
  }, "Joins every pending device-to-host gradient copy (call before reading .grad or stepping).");
  bind_settings(m);
  bind_testing(m);
  bind_packed(m);
  m.def("stats", &stats, "Totals over every live device state: bytes moved, reuse, host memory.");
  m.def("live_device_states", [] { return DeviceState::live().size(); },
        "How many device states are alive (each holds streams, events and a ring).");
  m.attr("__torch_version__") = LAYERSTREAM_TORCH_BUILT_WITH;
}
