// What the files of StreamedLayer share (streamed_layer*.cc include it; nothing else does): the layout and
// view helpers, and the two member templates that fetch the layer's block for a use.
//   streamed_layer.cc           the arena block, host memory counts, registration, whether the layer is current
//   streamed_layer_pack.cc      packing: the stored form of a weight chosen and built, Parameters swapped
//   streamed_layer_codecs.cc    dequantization and lossless decoding (host reference, CUDA kernels, scratch)
//   streamed_layer_forward.cc   the forward autograd function and the forward compute paths
//   streamed_layer_backward.cc  the backward formulas and the gradients' way back to the host
#pragma once

#include <ATen/ATen.h>
#include <c10/util/strides.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "streamed_layer.h"

namespace layerstream::torchglue {

namespace detail {

// Parts of a block start on this boundary.
constexpr std::size_t kAlign = 256;
inline std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A tensor subclass implemented in Python (a PackedWeight): it has no storage to look at.
inline bool is_python_tensor(const at::Tensor& t) { return t.defined() && t.key_set().has(c10::DispatchKey::Python); }

// The strides a managed tensor keeps in the arena, on the device and in its gradient's staging: the
// Parameter's own when it is dense (channels_last convs, transposed linears: the kernels, and so the
// bits, then match the all-resident layer; autograd adopts a gradient in that layout as it is), else
// contiguous.
inline std::vector<std::int64_t> contiguous_layout(const at::Tensor& t) {
  const auto dense = c10::contiguous_strides(t.sizes());
  return std::vector<std::int64_t>(dense.begin(), dense.end());
}

inline std::vector<std::int64_t> layout_of(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t.strides().vec() : contiguous_layout(t);
}

inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return (!t.defined() || t.scalar_type() == dtype) ? t : t.to(dtype);
}

// What a layer of `bytes` with `scratch` bytes of scratch takes in the ring (the engine's default alignment,
// which the device state's engines use).
inline std::size_t device_bytes(std::size_t bytes, std::size_t scratch) {
  return scratch_offset(bytes, scratch, EngineOptions{}.arena.alignment) + scratch;
}

// A view of one packed tensor at `base` (host or device memory); `keep` runs when the view's storage goes.
inline at::Tensor view_of(char* base, const StreamedLayer::Packed& p, at::Device where,
                          std::function<void(void*)> keep = [](void*) {}) {
  if (!p.defined) return at::Tensor();
  return at::from_blob(base + p.offset, p.sizes, p.strides, std::move(keep),
                       at::TensorOptions().dtype(p.dtype).device(where));
}

}  // namespace detail

template <typename Fn>
auto StreamedLayer::with_region(Fn&& fn) {
  TransferEngine& engine = registered_engine();
  const StreamHandle consumer = state_->consumer_stream();
  const bool fresh = fresh_each_use_.load(std::memory_order_relaxed);
  // A trainable weight may have been written through .data since its device copy was made (see
  // fresh_each_use_): drop that copy (resident or in the ring), so that the fetch copies the host bytes.
  if (fresh) engine.begin_host_write(registered_.id);
  const Lease lease = engine.fetch(registered_.id);
  const bool on_host = state_->mode() == Mode::kSim;
  const at::Device where = on_host ? at::Device(at::kCPU) : state_->device();
  // A view of one packed tensor in the fetched region.
  auto view = [&](const Packed& p) { return detail::view_of(static_cast<char*>(lease.data), p, where); };
  try {  // from here on, every exit releases the lease
    state_->note_use(registered_.id, fresh);  // after the fetch holds this layer, so prefetches cannot displace it
    if (on_host) {
      engine.wait_ready_host(lease);
      state_->backend().annotate_host_access(lease.data, lease.bytes, false);
    } else {
      engine.wait_ready(lease, consumer);
    }
    auto result = fn(view, on_host, lease, consumer);
    engine.release(lease, consumer);  // after every kernel that reads the region was enqueued
    return result;
  } catch (...) {
    engine.release(lease, consumer);
    throw;
  }
}

template <typename Fn>
auto StreamedLayer::with_device_weights(Fn&& fn) {
  return with_region([&](const auto& view, bool on_host, const Lease& lease, StreamHandle consumer) {
    at::Tensor w = view(packed_.weight);
    if (packed_.quant && lease.extra != nullptr) {
      w = dequantize_in_scratch(w, view(packed_.quant->scale), lease, on_host ? at::Device(at::kCPU) : state_->device(),
                                consumer);
    } else if (packed_.quant) {
      state_->note_dequant(DequantUse::kOwnMemory);
      w = dequantize(w, view(packed_.quant->scale), !on_host);
    }
    return fn(w, view(packed_.bias));
  });
}

}  // namespace layerstream::torchglue
