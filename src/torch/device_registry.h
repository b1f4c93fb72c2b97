// The process's device states, by device: manager_modules._DEVICE_STATE, the dict AI-Toolkit's module
// keeps under that name (a torch.device to a DeviceState handle). A state is made at the first attach on
// its device and lives while the dict holds it (tests clear the dict to start afresh). Needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "device_state.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// What _DEVICE_STATE's values are (Python class DeviceState).
struct DeviceStateHandle {
  std::shared_ptr<DeviceState> state;
};

// The dict itself (lives as long as the interpreter; also the module attribute _DEVICE_STATE).
py::dict& device_state_dict();

// The state of `device_obj` (anything torch.device accepts), made on first use: a new state reads the
// settings again; a CUDA device this process does not see, or CUDA in a build without it, is a ValueError.
std::shared_ptr<DeviceState> state_for(const py::object& device_obj);

}  // namespace layerstream::torchglue
