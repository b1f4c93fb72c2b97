// What the engine tells Python: the counters of stats() (per device state, and summed over the live
// ones), the per-step INFO line (LAYERSTREAM_LOG_EVERY), and the route of the core's log messages to
// Python's `logging`. Every function here needs the GIL, except what the log sink does (it takes it).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "device_state.h"

namespace layerstream::torchglue {

namespace py = pybind11;

// One device state's counters, by their Python names.
py::dict stats_dict(const StateStats& s);
// Every counter summed over the live device states, plus how many there are and which, and the host
// memory held through the ranks' shared copy.
py::dict stats();
// Once every LAYERSTREAM_LOG_EVERY optimizer steps (default 100; 0: never), an INFO line with what the
// steps since the last one moved. Called once per optimizer step (from sync_grad_transfers).
void log_step_telemetry();
// Core messages go to Python's `logging` (logger "layerstream"), from any thread; during interpreter
// shutdown, to stderr.
void route_log_to_python();

}  // namespace layerstream::torchglue
