#include "packed_weight_glue.h"

#include "layerstream/check.h"
#include "py_torch.h"

namespace layerstream::torchglue {

py::module_& packed_weight_module() {
  static py::module_* m = new py::module_(py::module_::import("layerstream.packed_weight"));  // lives as long as Python
  return *m;
}

bool is_packed_weight(const py::handle& obj) {
  static py::object* type = new py::object(packed_weight_module().attr("PackedWeight"));
  return !obj.is_none() && py::type::of(obj).is(*type);
}

std::optional<StreamedLayer::Refreshed> sync_packed_weight(const py::object& module, StreamedLayer& layer) {
  py::module_& pw = packed_weight_module();
  py::object w = param_of(module, "weight");
  if (is_packed_weight(w)) {
    bool keep = false;
    {
      const at::Tensor t = w.cast<at::Tensor>();
      keep = !t.requires_grad() && layer.holds_packed_parameter(t);
    }
    if (!keep || w.attr("_ls_packed").attr("writes").cast<std::int64_t>() != 0) {
      layer.forget_weight_parameter();  // packed again below, from the plain values
      pw.attr("unwrap")(w);
    }
  }
  std::optional<StreamedLayer::Refreshed> refreshed;
  {
    const at::Tensor t = w.cast<at::Tensor>();
    refreshed = layer.refresh(t, tensor_or_undefined(param_of(module, "bias")));
  }
  if (const auto bytes = layer.packed_weight_to_wrap()) {
    refreshed.reset();  // Python code runs below (wrap): the caller's forward checks again
    const std::vector<int> table(bytes->spec.exponent.begin(), bytes->spec.exponent.end());
    const py::tuple spec = py::make_tuple(bytes->spec.count, bytes->spec.exceptions, table);
    layer.forget_weight_parameter();
    pw.attr("wrap")(w, bytes->codes, spec, bytes->sizes);  // false: it keeps its plain values
    layer.adopt_weight_parameter(w.cast<at::Tensor>());
  }
  return refreshed;
}

at::Tensor lossless_unpack_from_python(const at::Tensor& codes, const py::tuple& spec_tuple,
                                       const std::vector<std::int64_t>& shape, unsigned max_blocks) {
  LosslessSpec spec;
  spec.count = spec_tuple[0].cast<std::size_t>();
  spec.exceptions = spec_tuple[1].cast<std::size_t>();
  const auto table = spec_tuple[2].cast<std::vector<int>>();
  LS_CHECK_ARG(table.size() == spec.exponent.size(), "lossless_unpack: a table of 16 exponents, not ", table.size());
  for (std::size_t k = 0; k < table.size(); ++k) {
    LS_CHECK_ARG(table[k] >= 0 && table[k] <= 255, "lossless_unpack: exponent ", table[k], " of the table");
    spec.exponent[k] = static_cast<std::uint8_t>(table[k]);
  }
  return lossless_unpack(codes, spec, shape, max_blocks);
}

void bind_packed(py::module_& m) {
  py::module_ p = m.def_submodule("_packed", "The native half of layerstream.packed_weight (not AI-Toolkit's surface).");
  p.def("unpack", &lossless_unpack_from_python, py::arg("codes"), py::arg("spec"), py::arg("shape"),
        py::arg("max_blocks") = 0u,
        "A PackedWeight's exact bfloat16 values of `shape`, decoded from its packed bytes (on their device).");
}

}  // namespace layerstream::torchglue
