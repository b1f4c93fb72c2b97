#include "streamed_layer.h"

#include <c10/util/strides.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include "layerstream/check.h"
#include "layerstream/log.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

constexpr std::size_t kAlign = 256;
std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Weights compute in the input's dtype; integer or other inputs compute in bfloat16 (as upstream).
// float64 stays float64: upstream's float path computes F.linear(x, w) uncast, so a double layer gets
// a double result (casting it to bfloat16 would silently lose precision).
at::ScalarType compute_dtype(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return (t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble) ? t : at::kBFloat16;
}

// The strides a managed tensor keeps in the arena, on the device and in its gradient's staging: the
// Parameter's own when it is dense (channels_last convs, transposed linears: the kernels, and so the
// bits, then match the all-resident layer; autograd adopts a gradient in that layout as it is), else
// contiguous.
std::vector<std::int64_t> layout_of(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t.strides().vec();
  const auto dense = c10::contiguous_strides(t.sizes());
  return std::vector<std::int64_t>(dense.begin(), dense.end());
}

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return (!t.defined() || t.scalar_type() == dtype) ? t : t.to(dtype);
}

// Holds the layer for the autograd node (IValue capsules take CustomClassHolder pointers).
c10::intrusive_ptr<StreamedLayer> layer_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<StreamedLayer>(ctx->saved_data["layer"].toCapsule());
}

struct StreamedFn : public torch::autograd::Function<StreamedFn> {
  // `bias` is optional: an undefined Tensor would be taken for a variable input.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_opt, c10::intrusive_ptr<StreamedLayer> layer) {
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    at::Tensor out = layer->compute_forward(x);
    // Upstream autograd of linear saves the input only when the weight needs a gradient; convolution
    // always saves it (its backward needs it for the input gradient's shape and algorithm choice).
    const bool save_x = layer->kind() == LayerKind::kConv2d || weight.requires_grad();
    ctx->save_for_backward({save_x ? x : at::Tensor(), weight, bias});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_col_major"] =
        x.dim() == 2 && x.stride(0) == 1 && x.stride(1) == x.size(0) && x.size(0) > 1;
    // Which path upstream's linear took: the fused addmm one for 2-D or contiguous inputs.
    ctx->saved_data["x_fused"] = x.dim() == 2 || x.is_contiguous();
    ctx->saved_data["layer"] = c10::IValue::make_capsule(std::move(layer));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    // Without a bias there are only two input edges.
    const std::array<bool, 3> needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                    saved[2].defined() && ctx->needs_input_grad(2)};
    auto result = layer_of(ctx)->compute_backward(
        grads[0], saved[0], ctx->saved_data["x_sizes"].toIntVector(),
        ctx->saved_data["x_col_major"].toBool(), ctx->saved_data["x_fused"].toBool(), saved[1],
        saved[2], needs);
    return {result[0], result[1], result[2], at::Tensor()};
  }
};

}  // namespace

StreamedLayer::StreamedLayer(std::shared_ptr<DeviceState> state, LayerKind kind, ConvParams conv)
    : state_(std::move(state)), kind_(kind), conv_(std::move(conv)) {}

StreamedLayer::~StreamedLayer() {
  if (TransferEngine* engine = engine_if_registered()) {
    try {
      engine->remove_layer(id_);
    } catch (const std::exception& e) {
      log(LogLevel::kWarning, std::string("unregistering a layer failed: ") + e.what());
    }
  }
}

TransferEngine* StreamedLayer::engine_if_registered() {
  if (id_ == 0 || generation_ != state_->generation()) return nullptr;
  return state_->current_engine();
}

std::size_t StreamedLayer::packed_bytes() const { return block_ ? block_->block().bytes : 0; }

bool StreamedLayer::matches(const Packed& p, const at::Tensor& t) {
  if (!p.defined) return !t.defined();
  return t.defined() && t.unsafeGetTensorImpl() == p.impl && t.data_ptr() == p.data;
}

void StreamedLayer::pack(const at::Tensor& weight, const at::Tensor& bias) {
  LS_CHECK_ARG(weight.defined(), "a managed layer needs a weight");
  std::lock_guard<std::mutex> lock(mu_);
  Packed w, b;
  w.sizes = weight.sizes().vec();
  w.strides = layout_of(weight);
  w.dtype = weight.scalar_type();
  w.bytes = static_cast<std::size_t>(weight.numel()) * weight.element_size();
  w.defined = true;
  std::size_t total = w.bytes;
  if (bias.defined()) {
    b.sizes = bias.sizes().vec();
    b.strides = layout_of(bias);
    b.dtype = bias.scalar_type();
    b.bytes = static_cast<std::size_t>(bias.numel()) * bias.element_size();
    b.offset = align_up(w.bytes);
    b.defined = true;
    total = b.offset + b.bytes;
  }
  LS_CHECK_ARG(total > 0, "a managed layer needs a non-empty weight");

  auto block = std::make_shared<HostBlockRef>(state_->pool(), total);
  auto view_of = [&](const Packed& p, const at::Tensor& source) {
    // The view's storage owns a reference to the block: the host bytes live as long as any tensor
    // (or this layer) uses them.
    auto keep = block;
    at::Tensor view = at::from_blob(
        block->data() + p.offset, p.sizes, p.strides, [keep](void*) {},
        at::TensorOptions().dtype(p.dtype).device(at::kCPU));
    {
      at::NoGradGuard no_grad;
      view.copy_(source.detach());
    }
    return view;
  };
  at::Tensor w_view = view_of(w, weight);
  at::Tensor b_view = b.defined ? view_of(b, bias) : at::Tensor();

  // Swap the Parameters' data (identity kept), then remember what they must look like.
  at::Tensor(weight).set_data(w_view);
  if (b.defined) at::Tensor(bias).set_data(b_view);
  w.impl = weight.unsafeGetTensorImpl();
  w.data = weight.data_ptr();
  w.version = weight._version();
  if (b.defined) {
    b.impl = bias.unsafeGetTensorImpl();
    b.data = bias.data_ptr();
    b.version = bias._version();
  }

  // Leave the old registration (its host bytes stay valid until the engine has let go of them).
  if (TransferEngine* engine = engine_if_registered()) engine->remove_layer(id_);
  id_ = 0;
  generation_ = 0;
  block_ = std::move(block);
  weight_ = std::move(w);
  bias_ = std::move(b);
}

void StreamedLayer::refresh(const at::Tensor& weight, const at::Tensor& bias) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (matches(weight_, weight) && matches(bias_, bias)) {
      const bool w_same = weight._version() == weight_.version;
      const bool b_same = !bias_.defined || bias._version() == bias_.version;
      if (w_same && b_same) return;
      // Modified in place (an optimizer step on a trainable layer): the arena holds the new bytes
      // already; the device copy is stale.
      if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(id_);
      weight_.version = weight._version();
      if (bias_.defined) bias_.version = bias._version();
      return;
    }
  }
  pack(weight, bias);  // replaced, or data swapped: pack the new tensors
}

TransferEngine& StreamedLayer::registered_engine() {
  std::lock_guard<std::mutex> lock(mu_);
  TransferEngine& engine = state_->engine_for(block_->block().bytes);
  if (id_ == 0 || generation_ != state_->generation()) {
    id_ = engine.add_external_layer(block_->block());
    generation_ = state_->generation();
    state_->consider_residency(engine, id_, block_->block().bytes);
  }
  return engine;
}

template <typename Fn>
auto StreamedLayer::with_device_weights(Fn&& fn) {
  TransferEngine& engine = registered_engine();
  const StreamHandle consumer = state_->consumer_stream();
  const Lease lease = engine.fetch(id_);
  state_->note_use(id_);  // after the fetch holds this layer, so prefetches cannot displace it
  const bool on_host = state_->mode() == Mode::kSim;
  const at::Device where = on_host ? at::Device(at::kCPU) : state_->device();
  auto view = [&](const Packed& p) {
    if (!p.defined) return at::Tensor();
    return at::from_blob(static_cast<char*>(lease.data) + p.offset, p.sizes, p.strides,
                         at::TensorOptions().dtype(p.dtype).device(where));
  };
  try {  // from here on, every exit releases the lease
    if (on_host) {
      engine.wait_ready_host(lease);
      state_->backend().annotate_host_access(lease.data, lease.bytes, false);
    } else {
      engine.wait_ready(lease, consumer);
    }
    auto result = fn(view(weight_), view(bias_));
    engine.release(lease, consumer);  // after every kernel that reads the region was enqueued
    return result;
  } catch (...) {
    engine.release(lease, consumer);
    throw;
  }
}

at::Tensor StreamedLayer::forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  refresh(weight, bias);
  if (state_->mode() == Mode::kCpu) {
    // Upstream behaviour for a non-CUDA process device: compute on the CPU, return on x's device.
    const at::Tensor xc = x.to(at::kCPU);
    const auto dtype = compute_dtype(xc);
    at::Tensor out = kind_ == LayerKind::kLinear
                         ? at::linear(as_dtype(xc, dtype), as_dtype(weight, dtype), as_dtype(bias, dtype))
                         : at::conv2d(as_dtype(xc, dtype), as_dtype(weight, dtype), as_dtype(bias, dtype),
                                      conv_.stride, conv_.padding, conv_.dilation, conv_.groups);
    return out.to(x.device());
  }
  const std::optional<at::Tensor> bias_opt = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  return StreamedFn::apply(x, weight, bias_opt, c10::intrusive_ptr<StreamedLayer>::reclaim_copy(this));
}

at::Tensor StreamedLayer::compute_forward(const at::Tensor& x) {
#ifdef LAYERSTREAM_TORCH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state_->mode() == Mode::kCuda) guard.emplace(state_->device().index());
#endif
  const auto dtype = compute_dtype(x);
  const at::Tensor xc = as_dtype(x, dtype);
  return with_device_weights([&](const at::Tensor& w, const at::Tensor& b) {
    if (kind_ == LayerKind::kLinear) return at::linear(xc, as_dtype(w, dtype), as_dtype(b, dtype));
    return at::conv2d(xc, as_dtype(w, dtype), as_dtype(b, dtype), conv_.stride, conv_.padding,
                      conv_.dilation, conv_.groups);
  });
}

at::Tensor StreamedLayer::grad_to_host(at::Tensor grad, const at::Tensor& param) {
  // The bytes travel in the staging tensor's layout, which is the Parameter's own (layout_of): autograd
  // then adopts the staging tensor as .grad as it is (AccumulateGrad steals a gradient that obeys the
  // layout contract and that nobody else references) instead of cloning it, which would copy memory the
  // D2H copy has not filled yet.
  const std::vector<std::int64_t> layout = layout_of(param);
  grad = as_dtype(grad, param.scalar_type());
  if (grad.strides() != c10::IntArrayRef(layout)) {
    at::Tensor laid = at::empty_strided(param.sizes(), layout, grad.options());
    laid.copy_(grad);
    grad = laid;
  }
  TransferEngine& engine = registered_engine();
  const StreamHandle producer = state_->consumer_stream();
  at::Tensor staging = at::empty_strided(
      param.sizes(), layout,
      at::TensorOptions().dtype(param.scalar_type()).pinned_memory(state_->mode() == Mode::kCuda));
  engine.download(staging.data_ptr(), grad.data_ptr(), grad.nbytes(), producer);
#ifdef LAYERSTREAM_TORCH_CUDA
  if (state_->mode() == Mode::kCuda) {
    // The D2H stream reads `grad` after this function returns: tell the caching allocator.
    const auto d2h = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(engine.d2h_stream().raw),
                                                      state_->device().index());
    grad.record_stream(d2h);
  }
#endif
  if (state_->mode() == Mode::kSim) state_->keep_until_synced(grad.storage());
  // The copy writes into `staging` after this function returns, and autograd may drop the gradient
  // (zero_grad(set_to_none=True), a replaced Parameter) before the copy lands: its memory must not go
  // back to the allocator (and be handed out again) before then. The storage is kept, not the tensor: a
  // second reference to the tensor would make AccumulateGrad clone it (see above).
  state_->keep_until_synced(staging.storage());
  // With a gradient already there, autograd adds into it as soon as we return; with create_graph
  // (grad mode on in backward) it clones the new one: either way every pending copy must have landed.
  if (param.grad().defined() || at::GradMode::is_enabled()) {
    state_->sync_downloads();
  } else {
    // Otherwise the copy overlaps the rest of backward and is joined when backward ends, so that .grad
    // is whole when loss.backward() returns, also for trainers that never call sync_grad_transfers()
    // (AI-Toolkit 323b4aaf). Joining again costs nothing when nothing is pending.
    std::weak_ptr<DeviceState> weak = state_;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) state->sync_downloads();
    });
  }
  return staging;
}

std::array<at::Tensor, 3> StreamedLayer::compute_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                          const std::vector<std::int64_t>& x_sizes,
                                                          bool x_col_major, bool x_fused,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& bias, std::array<bool, 3> needs) {
#ifdef LAYERSTREAM_TORCH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state_->mode() == Mode::kCuda) guard.emplace(state_->device().index());
#endif
  const bool need_x = needs[0], need_w = needs[1] && weight.defined(), need_b = needs[2] && bias.defined();
  if (!need_x && !need_w && !need_b) return {};
  const auto dtype = grad_out.scalar_type();
  at::Tensor gx, gw, gb;

  if (kind_ == LayerKind::kLinear) {
    // The formulas of upstream autograd for linear (addmm / matmul + add), so that results are
    // bitwise those of the all-resident layer.
    const std::int64_t out_features = weight_.sizes[0];
    const at::Tensor g2 = grad_out.reshape({-1, out_features});
    if (need_x) {
      gx = with_device_weights([&](const at::Tensor& w, const at::Tensor&) {
        const at::Tensor wc = as_dtype(w, dtype);
        at::Tensor g = x_col_major ? wc.t().mm(g2.t()).t() : g2.mm(wc);
        return g.reshape(x_sizes);
      });
    }
    if (need_w) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});
      gw = grad_to_host(g2.t().mm(as_dtype(x2, dtype)), weight);
    }
    if (need_b) {
      // Contiguous (or 2-D) inputs take linear's fused addmm path: the bias gradient is a sum over the
      // flattened rows. Other inputs take matmul + add: a sum over every leading dimension.
      at::Tensor g;
      if (x_fused) {
        g = g2.sum({0}, /*keepdim=*/true).view({out_features});
      } else {
        std::vector<std::int64_t> dims(grad_out.dim() - 1);
        for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<std::int64_t>(i);
        g = grad_out.sum(dims, /*keepdim=*/true).view({out_features});
      }
      gb = grad_to_host(g, bias);
    }
  } else {
    // convolution_backward is exactly what autograd runs for conv2d.
    auto grads = with_device_weights([&](const at::Tensor& w, const at::Tensor&) {
      const at::OptionalIntArrayRef bias_sizes =
          bias_.defined ? at::OptionalIntArrayRef(bias_.sizes) : at::OptionalIntArrayRef(c10::nullopt);
      return at::convolution_backward(grad_out, as_dtype(x, dtype), as_dtype(w, dtype), bias_sizes,
                                      conv_.stride, conv_.padding, conv_.dilation, false, {0, 0},
                                      conv_.groups, {need_x, need_w, need_b});
    });
    gx = std::get<0>(grads);
    if (need_w) gw = grad_to_host(std::get<1>(grads), weight);
    if (need_b) gb = grad_to_host(std::get<2>(grads), bias);
  }
  if (gx.defined() && x.defined() && gx.scalar_type() != x.scalar_type() && at::isFloatingType(x.scalar_type())) {
    gx = gx.to(x.scalar_type());
  }
  return {gx, gw, gb};
}

}  // namespace layerstream::torchglue
