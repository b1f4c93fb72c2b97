// StreamedLayer's backward: upstream's gradient formulas for linear and conv2d on the fetched weights, and
// each weight or bias gradient's copy to the host on the engine's D2H stream (overlapping the rest of the
// backward pass where nothing reads it before the pass ends).
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "layerstream/check.h"
#include "streamed_layer_internal.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

using detail::as_dtype;
using detail::layout_of;

namespace {

using torch::autograd::Node;

// The edges into `node` in the current backward pass (autograd's dependency count, which it does not
// export), or -1 outside one. `running` is the node being evaluated: when it is the pass's root (the one
// output's grad_fn) it is not among the pass's recorded nodes, whose edges are counted once per pass.
// Not counted: edges of the placeholder root of a backward with several outputs, which lead into a
// leaf only when the leaf itself is one of those outputs.
int edges_into(const Node* node, Node* running) {
  const int task = torch::autograd::get_current_graph_task_id();
  const std::unordered_set<Node*>* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (task < 0 || nodes == nullptr) return -1;
  int from_root = 0;
  if (running != nullptr && nodes->count(running) == 0) {
    for (const auto& edge : running->next_edges()) from_root += edge.function.get() == node ? 1 : 0;
  }
  struct Counted {
    int task;
    std::unordered_map<const Node*, int> edges;
  };
  static std::mutex mu;
  // The last few passes: a reentrant checkpoint's inner passes run inside the outer one.
  static std::deque<Counted> recent;
  std::lock_guard<std::mutex> lock(mu);
  auto it = std::find_if(recent.begin(), recent.end(), [&](const Counted& c) { return c.task == task; });
  if (it == recent.end()) {
    Counted c{task, {}};
    // All alive while the pass runs: each is held by the edges that lead to it.
    for (const Node* n : *nodes) {
      for (const auto& edge : n->next_edges()) {
        if (edge.function) ++c.edges[edge.function.get()];
      }
    }
    recent.push_front(std::move(c));
    if (recent.size() > 4) recent.pop_back();
    it = recent.begin();
  }
  const auto found = it->edges.find(node);
  return from_root + (found == it->edges.end() ? 0 : found->second);
}

// Whether autograd, or code it calls, may read the gradient returned now for the Parameter `real` (saved
// for backward as `saved`: itself, or a detached alias under non-reentrant checkpointing) before the
// backward pass ends. Only the first and only contribution to a leaf's empty .grad, with nothing hooked,
// is not read: AccumulateGrad adopts it as .grad as it is. Everything else reads it as soon as it is
// returned: autograd's InputBuffer adds contributions that meet at a node (a layer called twice, tied
// weights), AccumulateGrad adds into a .grad that is there, tensor pre-hooks and post-accumulate-grad
// hooks (fused optimizer steps) see it, hooks on the accumulator (DDP's) read .grad, anomaly mode checks
// it, torch.autograd.grad (or backward(inputs=...)) captures it, post-hooks of the layer's own node see
// it. When in doubt, it may be read.
bool read_before_backward_ends(const at::Tensor& real, const at::Tensor& saved) {
  namespace impl = torch::autograd::impl;
  if (at::GradMode::is_enabled() || torch::autograd::AnomalyMode::is_enabled()) return true;
  if (!real.defined() || !real.requires_grad() || !real.is_leaf()) return true;
  const bool same = real.unsafeGetTensorImpl() == saved.unsafeGetTensorImpl() ||
                    (saved.has_storage() && real.has_storage() &&
                     real.storage().unsafeGetStorageImpl() == saved.storage().unsafeGetStorageImpl() &&
                     real.data_ptr() == saved.data_ptr() && real.sizes() == saved.sizes() &&
                     real.strides() == saved.strides());
  if (!same) return true;  // not the Parameter the layer holds now (replaced since the forward)
  if (real.grad().defined() || !impl::hooks(real).empty() || impl::post_acc_grad_hooks(real)) return true;
  const auto acc = impl::try_get_grad_accumulator(real);  // shared_ptr in torch 2.11, intrusive_ptr in 2.13
  if (!acc || !acc->pre_hooks().empty() || !acc->post_hooks().empty() || !acc->tensor_pre_hooks().empty() ||
      !acc->retains_grad_hooks().empty()) {
    return true;
  }
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info != nullptr && !exec_info->empty()) return true;
  // Our own node's post-hooks (a hook on the layer output's grad_fn) see what we return.
  const auto running = torch::autograd::get_current_node();
  if (!running || !running->post_hooks().empty()) return true;
  return edges_into(acc.get(), running.get()) != 1;
}

// A linear layer's bias gradient as upstream computes it (`g2`: grad_out folded to (-1, out_features)).
// Contiguous (or 2-D) inputs take linear's fused addmm path: the bias gradient is a sum over the flattened
// rows. Other inputs take matmul + add: a sum over every leading dimension.
at::Tensor linear_bias_grad(const at::Tensor& grad_out, const at::Tensor& g2, bool x_fused, std::int64_t out_features) {
  if (x_fused) return g2.sum({0}, /*keepdim=*/true).view({out_features});
  std::vector<std::int64_t> dims(grad_out.dim() - 1);
  for (std::size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<std::int64_t>(i);
  return grad_out.sum(dims, /*keepdim=*/true).view({out_features});
}

}  // namespace

at::Tensor StreamedLayer::grad_to_host(at::Tensor grad, const at::Tensor& param, bool is_bias) {
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
  // The Parameter itself, which the layer remembers (weakly): what autograd saved for backward may be a
  // detached alias (non-reentrant checkpointing), whose .grad and hooks are not the Parameter's.
  at::Tensor real;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Packed& packed = is_bias ? packed_.bias : packed_.weight;
    if (packed.impl) {
      if (auto impl = packed.impl->lock()) real = at::Tensor(std::move(impl));
    }
  }
  const bool read_early = read_before_backward_ends(real, param);
  if (read_early) {
    // Read as soon as we return: every pending copy must have landed.
    state_->sync_downloads();
  } else {
    // Otherwise the copy overlaps the rest of backward and is joined when backward ends, so that .grad
    // is whole when loss.backward() returns, also for trainers that never call sync_grad_transfers()
    // (AI-Toolkit 323b4aaf). One join per backward pass (graph task) and device is enough: it joins every
    // copy issued before it. Outside a graph task (-1) every call queues its own.
    const int task = torch::autograd::get_current_graph_task_id();
    if (task < 0 || state_->claim_end_of_backward_join(task)) {
      std::weak_ptr<DeviceState> weak = state_;
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto state = weak.lock()) state->sync_downloads();
      });
    }
  }
  // The simulator's race checker sees autograd's read: one not ordered after the copy is a race.
  if (read_early && state_->mode() == Mode::kSim) {
    state_->backend().annotate_host_access(staging.data_ptr(), staging.nbytes(), false);
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
  state_->note_backward_pass();  // the training step ends with this backward pass
  const bool need_x = needs[0], need_w = needs[1] && weight.defined(), need_b = needs[2] && bias.defined();
  if (!need_x && !need_w && !need_b) return {};
  const auto dtype = grad_out.scalar_type();
  at::Tensor gx, gw, gb;
  // create_graph (a gradient penalty): torch runs backward with grad mode on and differentiates the
  // formulas below, whose saved tensors must outlive this call: the weight is then the Parameter itself
  // where it takes a gradient (on the device: a differentiable copy), else a copy out of the ring (other
  // layers reuse the ring's memory); gradients go back differentiably instead of through the D2H staging.
  const bool higher_order = at::GradMode::is_enabled();
  const auto weight_for_formula = [&](const at::Tensor& ring_weight) {
    if (!higher_order) return ring_weight;
    if (weight.defined() && weight.requires_grad()) return weight.to(ring_weight.device());
    return ring_weight.clone();
  };
  const auto gradient_out = [&](const at::Tensor& g, const at::Tensor& param, bool is_bias) {
    return higher_order ? as_dtype(g, param.scalar_type()).to(param.device()) : grad_to_host(g, param, is_bias);
  };

  if (kind_ == LayerKind::kLinear) {
    // The formulas of upstream autograd for linear (addmm / matmul + add), so that results are
    // bitwise those of the all-resident layer.
    const std::int64_t out_features = weight_shape()[0];
    const at::Tensor g2 = grad_out.reshape({-1, out_features});
    if (need_x) {
      gx = with_device_weights([&](const at::Tensor& w, const at::Tensor&) {
        const at::Tensor wc = as_dtype(weight_for_formula(w), dtype);
        at::Tensor g = x_col_major ? wc.t().mm(g2.t()).t() : g2.mm(wc);
        return g.reshape(x_sizes);
      });
    }
    if (need_w) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});
      gw = gradient_out(g2.t().mm(as_dtype(x2, dtype)), weight, false);
    }
    if (need_b) gb = gradient_out(linear_bias_grad(grad_out, g2, x_fused, out_features), bias, true);
  } else {
    // convolution_backward is exactly what autograd runs for conv2d. An unbatched input (C, H, W) ran as
    // a batch of one (conv2d adds the batch dimension, and removes it from the output).
    const bool unbatched = x_sizes.size() == 3;
    const at::Tensor g4 = unbatched ? grad_out.unsqueeze(0) : grad_out;
    const at::Tensor x4 = unbatched ? x.unsqueeze(0) : x;
    auto grads = with_device_weights([&](const at::Tensor& w, const at::Tensor&) {
      const at::OptionalIntArrayRef bias_sizes =
          packed_.bias.defined ? at::OptionalIntArrayRef(packed_.bias.sizes) : at::OptionalIntArrayRef(c10::nullopt);
      return at::convolution_backward(g4, as_dtype(x4, dtype), as_dtype(weight_for_formula(w), dtype), bias_sizes,
                                      conv_.stride, conv_.padding, conv_.dilation, false, {0, 0},
                                      conv_.groups, {need_x, need_w, need_b});
    });
    gx = std::get<0>(grads);
    if (gx.defined() && unbatched) gx = gx.squeeze(0);
    if (need_w) gw = gradient_out(std::get<1>(grads), weight, false);
    if (need_b) gb = gradient_out(std::get<2>(grads), bias, true);
  }
  if (gx.defined() && x.defined() && gx.scalar_type() != x.scalar_type() && at::isFloatingType(x.scalar_type())) {
    gx = gx.to(x.scalar_type());
  }
  return {gx, gw, gb};
}

}  // namespace layerstream::torchglue
