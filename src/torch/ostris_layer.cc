#include "ostris_layer.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace layerstream::torchglue {

// OstrisLinear: the quantized state is in `_buffers` (plus the bias). They are packed into one arena block
// at attach (the layer's buffers and bias become host views of it); each call fetches them onto the device
// through the engine (pinned, prefetched), swaps views of the ring region into the layer for its own forward
// (its quantizer), then puts the host views back; what the forward kept of them (autograd's saved tensors)
// is copied out of the region before it is released (StreamedLayer::with_staged_tensors).
//
// The layer's buffers (then the bias) in the packed order; nullopt when the layer's set of buffers or its
// bias is not the one packed (a buffer registered, dropped or renamed since: a re-quantization into another
// backend, a loaded checkpoint's extra state), so the caller packs again.
std::optional<std::vector<at::Tensor>> ostris_tensors(const py::object& module, const LayerManager& core) {
  std::vector<at::Tensor> out;
  py::dict buffers = module.attr("_buffers");
  for (auto item : buffers) {
    if (item.second.is_none()) continue;
    if (out.size() == core.buffer_names.size() || item.first.cast<std::string>() != core.buffer_names[out.size()]) {
      return std::nullopt;
    }
    out.push_back(item.second.cast<at::Tensor>());
  }
  if (out.size() != core.buffer_names.size()) return std::nullopt;
  py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
  if (bias.is_none() == core.ostris_bias) return std::nullopt;
  if (core.ostris_bias) out.push_back(bias.cast<at::Tensor>());
  return out;
}

void ostris_pack(const py::object& module, LayerManager& core) {
  py::dict buffers = module.attr("_buffers");
  core.buffer_names.clear();
  std::vector<at::Tensor> tensors;
  for (auto item : buffers) {
    if (item.second.is_none()) continue;
    core.buffer_names.push_back(item.first.cast<std::string>());
    tensors.push_back(item.second.cast<at::Tensor>());
  }
  py::object bias = py::dict(module.attr("_parameters")).attr("get")("bias");
  core.ostris_bias = !bias.is_none();
  if (core.ostris_bias) tensors.push_back(bias.cast<at::Tensor>());
  if (tensors.empty()) return;
  std::vector<at::Tensor> views = core.layer->pack_tensors(tensors);
  for (std::size_t i = 0; i < core.buffer_names.size(); ++i) buffers[core.buffer_names[i].c_str()] = py::cast(views[i]);
  if (core.ostris_bias) {
    // The bias stays the Parameter (LoRA and the optimizer hold it), its data set to its view.
    at::Tensor param = bias.cast<at::Tensor>();
    param.set_data(views.back());
    core.layer->adopt_tensor(views.size() - 1, param);
  }
  core.ostris_fast = recognise_ostris(module, core.buffer_names);
}

py::object ostris_forward(const py::object& module, LayerManager& core, const py::object& original,
                          const py::object& x, const std::shared_ptr<DeviceState>& state) {
  if (state->mode() == Mode::kCpu || core.layer->packed_bytes() == 0) return original(x);
  std::optional<std::vector<at::Tensor>> host = ostris_tensors(module, core);
  if (!host || !core.layer->tensors_current(*host)) {
    // Buffers replaced (a requantize, a load) or a different set of them: pack what the layer holds now.
    ostris_pack(module, core);
    host = ostris_tensors(module, core);
  }
#ifdef LAYERSTREAM_TORCH_CUDA
  // The layer's own forward runs with the process device current, as stock runs it: the quantizers' Triton
  // kernels launch on the current device (a model on cuda:1 while cuda:0 is current would launch there).
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state->mode() == Mode::kCuda) guard.emplace(state->device().index());
#endif
  py::dict buffers = module.attr("_buffers");
  py::object bias = core.ostris_bias ? py::object(py::dict(module.attr("_parameters"))["bias"]) : py::none();
  auto swap_in = [&](const std::vector<at::Tensor>& tensors) {
    for (std::size_t i = 0; i < core.buffer_names.size(); ++i) buffers[core.buffer_names[i].c_str()] = py::cast(tensors[i]);
    if (core.ostris_bias) at::Tensor(bias.cast<at::Tensor>()).set_data(tensors.back());
  };
  // The bias in `host` is the Parameter itself: swapping the staged copy in changes what it holds, so the
  // host data to put back is taken now, as a tensor of its own over the same (arena) storage.
  if (core.ostris_bias) host->back() = host->back().detach();
  py::object out;
  // The staged tensors are views of the ring region: the host views go back in before the region does
  // (with_staged_tensors then copies out whatever the forward kept of them).
  core.layer->with_staged_tensors([&](const std::vector<at::Tensor>& staged) {
    swap_in(staged);
    try {
      std::optional<py::object> decoded =
          ostris_fast_forward(module, core.ostris_fast, staged, bias, x, state->mode() == Mode::kCuda);
      if (decoded) state->note_dequant(DequantUse::kOstrisDecoded);
      out = decoded ? *std::move(decoded) : original(x);
    } catch (...) {
      swap_in(*host);
      throw;
    }
    swap_in(*host);
  });
  return out;
}

}  // namespace layerstream::torchglue
