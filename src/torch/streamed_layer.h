// StreamedLayer: one linear or conv2d layer whose weights live in the pinned arena and reach the device
// through the TransferEngine for each use, and the autograd functions that use it.
//
// Ownership: the layer shares its DeviceState and its arena block; the layer's `weight` and `bias`
// Parameters are views of that block (their storage holds the block too), so the host copy exists once.
// Streams: forward and backward compute on torch's current stream of the process device (CUDA), or on
// the host (sim); each fetched region is released on that stream right after the kernels that read it
// are enqueued. Gradients of trainable weights are copied to the host on the engine's D2H stream.
// Thread-safety: forward (Python thread) and backward (autograd threads) may overlap; a per-layer mutex
// guards packing and registration.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/custom_class.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "device_state.h"

namespace layerstream::torchglue {

enum class LayerKind { kLinear, kConv2d };

struct ConvParams {
  std::vector<std::int64_t> stride{1, 1};
  std::vector<std::int64_t> padding{0, 0};
  std::vector<std::int64_t> dilation{1, 1};
  std::int64_t groups = 1;
};

class StreamedLayer : public torch::CustomClassHolder {
 public:
  StreamedLayer(std::shared_ptr<DeviceState> state, LayerKind kind, ConvParams conv = {});
  ~StreamedLayer() override;

  // Moves `weight` (and `bias`, which may be undefined) into one arena block and makes the Parameters
  // views of it (Parameter identity is kept, so optimizers and references stay valid).
  void pack(const at::Tensor& weight, const at::Tensor& bias);
  // Called at every use: re-packs when the Parameters were replaced or their data swapped, and drops
  // the device copy when they were modified in place.
  void refresh(const at::Tensor& weight, const at::Tensor& bias);

  // The managed forward: weight and bias are the layer's current Parameters (autograd inputs).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

  // Used by the autograd functions.
  at::Tensor compute_forward(const at::Tensor& x);
  std::array<at::Tensor, 3> compute_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                             const std::vector<std::int64_t>& x_sizes, bool x_col_major,
                                             bool x_fused, const at::Tensor& weight, const at::Tensor& bias,
                                             std::array<bool, 3> needs);

  LayerKind kind() const { return kind_; }
  const std::shared_ptr<DeviceState>& state() const { return state_; }
  std::size_t packed_bytes() const;

 private:
  struct Packed {
    std::vector<std::int64_t> sizes;
    std::vector<std::int64_t> strides;  // layout_of() the Parameter (streamed_layer.cc)
    at::ScalarType dtype = at::kFloat;
    std::size_t offset = 0;
    std::size_t bytes = 0;
    const c10::TensorImpl* impl = nullptr;  // identity of the Parameter
    const void* data = nullptr;             // where its data must point
    std::uint32_t version = 0;
    bool defined = false;
  };

  // Runs `fn(weight_view, bias_view)` with the layer fetched onto the device and releases it after.
  template <typename Fn>
  auto with_device_weights(Fn&& fn);
  TransferEngine& registered_engine();
  // The engine this layer is registered in, or nullptr (not yet, or the engine was rebuilt since).
  TransferEngine* engine_if_registered();
  at::Tensor grad_to_host(at::Tensor grad, const at::Tensor& param);
  static bool matches(const Packed& p, const at::Tensor& t);

  std::shared_ptr<DeviceState> state_;
  LayerKind kind_;
  ConvParams conv_;
  std::mutex mu_;
  std::shared_ptr<HostBlockRef> block_;
  Packed weight_, bias_;
  std::uint64_t generation_ = 0;  // engine generation the layer is registered in
  LayerId id_ = 0;
};

}  // namespace layerstream::torchglue
