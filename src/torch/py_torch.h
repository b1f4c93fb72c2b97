// Small pybind11 helpers the glue shares: the torch module, and fast reads of a layer's parameters.
// Every function here needs the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace layerstream::torchglue {

namespace py = pybind11;

// The `torch` Python module, imported once (it lives as long as the interpreter).
inline py::module_& torch_module() {
  static py::module_* t = new py::module_(py::module_::import("torch"));
  return *t;
}

inline at::Tensor tensor_or_undefined(const py::object& obj) {
  return obj.is_none() ? at::Tensor() : obj.cast<at::Tensor>();
}

// The layer's `name` Parameter (None when absent) read from its `_parameters` dict: nn.Module's
// __getattr__ is Python code, a dict lookup is not (about a microsecond less per read, on every call).
// Assigning a Parameter or None to the attribute goes into that dict, so it is the one to read; anything
// else (an attribute outside it) is read the slow way.
inline py::object param_of(const py::object& module, const char* name) {
  PyObject* dict = PyObject_GenericGetAttr(module.ptr(), py::str("__dict__").ptr());
  if (dict != nullptr) {
    py::object d = py::reinterpret_steal<py::object>(dict);
    PyObject* params = PyDict_GetItemString(d.ptr(), "_parameters");  // borrowed
    if (params != nullptr && PyDict_Check(params)) {
      if (PyObject* p = PyDict_GetItemString(params, name)) return py::reinterpret_borrow<py::object>(p);
    }
  } else {
    PyErr_Clear();
  }
  return py::getattr(module, name, py::none());
}

}  // namespace layerstream::torchglue
