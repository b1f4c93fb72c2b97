// StreamedLayer's forward: the autograd function (the one node a managed layer adds to the graph; its
// backward is in streamed_layer_backward.cc), the paths a call takes (CPU process device, no graph,
// graph) and the forward compute on the fetched weights.
#include <ATen/TensorUtils.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cstring>
#include <functional>
#include <optional>

#include "layerstream/check.h"
#include "streamed_layer_internal.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

using detail::view_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Weights compute in the input's floating dtype. float64 stays float64: upstream's float path computes
// F.linear(x, w) uncast, so a double layer gets a double result. Any other input (integer, bool, complex,
// float8) is refused by torch's own linear and conv and by upstream's (which casts only the weight of a
// quantized layer, never the input): nullopt, and the call runs uncast so that torch's error is the answer
// (a cast would compute a complex input without its imaginary part).
std::optional<at::ScalarType> compute_dtype(const at::Tensor& x) {
  const auto t = x.scalar_type();
  if (t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble) return t;
  return std::nullopt;
}

at::Tensor as_dtype(const at::Tensor& t, const std::optional<at::ScalarType>& dtype) {
  return dtype ? detail::as_dtype(t, *dtype) : t;
}

// Holds the layer for the autograd node (IValue capsules take CustomClassHolder pointers).
c10::intrusive_ptr<StreamedLayer> layer_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<StreamedLayer>(ctx->saved_data["layer"].toCapsule());
}

// Which formula upstream's backward of mm takes for a linear layer's input gradient
// (mm_mat1_backward): the column-major one when the 2-D matrix that linear multiplied has strides
// (1, rows). That matrix is x itself (2-D), x.unsqueeze(0) (1-D) or x folded to (-1, in) (a view when
// x allows one, else a contiguous copy). Only a matrix of one row and one column is both; its input
// gradient is then summed over the outputs in another order (seen: 1 ulp in float32).
bool linear_input_col_major(const at::Tensor& x) {
  if (x.dim() == 0 || x.numel() == 0) return false;
  const std::int64_t in = x.size(-1);
  const std::int64_t rows = x.numel() / in;
  std::array<std::int64_t, 2> strides{};
  if (x.dim() == 1) {
    strides = {x.size(0) * x.stride(0), x.stride(0)};  // unsqueeze(0)
  } else if (x.dim() == 2) {
    strides = {x.stride(0), x.stride(1)};
  } else if (const auto folded = at::detail::computeStride(x.sizes(), x.strides(), at::IntArrayRef{rows, in})) {
    strides = {(*folded)[0], (*folded)[1]};
  } else {
    strides = {in, 1};  // reshape copies
  }
  return strides[0] == 1 && strides[1] == rows;
}

struct StreamedFn : public torch::autograd::Function<StreamedFn> {
  // `bias` is optional: an undefined Tensor would be taken for a variable input.
  // `weight` is absent for quantized layers (their weight takes no gradient).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& weight_opt,
                            const std::optional<at::Tensor>& bias_opt, c10::intrusive_ptr<StreamedLayer> layer) {
    const at::Tensor weight = weight_opt.has_value() ? *weight_opt : at::Tensor();
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    at::Tensor out = layer->compute_forward(x);
    // Upstream autograd of linear saves the input only when the weight needs a gradient; convolution
    // always saves it (its backward needs it for the input gradient's shape and algorithm choice).
    const bool save_x = layer->kind() == LayerKind::kConv2d || (weight.defined() && weight.requires_grad());
    // A frozen weight is not saved: backward reads the layer's packed copy, and a saved reference would
    // keep a PackedWeight Parameter from being swapped back to plain (unfrozen or written) while the graph
    // lives. Whether there is one decides how needs_input_grad counts the inputs.
    const bool save_w = weight.defined() && weight.requires_grad();
    ctx->save_for_backward({save_x ? x : at::Tensor(), save_w ? weight : at::Tensor(), bias});
    ctx->saved_data["has_w"] = weight.defined();
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_col_major"] = layer->kind() == LayerKind::kLinear && linear_input_col_major(x);
    // Which path upstream's linear took: the fused addmm one for 2-D or contiguous inputs.
    ctx->saved_data["x_fused"] = x.dim() == 2 || x.is_contiguous();
    ctx->saved_data["packing"] = static_cast<std::int64_t>(layer->packing());
    ctx->saved_data["layer"] = c10::IValue::make_capsule(std::move(layer));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    // An absent weight or bias (nullopt) is not an autograd input: needs_input_grad counts only the
    // inputs that are there.
    const bool has_w = ctx->saved_data["has_w"].toBool(), has_b = saved[2].defined();
    const std::array<bool, 3> needs{ctx->needs_input_grad(0), has_w && ctx->needs_input_grad(1),
                                    has_b && ctx->needs_input_grad(has_w ? 2 : 1)};
    const c10::intrusive_ptr<StreamedLayer> layer = layer_of(ctx);
    // Upstream's backward uses the weight its forward saved; this one reads the layer's packed copy, which
    // a replaced Parameter (a new object, or new data) has changed since.
    LS_CHECK_ARG(static_cast<std::int64_t>(layer->packing()) == ctx->saved_data["packing"].toInt(),
                 "layerstream: a managed layer's weight or bias was replaced (a new Parameter, or its .data "
                 "assigned) after a forward and before that forward's backward; its backward would compute with "
                 "the new weight instead of the one the forward used. Run backward (or drop the graph) before "
                 "replacing the weight");
    auto result = layer->compute_backward(
        grads[0], saved[0], ctx->saved_data["x_sizes"].toIntVector(),
        ctx->saved_data["x_col_major"].toBool(), ctx->saved_data["x_fused"].toBool(), saved[1],
        saved[2], needs);
    return {result[0], result[1], result[2], at::Tensor()};
  }
};

}  // namespace

at::Tensor StreamedLayer::forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                  std::optional<Refreshed> refreshed) {
  if (!refreshed || !refreshed->of(this)) refresh(weight, bias);
  return run(x, weight, bias);
}

at::Tensor StreamedLayer::forward_frozen(const at::Tensor& x, const at::Tensor& bias) {
  fresh_each_use_.store(bias.defined() && bias.requires_grad(), std::memory_order_relaxed);
  return run(x, at::Tensor(), bias);
}

at::Tensor StreamedLayer::run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (state_->mode() == Mode::kCpu) {
    at::Tensor w = weight;
    if (packed_.quant) {
      std::lock_guard<std::mutex> lock(mu_);
      char* base = block_.ref->data();
      w = dequantize(view_of(base, packed_.weight, at::kCPU), view_of(base, packed_.quant->scale, at::kCPU), false);
    }
    return compute_on_host(x, w, bias);
  }
  // Nothing to differentiate (no_grad, or nothing requires grad): no autograd node to build.
  const bool graph = at::GradMode::is_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                                                    (bias.defined() && bias.requires_grad()));
  if (!graph) return compute_forward(x);
  const GradForwardScope training(true);  // StreamedFn's forward runs with grad mode off
  const auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return StreamedFn::apply(x, optional(weight), optional(bias), c10::intrusive_ptr<StreamedLayer>::reclaim_copy(this));
}

at::Tensor StreamedLayer::compute_on_host(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const {
  // Upstream behaviour for a non-CUDA process device: compute on the CPU, return on x's device.
  const at::Tensor xc = x.to(at::kCPU);
  const auto dtype = compute_dtype(xc);
  at::Tensor out = kind_ == LayerKind::kLinear
                       ? at::linear(as_dtype(xc, dtype), as_dtype(w, dtype), as_dtype(b, dtype))
                       : at::conv2d(as_dtype(xc, dtype), as_dtype(w, dtype), as_dtype(b, dtype), conv_.stride,
                                    conv_.padding, conv_.dilation, conv_.groups);
  return out.to(x.device());
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

namespace {

// Whether anything besides `staged` holds `t` or its storage (the view's storage is its own: from_blob).
bool escaped(const at::Tensor& t) {
  return t.use_count() > 1 || t.storage().use_count() > 1;
}

// Moves the bytes of `t`'s storage into memory of torch's allocator (a copy on the current stream, or
// memcpy on the host), so that every tensor sharing that storage keeps its values after the region goes.
void own_storage(const at::Tensor& t, bool on_host) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const std::size_t bytes = impl->nbytes();
  const at::TensorOptions bytes_on = at::TensorOptions().dtype(at::kByte).device(t.device());
  at::Tensor fresh = at::empty({static_cast<std::int64_t>(bytes)}, bytes_on);
  if (bytes > 0) {
    if (on_host) {
      std::memcpy(fresh.data_ptr(), impl->data(), bytes);
    } else {
      fresh.copy_(at::from_blob(impl->mutable_data(), {static_cast<std::int64_t>(bytes)}, bytes_on));
    }
  }
  // The fresh tensor's memory goes to the staged storage; the fresh tensor keeps an empty one.
  impl->set_data_ptr_noswap(fresh.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, t.device())));
}

// A tensor of its own over `t`'s storage (same offset, sizes, strides and version counter; not a view of `t`,
// which would hold `t`), or `t` undefined: what `fn` is handed of a staged tensor. Whatever keeps one holds the
// storage, which settle looks at, and `staged` itself stays private: handing it out would not do, since once
// torch has made a Python object for a tensor, that object may hold it for as long as the tensor lives, which
// would make every staged tensor look kept. The shared version counter makes a write in place through `fn`'s
// tensor visible on the staged one.
at::Tensor over_storage(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor own = at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  own.unsafeGetTensorImpl()->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return own;
}

}  // namespace

void StreamedLayer::with_staged_tensors(const std::function<void(const std::vector<at::Tensor>&)>& fn) {
#ifdef LAYERSTREAM_TORCH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state_->mode() == Mode::kCuda) guard.emplace(state_->device().index());
#endif
  bool written = false;
  with_region([&](const auto& view, bool on_host, const Lease&, StreamHandle) {
    std::vector<at::Tensor> staged;
    staged.reserve(packed_.tensors.size());
    for (const Packed& p : packed_.tensors) staged.push_back(view(p));
    // Before the region goes back, on every exit: what outlives the call gets its own copy.
    auto settle = [&] {
      for (const at::Tensor& t : staged) {
        if (!t.defined()) continue;
        written = written || t._version() != 0;
        if (escaped(t)) {
          state_->note_ostris_kept(t.storage().nbytes());
          own_storage(t, on_host);
        }
      }
    };
    // `fn`'s tensors of their own over the staged storages, dropped before settle on every exit.
    auto call = [&] {
      std::vector<at::Tensor> shown;
      shown.reserve(staged.size());
      for (const at::Tensor& t : staged) shown.push_back(over_storage(t));
      fn(shown);
    };
    try {
      call();
    } catch (...) {
      settle();
      throw;
    }
    settle();
    return 0;
  });
  // Written in place by the layer's forward: the region's (or the resident) copy is not the host's any more.
  if (written) {
    if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(registered_.id);
  }
}

}  // namespace layerstream::torchglue
