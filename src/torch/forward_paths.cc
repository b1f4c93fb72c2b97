#include "forward_paths.h"

#include <ATen/core/grad_mode.h>

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "layer_kinds.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "module_tensors.h"
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
// nullopt: the weight is no longer one the path streams (the caller attaches the layer again).
std::optional<py::object> quantized_forward(const py::object& module, LayerManager& core, const py::object& x,
                                            bool conv, const std::shared_ptr<DeviceState>& state) {
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
    if (!streams_quantized(w)) return std::nullopt;
    pack_quantized(module, core);
  }
  // `bias` is the Parameter itself: a re-pack swaps its data, not its identity.
  return py::cast(core.layer->forward_frozen(x.cast<at::Tensor>(), bias));
}

// The streamed and cpu paths: the StreamedLayer's autograd function on the layer's weight and bias.
py::object streamed_forward(const py::object& module, StreamedLayer& layer, const py::object& weight_obj,
                            const py::object& x) {
  // sync_packed_weight refreshes the layer, and hands that back when no Python code ran after it: forward
  // then need not check again. From there to forward no Python code runs either (param_of reads the
  // _parameters dict; the casts unwrap tensors) and the GIL is held, so no other thread can replace or
  // write the Parameters in between. The Parameter object stays the same through sync_packed_weight (its
  // contents are swapped in place).
  std::optional<StreamedLayer::Refreshed> refreshed;
  if (layer.lossless_takes_weight() || is_packed_weight(weight_obj)) refreshed = sync_packed_weight(module, layer);
  const at::Tensor weight = weight_obj.cast<at::Tensor>();
  const at::Tensor bias = tensor_or_undefined(param_of(module, "bias"));
  return py::cast(layer.forward(x.cast<at::Tensor>(), weight, bias, refreshed));
}

// A weight that changed kind since its layer was attached (AI-Toolkit quantizes a text encoder after attaching
// it: torchao's quantize_ gives each Linear a new, quantized Parameter; a quantized layer may get a plain
// weight back): the layer is attached again, with the same manager object and forward, on the path its weight
// now takes. The StreamedLayer it had goes (a tensor still viewing its block keeps the block: tied weights).
void attach_again(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                  bool conv) {
  const std::string was = path_name(core);
  core.layer.reset();
  core.quant_weight = py::none();
  core.holder_attr.clear();
  core.codes_attr.clear();
  core.scale_attr.clear();
  const py::object weight = param_of(module, "weight");
  const std::string type = py::str(py::type::of(weight)).cast<std::string>();
  const std::string kind = describe_weight(weight);
  attach_weighted(module, core, state, conv);
  mark_params_managed(module);
  const std::string now = path_name(core);
  log_once("attach-again-" + was + "-" + now + "-" + type, LogLevel::kInfo,
           "a managed layer's weight changed kind after attach (now " + kind + "): layers whose weight becomes " +
               type + " leave the " + was + " path for the " + now + " path");
}

// The name of a module of the model manager.py attached (the root its MemoryManager holds) that shares this
// layer's weight Parameter and is not managed; None when there is none. Z-Image's text encoder (Qwen3 with tied
// embeddings): `lm_head`, a managed Linear, shares `embed_tokens.weight`, and manager.py moves the embedding
// whole, the shared Parameter with it.
py::object unmanaged_holder(const py::object& module, const py::object& mgr, const py::object& weight) {
  const py::object manager = py::getattr(mgr, "manager", py::none());
  const py::object root = manager.is_none() ? py::object(py::none()) : py::getattr(manager, "module", py::none());
  if (root.is_none() || !py::hasattr(root, "named_modules")) return py::none();
  for (auto item : root.attr("named_modules")()) {
    const py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
    const py::object other = pair[1];
    if (other.is(module) || py::hasattr(other, "_layer_memory_manager") || !py::hasattr(other, "_parameters")) continue;
    for (auto p : py::dict(other.attr("_parameters"))) {
      if (p.second.is(weight)) return pair[0];
    }
  }
  return py::none();
}

// A layer whose weight another, unmanaged module moved (its storage swapped since the packing): the layer leaves
// the weight where that module puts it and computes with it there, as the unmanaged model does (the generic
// path). Packing it again would put it back on the host under the other module, which the next move undoes.
void leave_to_holder(const py::object& module, LayerManager& core, const std::string& holder) {
  core.layer.reset();  // the block it packed goes with it: the Parameter no longer views it
  core.form = &stored_form("generic");
  const std::string layer_type = py::str(py::type::of(module).attr("__name__")).cast<std::string>();
  log_once("tied-unmanaged", LogLevel::kInfo,
           "a managed " + layer_type + "'s weight is also the weight of " + holder +
               ", a module manager.py moves whole: such layers compute with the shared weight where that module "
               "puts it (the generic path: not streamed, no host copy of their own)");
}

// What one call on a path came to: the layer's output; or AttachAgain, the weight is no longer of a kind the
// path takes (the layer is attached again, once); or CallAgain, the layer left for another path (core.form
// changed) that the call then takes.
struct AttachAgain {};
struct CallAgain {};
using PathCall = std::variant<py::object, AttachAgain, CallAgain>;

// What a call on a path is given: the installed forward's arguments.
struct CallArgs {
  const py::object& module;
  const py::object& mgr;
  LayerManager& core;
  const py::object& x;
  const std::shared_ptr<DeviceState>& state;
  bool conv;
};

PathCall call_module_tensors(const CallArgs& a) {
  return module_tensors_forward(a.module, a.core, a.mgr.attr("_original_forward"), a.x, a.state);
}

PathCall call_generic(const CallArgs& a) { return generic_forward(a.module, a.x, a.conv, a.state); }

PathCall call_quantized(const CallArgs& a) {
  if (std::optional<py::object> out = quantized_forward(a.module, a.core, a.x, a.conv, a.state)) return std::move(*out);
  return AttachAgain{};
}

PathCall call_streamed(const CallArgs& a) {
  const py::object weight_obj = param_of(a.module, "weight");
  if (!has_plain_type(weight_obj)) return AttachAgain{};
  if (is_packed_weight(weight_obj)) return streamed_forward(a.module, *a.core.layer, weight_obj, a.x);
  // Storage that moved since the last call is packed again by the forward, unless an unmanaged module holds
  // the weight.
  if (weight_obj.cast<at::Tensor>().data_ptr() != a.core.packed_data) {
    const py::object holder = unmanaged_holder(a.module, a.mgr, weight_obj);
    if (!holder.is_none()) {
      leave_to_holder(a.module, a.core, holder.cast<std::string>());
      return CallAgain{};
    }
  }
  py::object out = streamed_forward(a.module, *a.core.layer, weight_obj, a.x);
  if (!is_packed_weight(weight_obj)) a.core.packed_data = weight_obj.cast<at::Tensor>().data_ptr();
  return out;
}

void refuse_meta_weights(const py::object& module, const py::object& weight, const py::object& bias) {
  for (const py::object& t : {weight, bias}) {
    if (!t.is_none() && py::hasattr(t, "is_meta") && t.attr("is_meta").cast<bool>()) {
      const std::string name = py::str(module.attr("__class__").attr("__name__")).cast<std::string>() + "(" +
                               py::str(module.attr("extra_repr")()).cast<std::string>() + ")";
      throw py::value_error(
          "cannot manage " + name + ": its weights are on the meta device (shapes without data); load real weights into the model "
          "(load_state_dict(..., assign=True), or to_empty() then load) before MemoryManager.attach");
    }
  }
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

namespace {

// A plain weight (and bias) packed into the arena; LAYERSTREAM_HOST_DTYPE may store it compressed.
void attach_plain(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                  bool conv) {
  py::object weight = py::dict(module.attr("_parameters")).attr("get")("weight");
  py::object bias = py::getattr(module, "bias", py::none());
  core.layer = c10::make_intrusive<StreamedLayer>(state, conv ? LayerKind::kConv2d : LayerKind::kLinear,
                                                  conv ? conv_params_of(module) : ConvParams{});
  if (is_packed_weight(weight)) {
    // A PackedWeight (of a layer managed before): plain again, packed below as this layer's. One that
    // another live layer holds (tied weights) cannot be swapped; it stays as it is.
    try {
      packed_weight_module().attr("unwrap")(weight);
    } catch (const py::error_already_set&) {
    }
  }
  // A Parameter another managed layer already packed (tied weights): that layer's block keeps it.
  const bool tied = py::hasattr(weight, "_is_memory_managed");
  const at::Tensor values =
      is_packed_weight(weight) ? weight.attr("_ls_packed").attr("values")().cast<at::Tensor>() : at::Tensor();
  core.layer->pack(weight.cast<at::Tensor>(), tensor_or_undefined(bias), tied, values);
  if (take_staging_pin_failure()) {
    log_once("lossless-staging-unpinned", LogLevel::kWarning,
             "layerstream: page-locked host memory for a weight's copy from the GPU could not be allocated "
             "(a limit on locked memory?); lossless packing copies into pageable memory instead, which is "
             "slower at attach and the same afterwards");
  }
  if (core.layer->lossless_takes_weight()) sync_packed_weight(module, *core.layer);
  if (!is_packed_weight(weight)) core.packed_data = weight.cast<at::Tensor>().data_ptr();
}

// A library-quantized weight's codes and scale (and the bias) packed into the arena as stored.
void attach_quantized(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                      bool conv) {
  core.layer = c10::make_intrusive<StreamedLayer>(state, conv ? LayerKind::kConv2d : LayerKind::kLinear,
                                                  conv ? conv_params_of(module) : ConvParams{});
  pack_quantized(module, core);
}

// The tensors the module's own forward reads, packed as stored (module_tensors.h).
void attach_tensors(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state, bool) {
  attach_module_tensors(module, core, state);
}

// Nothing streamed: the weights go to the host, and each call moves them as stored.
void attach_generic(const py::object& module, LayerManager&, const std::shared_ptr<DeviceState>&, bool) {
  py::object weight = py::dict(module.attr("_parameters")).attr("get")("weight");
  const bool empty = weight.is_none() || weight.attr("numel")().cast<std::int64_t>() == 0;
  if (!empty && !is_plain(weight)) {
    const std::string kind = describe_weight(weight);
    log_once("generic-weight-" + kind, LogLevel::kInfo,
             "weights of type " + kind + " take the generic path (moved as stored and dequantized by their "
             "library at every call, no prefetch): not a layout layerstream streams natively (docs/ai-toolkit.md, "
             "Quantized weights)");
  }
  move_params_to_cpu(module);
}

// What the form's arena parts decide, one row each: what packs the layer at attach, and what runs its calls.
struct PartsPath {
  ArenaParts parts;
  void (*attach)(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                 bool conv);
  PathCall (*call)(const CallArgs& args);
};

constexpr PartsPath kPartsPaths[] = {
    {ArenaParts::kWeightBias, attach_plain, call_streamed},
    {ArenaParts::kCodesScaleBias, attach_quantized, call_quantized},
    {ArenaParts::kModuleTensors, attach_tensors, call_module_tensors},
    {ArenaParts::kNone, attach_generic, call_generic},
};

const PartsPath& parts_path(ArenaParts parts) {
  for (const PartsPath& row : kPartsPaths) {
    if (row.parts == parts) return row;
  }
  LS_FAIL("internal: no path for arena parts ", static_cast<int>(parts));
}

// One call of a managed layer on its path; a layer whose weight changed kind is attached again first.
py::object call_path(const py::object& module, const py::object& mgr, LayerManager& core, const py::object& x,
                     const std::shared_ptr<DeviceState>& state, bool conv) {
  for (int attempt = 0;; ++attempt) {
    // What a call does follows from what the stored form puts in the arena (none before attach: plain).
    const ArenaParts parts = core.form == nullptr ? ArenaParts::kWeightBias : core.form->parts;
    PathCall call = parts_path(parts).call(CallArgs{module, mgr, core, x, state, conv});
    if (py::object* out = std::get_if<py::object>(&call)) return std::move(*out);
    if (std::holds_alternative<CallAgain>(call)) continue;
    LS_CHECK(attempt == 0, "layerstream: a layer attached again for its weight's kind still finds it of another kind");
    attach_again(module, core, state, conv);
  }
}

}  // namespace

void attach_form(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state, bool conv,
                 const Recognised& recognised) {
  core.form = recognised.form;
  core.slots_of = recognised.slots_of;
  core.after_pack = recognised.after_pack;
  core.cpu_state = state->mode() == Mode::kCpu;
  parts_path(core.form->parts).attach(module, core, state, conv);
}

void attach_weighted(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state,
                     bool conv) {
  py::object weight = py::dict(module.attr("_parameters")).attr("get")("weight");
  refuse_meta_weights(module, weight, py::getattr(module, "bias", py::none()));
  attach_form(module, core, state, conv, recognise_weighted(module, conv));
}

void mark_params_managed(const py::object& module) {
  for (auto p : module.attr("parameters")(py::arg("recurse") = false)) {
    py::setattr(p, "_is_memory_managed", py::bool_(true));
  }
}

py::cpp_function make_forward(const py::object& module, const py::object& manager_obj,
                              std::shared_ptr<DeviceState> state, bool conv) {
  py::object weakref = py::module_::import("weakref").attr("ref");
  py::object module_ref = weakref(module);
  py::object manager_ref = weakref(manager_obj);
  return py::cpp_function([module_ref, manager_ref, state, conv](py::args args, py::kwargs kwargs) -> py::object {
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
    return call_path(module, mgr, mgr.cast<LayerManager&>(), args[0], state, conv);
  });
}

}  // namespace layerstream::torchglue
