// The parts of manager_modules bound outside module.cc (the AI-Toolkit surface).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace layerstream::torchglue {

// settings() and configure() (settings_binding.cc).
void bind_settings(pybind11::module_& m);
// The `_testing` submodule: hooks for tests and benchmarks, kept out of the drop-in's namespace
// (testing_hooks.cc).
void bind_testing(pybind11::module_& m);
// manager_modules._packed (packed_weight_glue.h).
void bind_packed(pybind11::module_& m);

}  // namespace layerstream::torchglue
