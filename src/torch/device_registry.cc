#include "device_registry.h"

#include <string>

#include "layerstream/log.h"
#include "py_torch.h"
#include "layerstream/settings.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace layerstream::torchglue {

py::dict& device_state_dict() {
  static py::dict* d = nullptr;
  if (d == nullptr) d = new py::dict();  // lives as long as the interpreter (module attribute too)
  return *d;
}

std::shared_ptr<DeviceState> state_for(const py::object& device_obj) {
  py::object key = torch_module().attr("device")(device_obj);
  py::dict& states = device_state_dict();
  if (states.contains(key)) {
    py::object entry = states[key];
    if (py::isinstance<DeviceStateHandle>(entry)) return entry.cast<DeviceStateHandle&>().state;
  }
  at::Device device = key.cast<at::Device>();
  // A new device state reads the environment again (tests change it between states); a bad value fails here.
  Settings::refresh();
  Mode mode;
  if (device.is_cuda()) {
#ifdef LAYERSTREAM_TORCH_CUDA
    if (!device.has_index()) device.set_index(c10::cuda::current_device());
    const int count = static_cast<int>(c10::cuda::device_count());
    if (device.index() >= count) {
      throw py::value_error("the process device is " + device.str() + ", but this process sees " +
                            std::to_string(count) + " CUDA device(s)" +
                            (count > 0 ? " (cuda:0 to cuda:" + std::to_string(count - 1) + ")" : "") +
                            "; pass an existing device (check CUDA_VISIBLE_DEVICES)");
    }
    mode = Mode::kCuda;
#else
    throw py::value_error("layerstream was built against a torch without CUDA, but the process device is " +
                          device.str() + "; rebuild layerstream in the environment that has the CUDA torch");
#endif
  } else {
    mode = Settings::current()->backend == CpuBackend::kSim ? Mode::kSim : Mode::kCpu;
  }
  auto state = DeviceState::create(device, mode);
  states[key] = py::cast(DeviceStateHandle{state});
  log_once("engine-" + state->describe(), LogLevel::kInfo,
           "layerstream manager_modules active on " + state->describe());
  return state;
}

}  // namespace layerstream::torchglue
