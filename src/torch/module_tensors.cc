#include "module_tensors.h"

#include <map>
#include <string>

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace layerstream::torchglue {

namespace {

// The packed tensors as the module holds them now, in block order; nullopt when the module's slots are not
// the packed ones (a buffer registered, dropped or renamed since: a re-quantization into another backend, a
// loaded checkpoint's extra state; a bias added or removed), so the caller packs again.
std::optional<std::vector<at::Tensor>> current_tensors(const py::object& module, const LayerManager& core) {
  if (core.slots_of(module) != core.slots) return std::nullopt;
  std::vector<at::Tensor> out;
  for (const TensorSlot& slot : core.slots) {
    const py::object t = read_slot(module, slot);
    if (t.is_none()) return std::nullopt;
    out.push_back(t.cast<at::Tensor>());
  }
  return out;
}

void set_attribute(py::object obj, const std::string& dotted, const py::object& value) {
  const std::size_t dot = dotted.rfind('.');
  if (dot != std::string::npos) {
    for (std::size_t start = 0; start < dot;) {
      const std::size_t next = std::min(dotted.find('.', start), dot);
      obj = obj.attr(dotted.substr(start, next - start).c_str());
      start = next + 1;
    }
  }
  py::setattr(obj, dotted.substr(dot == std::string::npos ? 0 : dot + 1).c_str(), value);
}

// Puts `tensors` (the host views, or a call's staged tensors) into the module's slots. A Parameter's data is
// set (the object stays). For attribute slots with `shadow`, each owner gets a shallow copy holding the
// tensors (and copies of the objects between it and them), put in the owner's place: the host objects are
// not written, and whatever the call keeps of the copies keeps the staged tensors. Without `shadow`, the
// host owners are put back (`owners`, as they were before the call) and written as they are.
void write_slots(const py::object& module, const std::vector<TensorSlot>& slots, const std::vector<at::Tensor>& tensors,
                 std::map<std::string, py::object>& owners, bool shadow) {
  static const py::object* copy = new py::object(py::module_::import("copy").attr("copy"));
  std::map<std::string, py::object> copies;  // owner path (and owner path + intermediate) -> its copy
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const TensorSlot& slot = slots[i];
    switch (slot.kind) {
      case TensorSlot::Kind::kBuffer: py::dict(module.attr("_buffers"))[slot.name.c_str()] = py::cast(tensors[i]); break;
      case TensorSlot::Kind::kParameterData: read_slot(module, slot).cast<at::Tensor>().set_data(tensors[i]); break;
      case TensorSlot::Kind::kFrozenParameter: {
        py::dict params = module.attr("_parameters");
        if (!owners.count(slot.name)) owners[slot.name] = params[slot.name.c_str()];
        const py::object host = owners[slot.name];
        if (shadow) {
          py::object call = py::type::of(host).attr("_make_subclass")(py::type::of(host), py::cast(tensors[i]), false);
          call.attr("__dict__").attr("update")(host.attr("__dict__"));
          params[slot.name.c_str()] = call;
        } else {
          params[slot.name.c_str()] = host;
          host.cast<at::Tensor>().set_data(tensors[i]);
        }
        break;
      }
      case TensorSlot::Kind::kAttribute: {
        if (!owners.count(slot.owner)) owners[slot.owner] = read_slot(module, {TensorSlot::Kind::kParameterData, "", slot.owner});
        py::object target = owners[slot.owner];
        if (shadow) {
          if (!copies.count(slot.owner)) {
            copies[slot.owner] = (*copy)(target);
            set_attribute(module, slot.owner, copies[slot.owner]);
          }
          target = copies[slot.owner];
          std::string path = slot.owner;
          for (std::size_t start = 0, dot; (dot = slot.name.find('.', start)) != std::string::npos; start = dot + 1) {
            const std::string part = slot.name.substr(start, dot - start);
            path += "." + part;
            if (!copies.count(path)) {
              copies[path] = (*copy)(target.attr(part.c_str()));
              py::setattr(target, part.c_str(), copies[path]);
            }
            target = copies[path];
          }
          py::setattr(target, slot.name.substr(slot.name.rfind('.') + 1).c_str(), py::cast(tensors[i]));
        } else {
          set_attribute(module, slot.owner, target);
          set_attribute(target, slot.name, py::cast(tensors[i]));
        }
        break;
      }
    }
  }
}

void pack(const py::object& module, LayerManager& core) {
  core.slots = core.slots_of(module);
  std::vector<at::Tensor> tensors;
  for (const TensorSlot& slot : core.slots) tensors.push_back(read_slot(module, slot).cast<at::Tensor>());
  if (tensors.empty()) return;
  const std::vector<at::Tensor> views = core.layer->pack_tensors(tensors);
  std::map<std::string, py::object> owners;
  write_slots(module, core.slots, views, owners, false);
  for (std::size_t i = 0; i < core.slots.size(); ++i) {
    // A Parameter stays itself (LoRA and the optimizer hold it), its data set to its view.
    const TensorSlot::Kind kind = core.slots[i].kind;
    if (kind == TensorSlot::Kind::kParameterData || kind == TensorSlot::Kind::kFrozenParameter) {
      core.layer->adopt_tensor(i, read_slot(module, core.slots[i]).cast<at::Tensor>());
    }
  }
  if (core.after_pack != nullptr) core.after_pack(module, core);
}

}  // namespace

void attach_module_tensors(const py::object& module, LayerManager& core, const std::shared_ptr<DeviceState>& state) {
  std::vector<at::Tensor> host;
  const std::vector<TensorSlot> slots = core.slots_of(module);
  for (const TensorSlot& slot : slots) {
    py::object t = read_slot(module, slot);
    if (slot.kind == TensorSlot::Kind::kParameterData || slot.kind == TensorSlot::Kind::kFrozenParameter) {
      t = t.attr("data");  // the values, not a copy of the Parameter
    }
    host.push_back(t.attr("to")("cpu").cast<at::Tensor>());
  }
  std::map<std::string, py::object> owners;
  write_slots(module, slots, host, owners, false);
  core.layer = c10::make_intrusive<StreamedLayer>(state, LayerKind::kLinear);
  pack(module, core);
}

py::object module_tensors_forward(const py::object& module, LayerManager& core, const py::object& original,
                                  const py::object& x, const std::shared_ptr<DeviceState>& state) {
  if (state->mode() == Mode::kCpu || core.layer->packed_bytes() == 0) return original(x);
  std::optional<std::vector<at::Tensor>> host = current_tensors(module, core);
  if (!host || !core.layer->tensors_current(*host)) {
    // Tensors replaced (a requantize, a load) or a different set of them: pack what the layer holds now.
    pack(module, core);
    host = current_tensors(module, core);
  }
#ifdef LAYERSTREAM_TORCH_CUDA
  // The layer's own forward runs with the process device current, as stock runs it: the quantizers' Triton
  // kernels launch on the current device (a model on cuda:1 while cuda:0 is current would launch there).
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state->mode() == Mode::kCuda) guard.emplace(state->device().index());
#endif
  // A Parameter slot in `host` is the Parameter itself: swapping the staged copy in changes what it holds, so
  // the host data to put back is taken now, as a tensor of its own over the same (arena) storage.
  for (std::size_t i = 0; i < core.slots.size(); ++i) {
    const TensorSlot::Kind kind = core.slots[i].kind;
    if (kind == TensorSlot::Kind::kParameterData || kind == TensorSlot::Kind::kFrozenParameter) {
      (*host)[i] = (*host)[i].detach();
    }
  }
  const py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
  std::map<std::string, py::object> owners;  // the host objects of attribute slots, put back after the call
  py::object out;
  // The staged tensors are views of the ring region: the host views go back in before the region does
  // (with_staged_tensors then copies out whatever the forward kept of them).
  core.layer->with_staged_tensors([&](const std::vector<at::Tensor>& staged) {
    write_slots(module, core.slots, staged, owners, true);
    try {
      std::optional<py::object> decoded =
          ostris_fast_forward(module, core.ostris_fast, staged, bias, x, state->mode() == Mode::kCuda);
      if (decoded) state->note_dequant(DequantUse::kOstrisDecoded);
      out = decoded ? *std::move(decoded) : original(x);
    } catch (...) {
      write_slots(module, core.slots, *host, owners, false);
      throw;
    }
    write_slots(module, core.slots, *host, owners, false);
  });
  return out;
}

}  // namespace layerstream::torchglue
