#include "forward_paths.h"

#include <ATen/core/grad_mode.h>

#include <optional>
#include <string>

#include "layer_kinds.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "ostris_layer.h"
#include "packed_weight_glue.h"
#include "py_torch.h"

namespace layerstream::torchglue {

namespace {

// Weight on the compute device in a form F.linear/F.conv2d accept (generic path).
py::object materialize(const py::object& w, const py::object& device, const py::object& dtype) {
  if (w.is_none()) return w;
  py::object moved = w.attr("to")(device, py::arg("non_blocking") = true);
  if (needs_dequantize(w)) {
    moved = py::hasattr(moved, "dequantize") ? moved.attr("dequantize")() : moved.attr("to")(dtype);
    if (!py::object(moved.attr("dtype")).is(dtype)) moved = moved.attr("to")(dtype);
  }
  return moved;
}

py::object compute_dtype_of(const py::object& x) {
  py::object dt = x.attr("dtype");
  py::module_& t = torch_module();
  for (const char* name : {"float32", "float16", "bfloat16"}) {
    if (dt.is(py::object(t.attr(name)))) return dt;
  }
  return t.attr("bfloat16");
}

py::object generic_forward(const py::object& module, const py::object& x, bool conv,
                           const std::shared_ptr<DeviceState>& state) {
  const bool on_cpu = state->mode() != Mode::kCuda;
  py::object device = on_cpu ? torch_module().attr("device")("cpu") : py::cast(state->device());
  py::object xin = on_cpu ? x.attr("to")("cpu") : x;
  py::object dtype = compute_dtype_of(xin);
  py::object w = materialize(module.attr("weight"), device, dtype);
  py::object b = materialize(py::getattr(module, "bias", py::none()), device, dtype);
  py::object out;
  if (conv) {
    out = module.attr("_conv_forward")(xin, w, b);
  } else {
    out = torch_module().attr("nn").attr("functional").attr("linear")(xin, w, b);
  }
  return on_cpu ? out.attr("to")(x.attr("device")) : out;
}

// Per call on the quantized path: a weight that takes a gradient goes through the library (generic
// path: its autograd is right); a replaced weight, swapped codes or a replaced bias are packed again.
py::object quantized_forward(const py::object& module, LayerManager& core, const py::object& x, bool conv,
                             const std::shared_ptr<DeviceState>& state) {
  py::object w = param_of(module, "weight");
  if (at::GradMode::is_enabled() && w.cast<at::Tensor>().requires_grad()) {
    log_once("quantized-trainable", LogLevel::kInfo,
             "a quantized weight that requires grad runs through its library's own dequantize (no fast path); "
             "freeze the base model (requires_grad_(False)) to stream it as stored");
    return generic_forward(module, x, conv, state);
  }
  const at::Tensor bias = tensor_or_undefined(param_of(module, "bias"));
  bool current = w.is(core.quant_weight);
  if (current) {
    const py::object holder = core.holder_attr.empty() ? w : py::getattr(w, core.holder_attr.c_str(), py::none());
    current = py::hasattr(holder, core.codes_attr.c_str()) &&
              core.layer->is_current(holder.attr(core.codes_attr.c_str()).cast<at::Tensor>(), bias);
  }
  if (!current) {
    if (!streams_quantized(w)) {
      throw py::value_error("layerstream: this layer's weight was replaced by one it cannot stream (" +
                            py::str(py::type::of(w)).cast<std::string>() +
                            "); detach the layer (MemoryManager.detach) before replacing its weight with another kind");
    }
    pack_quantized(module, core);
  }
  // `bias` is the Parameter itself: a re-pack swaps its data, not its identity.
  return py::cast(core.layer->forward_frozen(x.cast<at::Tensor>(), bias));
}

}  // namespace

void move_params_to_cpu(const py::object& module) {
  py::dict params = module.attr("_parameters");
  for (const char* name : {"weight", "bias"}) {
    if (!params.contains(name) || params[name].is_none()) continue;
    py::object p = params[name];
    if (p.attr("device").attr("type").cast<std::string>() == "cpu") continue;
    py::object moved = p.attr("detach")().attr("to")("cpu");
    py::object param = torch_module().attr("nn").attr("Parameter")(moved, py::arg("requires_grad") = p.attr("requires_grad"));
    py::setattr(module, name, param);
  }
}

void pack_quantized(const py::object& module, LayerManager& core) {
  move_params_to_cpu(module);
  py::object w = module.attr("weight");
  std::optional<QuantSource> q = quant_source_of(w);
  LS_CHECK(q.has_value(), "the quantized weight of this layer changed to a kind layerstream does not stream natively");
  const at::Tensor bias = tensor_or_undefined(py::getattr(module, "bias", py::none()));
  const bool frozen = !w.cast<at::Tensor>().requires_grad();
  auto views = core.layer->pack_quantized(q->codes, q->scale, q->math, q->result, bias, frozen);
  py::setattr(q->holder, q->codes_attr.c_str(), py::cast(views[0]));
  py::setattr(q->holder, q->scale_attr.c_str(), py::cast(views[1].view(q->scale_sizes)));
  core.quant_weight = w;
  core.holder_attr = q->holder_attr;
  core.codes_attr = q->codes_attr;
  core.scale_attr = q->scale_attr;
}

py::cpp_function make_forward(const py::object& module, const py::object& manager_obj,
                              c10::intrusive_ptr<StreamedLayer> layer, std::shared_ptr<DeviceState> state,
                              ForwardPath path, bool conv) {
  py::object weakref = py::module_::import("weakref").attr("ref");
  py::object module_ref = weakref(module);
  py::object manager_ref = weakref(manager_obj);
  return py::cpp_function([module_ref, manager_ref, layer, state, path, conv](py::args args, py::kwargs kwargs) -> py::object {
    py::object mgr = manager_ref();
    py::object module = module_ref();
    if (mgr.is_none() || module.is_none()) {
      throw std::runtime_error("layerstream: this forward belongs to a layer that was detached or freed; "
                               "attach it again with MemoryManager.attach");
    }
    if (args.size() != 1 || kwargs.size() != 0) {
      // Upstream contract: any extra argument goes to the original forward unchanged.
      return mgr.attr("_original_forward")(*args, **kwargs);
    }
    py::object x = args[0];
    switch (path) {
      case ForwardPath::kOstris:
        return ostris_forward(module, mgr.cast<LayerManager&>(), mgr.attr("_original_forward"), x, state);
      case ForwardPath::kGeneric:
        return generic_forward(module, x, conv, state);
      case ForwardPath::kQuantized:
        return quantized_forward(module, mgr.cast<LayerManager&>(), x, conv, state);
      case ForwardPath::kStreamed:
      case ForwardPath::kCpu:
      case ForwardPath::kUnset:
        break;
    }
    // The Parameter object stays the same through sync_packed_weight (its contents are swapped in place).
    const py::object weight_obj = param_of(module, "weight");
    // sync_packed_weight refreshes the layer, and hands that back when no Python code ran after it: forward
    // then need not check again. From there to forward no Python code runs either (param_of reads the
    // _parameters dict; the casts unwrap tensors) and the GIL is held, so no other thread can replace or
    // write the Parameters in between.
    std::optional<StreamedLayer::Refreshed> refreshed;
    if (layer->lossless_takes_weight() || is_packed_weight(weight_obj)) refreshed = sync_packed_weight(module, *layer);
    const at::Tensor weight = weight_obj.cast<at::Tensor>();
    const at::Tensor bias = tensor_or_undefined(param_of(module, "bias"));
    return py::cast(layer->forward(x.cast<at::Tensor>(), weight, bias, refreshed));
  });
}

}  // namespace layerstream::torchglue
