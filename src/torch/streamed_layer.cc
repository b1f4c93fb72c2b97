#include "streamed_layer.h"

#include <ATen/TensorUtils.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <unordered_map>
#include <unordered_set>

#include "layerstream/check.h"
#include "layerstream/dequant.h"
#include "host_share.h"
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

// host_memory_counts(): process-wide totals, changed only by BlockAccount and StreamedLayer::pageable_.
std::atomic<std::int64_t> g_pinned_packed{0}, g_pinned_plain{0}, g_pageable{0};

// One arena block's bytes in host_memory_counts(), for as long as anything holds the block (the layer, or
// the storage of a view of it: a Parameter, a PackedWeight's packed bytes). Shared segments are not
// counted (host_shared_bytes has them).
struct BlockAccount {
  BlockAccount(std::shared_ptr<HostBlockRef> b, std::size_t packed) : block(std::move(b)) {
    if (block->segment() != nullptr) return;
    const auto total = static_cast<std::int64_t>(block->block().bytes);
    const auto pk = std::min<std::int64_t>(total, static_cast<std::int64_t>(packed));
    if (block->block().pinned) {
      packed_bytes = pk;
      plain_bytes = total - pk;
    } else {
      pageable_bytes = total;
    }
    g_pinned_packed += packed_bytes;
    g_pinned_plain += plain_bytes;
    g_pageable += pageable_bytes;
  }
  ~BlockAccount() {
    g_pinned_packed -= packed_bytes;
    g_pinned_plain -= plain_bytes;
    g_pageable -= pageable_bytes;
  }
  BlockAccount(const BlockAccount&) = delete;
  BlockAccount& operator=(const BlockAccount&) = delete;
  std::shared_ptr<HostBlockRef> block;
  std::int64_t packed_bytes = 0, plain_bytes = 0, pageable_bytes = 0;
};

// A tensor subclass implemented in Python (a PackedWeight): it has no storage to look at.
bool is_python_tensor(const at::Tensor& t) {
  return t.defined() && t.key_set().has(c10::DispatchKey::Python);
}

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
std::vector<std::int64_t> contiguous_layout(const at::Tensor& t) {
  const auto dense = c10::contiguous_strides(t.sizes());
  return std::vector<std::int64_t>(dense.begin(), dense.end());
}

std::vector<std::int64_t> layout_of(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t.strides().vec() : contiguous_layout(t);
}

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return (!t.defined() || t.scalar_type() == dtype) ? t : t.to(dtype);
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

StreamedLayer::StreamedLayer(std::shared_ptr<DeviceState> state, LayerKind kind, ConvParams conv)
    : state_(std::move(state)), kind_(kind), conv_(std::move(conv)) {}

StreamedLayer::~StreamedLayer() {
  g_pageable -= pageable_;
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
  if (p.wrapped || is_python_tensor(t)) {  // a PackedWeight: the object itself, nothing to look inside
    return p.wrapped && t.defined() && p.impl && t.unsafeGetTensorImpl() == p.impl->_unsafe_get_target();
  }
  const c10::StorageImpl* storage = t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  return t.defined() && p.impl && t.unsafeGetTensorImpl() == p.impl->_unsafe_get_target() &&
         storage == (p.storage ? p.storage->_unsafe_get_target() : nullptr) && t.data_ptr() == p.data;
}

namespace {

// LAYERSTREAM_HOST_DTYPE: how frozen floating-point weights are kept in the arena (and cross the bus).
struct HostStorage {
  std::optional<at::ScalarType> float8;  // 8-bit codes with a float32 scale per output channel (lossy)
  bool lossless = false;                  // bfloat16 weights packed exactly (lossless.h)
  bool any() const { return float8.has_value() || lossless; }
};

HostStorage host_storage_setting() {
  HostStorage h;
  const HostDtype d = Settings::current()->host_dtype;
  if (d == HostDtype::kFloat8E4M3) h.float8 = at::kFloat8_e4m3fn;
  if (d == HostDtype::kFloat8E5M2) h.float8 = at::kFloat8_e5m2;
  h.lossless = d == HostDtype::kLossless;
  return h;
}

std::optional<CodeType> code_type_of(at::ScalarType t) {
  if (t == at::kFloat8_e4m3fn) return CodeType::kFloat8E4M3;
  if (t == at::kFloat8_e5m2) return CodeType::kFloat8E5M2;
  if (t == at::kChar) return CodeType::kInt8;
  return std::nullopt;
}

std::optional<RealType> real_type_of(at::ScalarType t) {
  if (t == at::kFloat) return RealType::kFloat32;
  if (t == at::kHalf) return RealType::kFloat16;
  if (t == at::kBFloat16) return RealType::kBFloat16;
  return std::nullopt;
}

// One scale per output row (shape [out, 1, ...]) or one scale for the tensor.
bool per_row_or_single(c10::IntArrayRef scale_sizes, c10::IntArrayRef codes_sizes) {
  std::int64_t numel = 1;
  for (auto d : scale_sizes) numel *= d;
  if (numel == 1) return true;
  if (scale_sizes.size() != codes_sizes.size() || scale_sizes[0] != codes_sizes[0]) return false;
  return numel == codes_sizes[0];
}

double float8_max(at::ScalarType t) { return t == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

// What a layer of `bytes` with `scratch` bytes of scratch takes in the ring (the engine's default alignment,
// which the device state's engines use).
std::size_t device_bytes(std::size_t bytes, std::size_t scratch) {
  return scratch_offset(bytes, scratch, EngineOptions{}.arena.alignment) + scratch;
}

// A view of one packed tensor at `base` (host or device memory); `keep` runs when the view's storage goes.
at::Tensor view_of(char* base, const StreamedLayer::Packed& p, at::Device where,
                   std::function<void(void*)> keep = [](void*) {}) {
  if (!p.defined) return at::Tensor();
  return at::from_blob(base + p.offset, p.sizes, p.strides, std::move(keep),
                       at::TensorOptions().dtype(p.dtype).device(where));
}

}  // namespace

bool is_real_dtype(at::ScalarType t) { return real_type_of(t).has_value(); }

bool quantized_layout_supported(const at::Tensor& codes, const at::Tensor& scale) {
  return code_type_of(codes.scalar_type()).has_value() && is_real_dtype(scale.scalar_type()) &&
         codes.numel() > 0 && per_row_or_single(scale.sizes(), codes.sizes());
}

namespace {
std::mutex g_pack_times_mu;
LosslessPackTimes g_pack_times;  // guarded by g_pack_times_mu
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

LosslessPackTimes lossless_pack_times() {
  std::lock_guard<std::mutex> lock(g_pack_times_mu);
  return g_pack_times;
}

HostMemoryCounts host_memory_counts() {
  HostMemoryCounts c;
  c.pinned_packed = g_pinned_packed.load();
  c.pinned_plain = g_pinned_plain.load();
  c.pageable = g_pageable.load();
  return c;
}

std::shared_ptr<HostBlockRef> StreamedLayer::new_block(const std::vector<std::pair<Packed*, at::Tensor>>& parts,
                                                       std::vector<at::Tensor>& views, bool shareable,
                                                       std::size_t packed, const std::function<void(char*)>& encode) {
  std::size_t total = 0;
  for (const auto& [p, src] : parts) {
    p->offset = align_up(total);
    total = p->offset + p->bytes;
  }
  LS_CHECK_ARG(total > 0, "a managed layer needs a non-empty weight");
  auto fill = [&](char* base) {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& [p, src] = parts[i];
      if (i == 0 && encode) {
        encode(base + p->offset);
      } else {
        view_of(base, *p, at::kCPU).copy_(src.detach());
      }
    }
  };

  std::shared_ptr<HostBlockRef> block;
  HostShare* share = shareable ? HostShare::get() : nullptr;
  std::unique_ptr<SharedHostSegment> segment = share ? share->next(state_->backend(), total) : nullptr;
  if (segment && segment->data() != nullptr) {
    // The leader fills the host's copy; the other ranks find it filled (they waited for it).
    const bool leader = segment->leader();
    if (leader) {
      fill(static_cast<char*>(segment->data()));
      segment->mark_ready();
    }
    block = std::make_shared<HostBlockRef>(state_->pool(), std::move(segment));
    if (!block->block().pinned) {
      log_once("share-unpinned", LogLevel::kWarning,
               "the shared host copy could not be pinned (read-only registration refused): its copies go "
               "through pinned bounce buffers, which is slower; LAYERSTREAM_SHARE_HOST=0 gives each rank a "
               "pinned copy of its own");
    }
    if (!leader) {
      // The shared copy must be what this rank would have packed: a rank that loaded other weights
      // would otherwise train on rank 0's without a word.
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const auto& [p, src] = parts[i];
        at::Tensor mine = at::empty_strided(p->sizes, p->strides, at::TensorOptions().dtype(p->dtype));
        if (i == 0 && encode) {
          encode(static_cast<char*>(mine.data_ptr()));
        } else {
          mine.copy_(src.detach());
        }
        LS_CHECK(std::memcmp(mine.data_ptr(), block->data() + p->offset, p->bytes) == 0,
                 "this rank's weights differ from the host copy that local rank 0 packed (a tensor of shape ",
                 at::IntArrayRef(p->sizes), "): every rank must load the same model; LAYERSTREAM_SHARE_HOST=0 "
                 "gives each rank a copy of its own");
      }
    }
  } else {
    if (segment) {
      log_once("share-refused", LogLevel::kWarning,
               "the host refused shared memory for the weights (is /dev/shm large enough? docker: --shm-size); "
               "each rank keeps a copy of its own");
    }
    block = std::make_shared<HostBlockRef>(state_->pool(), total);
    fill(block->data());
  }
  views.clear();
  auto account = std::make_shared<BlockAccount>(block, packed);
  for (const auto& [p, src] : parts) {
    // The view's storage owns a reference to the block (through its account): the host bytes live as long
    // as any tensor (or this layer) uses them.
    auto keep = account;
    views.push_back(view_of(block->data(), *p, at::kCPU, [keep](void*) {}));
  }
  new_account_ = std::move(account);
  return block;
}

void StreamedLayer::install(std::shared_ptr<HostBlockRef> block, Packed w, Packed b, std::optional<QuantParts> q) {
  if (TransferEngine* engine = engine_if_registered()) engine->remove_layer(id_);
  id_ = 0;
  generation_ = 0;
  block_ = std::move(block);
  block_account_ = std::move(new_account_);
  weight_ = std::move(w);
  bias_ = std::move(b);
  quant_ = std::move(q);
  packing_.fetch_add(1, std::memory_order_relaxed);
  scratch_ = scratch_bytes_locked();  // once per packing, not per call
  // The first ring is sized for the largest layer, its scratch included.
  state_->note_attached(device_bytes(block_->block().bytes, scratch_));
}

namespace {

using Packed = StreamedLayer::Packed;

Packed describe(const at::Tensor& t, std::vector<std::int64_t> strides, at::ScalarType dtype) {
  Packed p;
  p.sizes = t.sizes().vec();
  p.strides = std::move(strides);
  p.dtype = dtype;
  p.bytes = static_cast<std::size_t>(t.numel()) * c10::elementSize(dtype);
  p.defined = true;
  return p;
}

// Inference tensors (made under torch.inference_mode) have no version counter, by which a managed layer
// sees its weights modified in place; assigning .data outside inference_mode does not give them one.
void check_not_inference(const at::Tensor& t, const char* what) {
  LS_CHECK_ARG(!t.defined() || t.unsafeGetTensorImpl()->version_counter().enabled(),
               "layerstream cannot manage a layer whose ", what,
               " was created under torch.inference_mode() (an inference tensor has no version counter, so changes "
               "to it could not be seen): create or load the model outside inference_mode (torch.no_grad() is "
               "enough), or replace each such Parameter outside inference_mode before MemoryManager.attach: "
               "setattr(module, name, torch.nn.Parameter(p.clone(), p.requires_grad))");
}

void remember_identity(Packed& p, const at::Tensor& t) {
  p.impl.emplace(t.getIntrusivePtr());
  p.storage.reset();
  p.wrapped = is_python_tensor(t);
  p.data = nullptr;
  if (!p.wrapped) {
    if (t.has_storage()) p.storage.emplace(t.storage().getWeakStorageImpl());
    p.data = t.data_ptr();
  }
  p.version = t._version();
}

}  // namespace

void StreamedLayer::pack(const at::Tensor& weight, const at::Tensor& bias, bool tied, const at::Tensor& given) {
  LS_CHECK_ARG(weight.defined(), "a managed layer needs a weight");
  check_not_inference(weight, "weight");
  check_not_inference(bias, "bias");
  // A PackedWeight (another layer's, tied) is packed from its exact values, decoded by the caller for this
  // packing only; the Parameter keeps its identity.
  LS_CHECK_ARG(!is_python_tensor(weight) || given.defined(),
               "layerstream: this layer's weight is a PackedWeight (LAYERSTREAM_HOST_DTYPE=lossless) that another "
               "managed layer holds and that was written or unfrozen; give this layer a plain Parameter of its own: "
               "layer.weight = torch.nn.Parameter(layer.weight.clone(), requires_grad=...)");
  const at::Tensor values = is_python_tensor(weight) ? given : weight;
  const HostStorage host = host_storage_setting();
  const bool decoder = host.lossless && lossless_decoder_here();  // may log: before the lock
  std::lock_guard<std::mutex> lock(mu_);
  const auto wt = weight.scalar_type();
  const bool frozen = !weight.requires_grad();
  // The weights each setting takes, frozen now or not (one frozen later is compressed at its next use).
  const bool float8_takes =
      host.float8.has_value() && weight.numel() > 0 && (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat);
  // Lossless: bfloat16 in the standard layout (the decoded weight is contiguous: another layout would
  // compute with other kernels than the plain path), within the encoding's 32-bit indices, where a
  // decoder runs. Others are stored as they are.
  const bool lossless_takes = host.lossless && weight.numel() > 0 && wt == at::kBFloat16 && weight.is_contiguous() &&
                              static_cast<std::size_t>(weight.numel()) <= kLosslessMaxCount && decoder;
  // A weight whose exponents spread too widely (8 bytes per exception) packs no smaller: stored as it is.
  // The table first (one pass over the values); the encoder then writes straight into the arena block.
  at::Tensor exact;
  std::optional<LosslessSpec> spec;
  LosslessPackTimes times;
  if (lossless_takes && frozen) {
    auto t0 = std::chrono::steady_clock::now();
    exact = values.detach().to(at::kCPU).contiguous();
    times.copy_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    spec = lossless_plan(static_cast<const std::uint16_t*>(exact.data_ptr()), static_cast<std::size_t>(exact.numel()));
    times.table_s = seconds_since(t0);
    if (spec->bytes() >= exact.nbytes()) spec.reset();
  }
  const bool to_lossless = spec.has_value();
  const bool to_float8 = float8_takes && frozen;
  const bool compress = to_float8 || to_lossless;
  Packed w, b;
  std::optional<QuantParts> q;
  std::vector<std::pair<Packed*, at::Tensor>> parts;
  at::Tensor codes, scale;
  std::function<void(char*)> encode;
  if (to_lossless) {
    // Frozen bfloat16 weight packed exactly (lossless.h), encoded straight into the block; the caller
    // (module.cc) then makes the Parameter a PackedWeight of those bytes.
    w.sizes = {static_cast<std::int64_t>(spec->bytes())};
    w.strides = {1};
    w.dtype = at::kByte;
    w.bytes = spec->bytes();
    w.defined = true;
    q.emplace();
    q->math = wt;
    q->result = wt;
    q->compressed = true;
    q->lossless = *spec;
    q->sizes = weight.sizes().vec();
    parts = {{&w, exact}};
    encode = [&exact, s = *spec](char* dst) {
      lossless_encode(s, static_cast<const std::uint16_t*>(exact.data_ptr()), dst);
    };
  } else if (to_float8) {
    const at::ScalarType f8 = *host.float8;
    // Frozen weight kept as 8-bit codes with a float32 scale per output channel (amax / largest code);
    // the Parameter keeps its exact values in ordinary (pageable) host memory, outside the arena.
    const at::Tensor wf = values.detach().to(at::kCPU).to(at::kFloat);
    std::vector<std::int64_t> rest;
    for (std::int64_t d = 1; d < wf.dim(); ++d) rest.push_back(d);
    at::Tensor amax = rest.empty() ? wf.abs() : wf.abs().amax(rest, /*keepdim=*/true);
    scale = amax / float8_max(f8);
    scale.masked_fill_(scale == 0, 1.0);
    codes = (wf / scale).clamp(-float8_max(f8), float8_max(f8)).to(f8);
    w = describe(codes, codes.strides().vec(), f8);
    q.emplace();
    q->scale = describe(scale, scale.strides().vec(), at::kFloat);
    q->math = at::kFloat;
    q->result = wt;
    q->compressed = true;
    parts = {{&w, codes}, {&q->scale, scale}};
  } else {
    w = describe(values, layout_of(values), wt);
    parts = {{&w, values}};
  }
  if (bias.defined()) {
    b = describe(bias, layout_of(bias), bias.scalar_type());
    parts.push_back({&b, bias});
  }
  std::vector<at::Tensor> views;
  // Frozen blocks may be shared between the ranks of the host; a trainable one is written by its optimizer.
  const bool shareable = !weight.requires_grad() && !(bias.defined() && bias.requires_grad());
  const std::size_t packed_part = compress ? w.bytes + (q && q->scale.defined ? align_up(q->scale.bytes) : 0) : 0;
  const auto t_block = std::chrono::steady_clock::now();
  auto block = new_block(parts, views, shareable, packed_part, encode);
  if (to_lossless) {
    times.block_s = seconds_since(t_block);
    std::lock_guard<std::mutex> timing(g_pack_times_mu);
    g_pack_times.weights += 1;
    g_pack_times.bytes_in += static_cast<std::int64_t>(exact.nbytes());
    g_pack_times.copy_s += times.copy_s;
    g_pack_times.table_s += times.table_s;
    g_pack_times.block_s += times.block_s;
  }

  // Swap the Parameters' data (identity kept), then remember what they must look like. A compressed
  // weight's Parameter keeps its exact values outside the arena: pageable host memory (a lossless one
  // until the caller makes it a PackedWeight: adopt_weight_parameter).
  g_pageable -= pageable_;
  pageable_ = 0;
  if (compress) {
    // A lossless weight's host copy is `exact` (made above from these values): no second copy from the GPU.
    if (!weight.is_cpu()) at::Tensor(weight).set_data(exact.defined() ? exact : weight.detach().to(at::kCPU));
    if (!is_python_tensor(weight)) pageable_ = static_cast<std::int64_t>(weight.nbytes());
  } else if (!tied) {
    LS_CHECK_ARG(!is_python_tensor(weight),
                 "layerstream: this layer's weight is a PackedWeight (LAYERSTREAM_HOST_DTYPE=lossless) that could "
                 "not be made plain to be stored as it is (another layer holds it); assign it a plain Parameter: "
                 "layer.weight = torch.nn.Parameter(layer.weight.clone(), requires_grad=...)");
    at::Tensor(weight).set_data(views[0]);
  }
  g_pageable += pageable_;
  if (b.defined) at::Tensor(bias).set_data(views.back());
  remember_identity(w, weight);
  if (b.defined) remember_identity(b, bias);
  install(std::move(block), std::move(w), std::move(b), std::move(q));
  weight_tied_ = tied;
  // Whether a use with the weight frozen should pack it again: not for weights the setting does not take,
  // nor for one lossless packing would not shrink (each use would pack it again, for nothing).
  compress_frozen_ = float8_takes || (lossless_takes && (!frozen || to_lossless));
  lossless_takes_ = lossless_takes;
}

std::optional<StreamedLayer::PackedBytes> StreamedLayer::packed_weight_to_wrap() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!quant_ || !quant_->lossless || !quant_->compressed || weight_.wrapped || weight_tied_) return std::nullopt;
  auto keep = std::static_pointer_cast<BlockAccount>(block_account_);
  PackedBytes out;
  out.codes = view_of(block_->data(), weight_, at::kCPU, [keep](void*) {});
  out.spec = *quant_->lossless;
  out.sizes = quant_->sizes;
  return out;
}

void StreamedLayer::forget_weight_parameter() {
  std::lock_guard<std::mutex> lock(mu_);
  weight_.impl.reset();
  weight_.storage.reset();
}

void StreamedLayer::adopt_weight_parameter(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mu_);
  remember_identity(weight_, weight);
  if (weight_.wrapped) {
    LS_CHECK_ARG(quant_ && quant_->lossless, "adopt_weight_parameter: this layer holds no losslessly packed weight");
    g_pageable -= pageable_;
    pageable_ = 0;
  }
}

bool StreamedLayer::holds_packed_parameter(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mu_);
  return weight_.wrapped && matches(weight_, weight);
}

std::array<at::Tensor, 2> StreamedLayer::pack_quantized(const at::Tensor& codes, const at::Tensor& scale,
                                                        at::ScalarType math, at::ScalarType result,
                                                        const at::Tensor& bias, bool frozen) {
  check_not_inference(bias, "bias");
  LS_CHECK_ARG(codes.defined() && scale.defined() && quantized_layout_supported(codes, scale),
               "a quantized weight needs non-empty int8 or float8 codes with a float32/float16/bfloat16 scale, one "
               "per output row or one, not ", codes.scalar_type(), " codes of shape ", codes.sizes(), " with a ",
               scale.scalar_type(), " scale of shape ", scale.sizes());
  std::lock_guard<std::mutex> lock(mu_);
  Packed w = describe(codes, contiguous_layout(codes), codes.scalar_type());
  QuantParts q;
  q.scale = describe(scale, contiguous_layout(scale), scale.scalar_type());
  q.math = math;
  q.result = result;
  Packed b;
  std::vector<std::pair<Packed*, at::Tensor>> parts{{&w, codes}, {&q.scale, scale}};
  if (bias.defined()) {
    b = describe(bias, layout_of(bias), bias.scalar_type());
    parts.push_back({&b, bias});
  }
  std::vector<at::Tensor> views;
  auto block = new_block(parts, views, frozen && !(bias.defined() && bias.requires_grad()));
  if (b.defined) {
    at::Tensor(bias).set_data(views[2]);
    remember_identity(b, bias);
  }
  remember_identity(w, views[0]);  // the caller puts this very tensor into the weight object
  install(std::move(block), std::move(w), std::move(b), std::move(q));
  return {views[0], views[1]};
}

std::vector<at::Tensor> StreamedLayer::pack_tensors(const std::vector<at::Tensor>& tensors) {
  LS_CHECK_ARG(!tensors.empty(), "a managed layer needs at least one tensor");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Packed> packed;
  packed.reserve(tensors.size());  // parts point into it
  bool shareable = true;
  for (const auto& t : tensors) {
    LS_CHECK_ARG(t.defined() && t.layout() == at::kStrided, "a managed layer's tensors must be dense");
    packed.push_back(describe(t, layout_of(t), t.scalar_type()));
    shareable = shareable && !t.requires_grad();
  }
  std::vector<std::pair<Packed*, at::Tensor>> parts;
  for (std::size_t i = 0; i < tensors.size(); ++i) parts.push_back({&packed[i], tensors[i]});
  std::vector<at::Tensor> views;
  auto block = new_block(parts, views, shareable);
  for (std::size_t i = 0; i < views.size(); ++i) remember_identity(packed[i], views[i]);
  install(std::move(block), Packed{}, Packed{}, std::nullopt);
  tensors_ = std::move(packed);
  return views;
}

void StreamedLayer::adopt_tensor(std::size_t index, const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK(index < tensors_.size(), "internal: adopt_tensor(", index, ") of ", tensors_.size(), " packed tensors");
  LS_CHECK(t.defined() && t.data_ptr() == tensors_[index].data, "internal: adopt_tensor: not set to the packed view");
  remember_identity(tensors_[index], t);
}

bool StreamedLayer::tensors_current(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tensors.size() != tensors_.size()) return false;
  bool modified = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!matches(tensors_[i], tensors[i])) return false;
    modified = modified || tensors[i]._version() != tensors_[i].version;
  }
  if (modified) {  // changed in place (a requantize): the arena holds the new bytes; the device copy is stale
    if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(id_);
    for (std::size_t i = 0; i < tensors.size(); ++i) tensors_[i].version = tensors[i]._version();
  }
  return true;
}

std::string StreamedLayer::stored_as() const {
  if (quant_ && quant_->lossless) return "lossless " + std::string(c10::toString(quant_->result));
  if (!tensors_.empty()) return std::string(c10::toString(tensors_.front().dtype));  // the first buffer's
  return std::string(c10::toString(weight_.dtype));
}

bool StreamedLayer::is_current(const at::Tensor& weight, const at::Tensor& bias) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!matches(weight_, weight) || !matches(bias_, bias)) return false;  // replaced, or data swapped
  const bool w_same = weight._version() == weight_.version;
  const bool b_same = !bias_.defined || bias._version() == bias_.version;
  if (w_same && b_same) return true;
  // Codes made from the weight's values, or a tied weight's copy in this block, must be made again.
  if (!w_same && (quant_ || weight_tied_)) return false;
  // Modified in place (an optimizer step on a trainable layer): the arena holds the new bytes already;
  // the device copy is stale.
  if (TransferEngine* engine = engine_if_registered()) engine->begin_host_write(id_);
  weight_.version = weight._version();
  if (bias_.defined) bias_.version = bias._version();
  return true;
}

void StreamedLayer::refresh(const at::Tensor& weight, const at::Tensor& bias) {
  // LAYERSTREAM_HOST_DTYPE applies to frozen weights: one frozen after it was packed gets compressed now,
  // one made trainable again is stored as it is (its gradient and updates need the exact values).
  const bool compress_now = compress_frozen_ && !quant_ && !weight.requires_grad();
  const bool expand_now = quant_ && quant_->compressed && weight.requires_grad();
  // A shared (read-only) block whose weight or bias became trainable gets a copy of this rank's own
  // before its optimizer writes to it.
  const bool shared = block_ && block_->segment() != nullptr;
  const bool trainable = weight.requires_grad() || (bias.defined() && bias.requires_grad());
  fresh_each_use_.store(trainable, std::memory_order_relaxed);
  const bool unshare_now = shared && trainable;
  if (compress_now || expand_now || unshare_now || !is_current(weight, bias)) pack(weight, bias, weight_tied_);
}

namespace {

// The core's description of a dequantization, when it can do this one: supported codes, scale, math
// and result types, contiguous tensors, and a kernel for where they are (the fused CUDA kernel needs a
// CUDA build of both the core and the glue; host tensors take the host reference).
std::optional<DequantSpec> core_dequant_spec(const at::Tensor& codes, const at::Tensor& scale, at::ScalarType math,
                                             at::ScalarType result) {
#if !(defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA))
  if (codes.is_cuda()) return std::nullopt;
#endif
  const auto code = code_type_of(codes.scalar_type());
  const auto scale_type = real_type_of(scale.scalar_type());
  const auto math_type = real_type_of(math);
  const auto result_type = real_type_of(result);
  if (!(quantized_layout_supported(codes, scale) && math_type && result_type &&
        (math == at::kFloat || math == scale.scalar_type()) && codes.is_contiguous() && scale.is_contiguous())) {
    return std::nullopt;
  }
  DequantSpec spec;
  spec.code = *code;
  spec.scale = *scale_type;
  spec.math = *math_type;
  spec.out = *result_type;
  spec.rows = static_cast<std::size_t>(codes.size(0));
  spec.cols = static_cast<std::size_t>(codes.numel() / codes.size(0));
  spec.per_row = scale.numel() != 1;
  return spec;
}

// Runs `spec` into `out` (contiguous, codes' shape, on codes' device): the kernel on torch's current
// stream of that device (the stream the layer computes on), or the host reference.
void run_core_dequant(const DequantSpec& spec, const at::Tensor& codes, const at::Tensor& scale, at::Tensor& out) {
  if (!codes.is_cuda()) {
    dequantize_host(spec, codes.data_ptr(), scale.data_ptr(), out.data_ptr());
    return;
  }
#if defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA)
  const c10::cuda::CUDAGuard guard(codes.device().index());
  dequantize_cuda(spec, codes.data_ptr(), scale.data_ptr(), out.data_ptr(),
                  c10::cuda::getCurrentCUDAStream(codes.device().index()).stream());
#else
  LS_CHECK(false, "internal: no dequantization kernel in this build");
#endif
}

}  // namespace

at::Tensor dequantize_codes(const at::Tensor& codes, const at::Tensor& scale, at::ScalarType math,
                            at::ScalarType result, bool use_core) {
  LS_CHECK_ARG(codes.device() == scale.device(), "codes and scale must be on one device, not ", codes.device(),
               " and ", scale.device());
  if (use_core) {
    if (const std::optional<DequantSpec> spec = core_dequant_spec(codes, scale, math, result)) {
      at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(result));
      run_core_dequant(*spec, codes, scale, out);
      return out;
    }
  }
  // The same formula with torch operations.
  return (codes.to(math) * scale.to(math)).to(result);
}

bool StreamedLayer::lossless_decoder_here() const {
#if !(defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA))
  if (state_->mode() == Mode::kCuda) {
    log_once("lossless-no-kernel", LogLevel::kWarning,
             "layerstream: LAYERSTREAM_HOST_DTYPE=lossless needs the CUDA decoder, which this build lacks (a "
             "CPU-only build of the core, or of torch); weights are stored and streamed as they are");
    return false;
  }
#endif
  return true;
}

std::vector<std::int64_t> StreamedLayer::weight_shape() const {
  return quant_ && quant_->lossless ? quant_->sizes : weight_.sizes;
}

namespace {

// Rebuilds a losslessly packed weight into `out` (contiguous, the weight's shape and dtype, on the
// codes' device): the kernels on torch's current stream of that device, or the host reference.
void run_lossless_decode(const LosslessSpec& spec, const at::Tensor& codes, at::Tensor& out, unsigned max_blocks) {
  if (!codes.is_cuda()) {
    lossless_decode_host(spec, codes.data_ptr(), static_cast<std::uint16_t*>(out.data_ptr()));
    return;
  }
#if defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA)
  const c10::cuda::CUDAGuard guard(codes.device().index());
  lossless_decode_cuda(spec, codes.data_ptr(), out.data_ptr(),
                       c10::cuda::getCurrentCUDAStream(codes.device().index()).stream(), max_blocks);
#else
  (void)max_blocks;
  LS_CHECK(false, "internal: no lossless decoder in this build");
#endif
}

std::atomic<unsigned>& decode_blocks_setting() {
  static std::atomic<unsigned> blocks{Settings::current()->decode_blocks};
  return blocks;
}

}  // namespace

unsigned decode_blocks() { return decode_blocks_setting().load(std::memory_order_relaxed); }

void set_decode_blocks(unsigned blocks) {
  LS_CHECK_ARG(blocks <= kMostDecodeBlocks, "decode blocks: ", blocks, " is above the kernel's limit of ",
               kMostDecodeBlocks, " (0: no limit)");
  decode_blocks_setting().store(blocks, std::memory_order_relaxed);
}

std::optional<std::pair<at::Tensor, LosslessSpec>> lossless_pack(const at::Tensor& weight, bool only_if_smaller) {
  const at::Tensor exact = weight.detach().to(at::kCPU).contiguous();
  const auto* values = static_cast<const std::uint16_t*>(exact.data_ptr());
  const LosslessSpec spec = lossless_plan(values, static_cast<std::size_t>(exact.numel()));
  if (only_if_smaller && spec.bytes() >= static_cast<std::size_t>(exact.numel()) * sizeof(std::uint16_t)) {
    return std::nullopt;
  }
  at::Tensor codes = at::empty({static_cast<std::int64_t>(spec.bytes())}, at::TensorOptions().dtype(at::kByte));
  lossless_encode(spec, values, codes.data_ptr());
  return std::make_pair(std::move(codes), spec);
}

at::Tensor lossless_unpack(const at::Tensor& codes, const LosslessSpec& spec, c10::IntArrayRef sizes,
                           unsigned max_blocks) {
  LS_CHECK_ARG(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                   static_cast<std::size_t>(codes.numel()) >= spec.bytes() &&
                   static_cast<std::size_t>(c10::multiply_integers(sizes)) == spec.count,
               "lossless_unpack: ", spec.bytes(), " contiguous uint8 bytes of ", spec.count, " values needed, not ",
               codes.numel(), " ", codes.scalar_type(), " for shape ", sizes);
  at::Tensor out = at::empty(sizes, codes.options().dtype(at::kBFloat16));
  run_lossless_decode(spec, codes, out, max_blocks);
  return out;
}

at::Tensor StreamedLayer::dequantize(const at::Tensor& codes, const at::Tensor& scale, bool on_device) const {
  if (quant_->lossless) {  // one decoder, wherever the bytes are (exact: nothing to match upstream's math)
    return lossless_unpack(codes, *quant_->lossless, quant_->sizes);
  }
  // The simulator's "device" copy is host memory: the kernel's host reference computes it, so CI runs the
  // routine the CUDA kernel mirrors. A CPU process device uses torch operations (upstream's math).
  const bool use_core = on_device || state_->mode() == Mode::kSim;
  return dequantize_codes(codes, scale, quant_->math, quant_->result, use_core);
}

at::Tensor StreamedLayer::dequantize_in_scratch(const at::Tensor& codes, const at::Tensor& scale, const Lease& lease,
                                                 at::Device where, StreamHandle consumer) {
  const std::vector<std::int64_t> sizes = weight_shape();
  const std::size_t bytes = static_cast<std::size_t>(c10::multiply_integers(sizes)) * c10::elementSize(quant_->result);
  LS_CHECK(lease.extra_bytes >= bytes, "internal: scratch of ", lease.extra_bytes, " bytes for a weight of ", bytes);
  at::Tensor out = at::from_blob(lease.extra, sizes, at::TensorOptions().dtype(quant_->result).device(where));
  const bool on_host = where.is_cpu();
  if (quant_->lossless) {  // decoded on the derive stream before the copy's ready event (fill_hook_locked)
    if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, false);
    state_->note_dequant(DequantUse::kOnCopy);
    return out;
  }
  std::lock_guard<std::mutex> lock(scratch_mu_);
  if (lease.fill == scratch_fill_ && consumer.raw == scratch_stream_) {  // this copy, dequantized on this stream
    if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, false);
    state_->note_dequant(DequantUse::kReused);
    return out;
  }
  if (lease.fill == scratch_fill_) {  // there, but written on another stream: do not touch it
    state_->note_dequant(DequantUse::kOwnMemory);
    return dequantize(codes, scale, !on_host);
  }
  // A new copy: its H2D copy waited for every earlier reader of this memory, and the consumer waited for
  // the copy, so the write below is ordered after all of them.
  const std::optional<DequantSpec> spec = core_dequant_spec(codes, scale, quant_->math, quant_->result);
  LS_CHECK(spec.has_value(), "internal: scratch was asked for a weight the core cannot dequantize");
  if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, true);
  run_core_dequant(*spec, codes, scale, out);
  scratch_fill_ = lease.fill;
  scratch_stream_ = consumer.raw;
  state_->note_dequant(DequantUse::kIntoScratch);
  return out;
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

std::size_t StreamedLayer::scratch_bytes_locked() const {
  if (!quant_ || state_->mode() == Mode::kCpu) return 0;
  if (quant_->lossless) return quant_->lossless->count * c10::elementSize(quant_->result);  // pack() checked the decoder
  // The device views have the host views' dtypes, sizes and strides: ask on the host ones, for the device.
  const at::Tensor codes = view_of(block_->data(), weight_, at::kCPU);
  const at::Tensor scale = view_of(block_->data(), quant_->scale, at::kCPU);
  if (!core_dequant_spec(codes, scale, quant_->math, quant_->result)) return 0;
#if !(defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA))
  if (state_->mode() == Mode::kCuda) return 0;  // no kernel: torch operations, into memory of their own
#endif
  return static_cast<std::size_t>(codes.numel()) * c10::elementSize(quant_->result);
}

TransferEngine& StreamedLayer::registered_engine() {
  std::lock_guard<std::mutex> lock(mu_);
  TransferEngine& engine = state_->engine_for(device_bytes(block_->block().bytes, scratch_));
  if (id_ == 0 || generation_ != state_->generation()) {
    id_ = engine.add_external_layer(block_->block(), scratch_, fill_hook_locked());
    generation_ = state_->generation();
    state_->consider_residency(engine, id_, block_->block().bytes);
  }
  return engine;
}

TransferEngine::FillHook StreamedLayer::fill_hook_locked() const {
  // Packed weights are decoded on the engine's derive stream right after their copy, beside the next copy
  // and off the compute stream; the consumer then finds them decoded (dequantize_in_scratch).
  if (!quant_ || !quant_->lossless || scratch_ == 0) return {};
  const LosslessSpec spec = *quant_->lossless;
  if (state_->mode() == Mode::kSim) {
    Backend* backend = &state_->backend();  // outlives the engines built on it
    return [spec, backend](void* region, void* scratch, StreamHandle stream) {
      backend->annotate_stream_access(stream, region, spec.bytes(), false);
      backend->annotate_stream_access(stream, scratch, spec.count * sizeof(std::uint16_t), true);
      backend->launch_host_func(stream, [spec, region, scratch] {
        lossless_decode_host(spec, region, static_cast<std::uint16_t*>(scratch));
      });
    };
  }
#if defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA)
  const c10::DeviceIndex device = state_->device().index();
  return [spec, device](void* region, void* scratch, StreamHandle stream) {
    const c10::cuda::CUDAGuard guard(device);
    lossless_decode_cuda(spec, region, scratch, stream.raw, decode_blocks());
  };
#else
  return {};
#endif
}

template <typename Fn>
auto StreamedLayer::with_region(Fn&& fn) {
  TransferEngine& engine = registered_engine();
  const StreamHandle consumer = state_->consumer_stream();
  const bool fresh = fresh_each_use_.load(std::memory_order_relaxed);
  // A trainable weight may have been written through .data since its device copy was made (see
  // fresh_each_use_): drop that copy (resident or in the ring), so that the fetch copies the host bytes.
  if (fresh) engine.begin_host_write(id_);
  const Lease lease = engine.fetch(id_);
  const bool on_host = state_->mode() == Mode::kSim;
  const at::Device where = on_host ? at::Device(at::kCPU) : state_->device();
  // A view of one packed tensor in the fetched region.
  auto view = [&](const Packed& p) { return view_of(static_cast<char*>(lease.data), p, where); };
  try {  // from here on, every exit releases the lease
    state_->note_use(id_, fresh);  // after the fetch holds this layer, so prefetches cannot displace it
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
    at::Tensor w = view(weight_);
    if (quant_ && lease.extra != nullptr) {
      w = dequantize_in_scratch(w, view(quant_->scale), lease, on_host ? at::Device(at::kCPU) : state_->device(),
                                consumer);
    } else if (quant_) {
      state_->note_dequant(DequantUse::kOwnMemory);
      w = dequantize(w, view(quant_->scale), !on_host);
    }
    return fn(w, view(bias_));
  });
}

std::vector<at::Tensor> StreamedLayer::stage_tensors() {
#ifdef LAYERSTREAM_TORCH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (state_->mode() == Mode::kCuda) guard.emplace(state_->device().index());
#endif
  return with_region([&](const auto& view, bool, const Lease&, StreamHandle) {
    std::vector<at::Tensor> out;
    out.reserve(tensors_.size());
    // Copies out of the ring: the region goes back as soon as they are enqueued.
    for (const Packed& p : tensors_) out.push_back(view(p).clone());
    return out;
  });
}

at::Tensor StreamedLayer::forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  refresh(weight, bias);
  return run(x, weight, bias);
}

at::Tensor StreamedLayer::forward_frozen(const at::Tensor& x, const at::Tensor& bias) {
  fresh_each_use_.store(bias.defined() && bias.requires_grad(), std::memory_order_relaxed);
  return run(x, at::Tensor(), bias);
}

at::Tensor StreamedLayer::run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (state_->mode() == Mode::kCpu) {
    at::Tensor w = weight;
    if (quant_) {
      std::lock_guard<std::mutex> lock(mu_);
      w = dequantize(view_of(block_->data(), weight_, at::kCPU), view_of(block_->data(), quant_->scale, at::kCPU),
                     false);
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
    const Packed& packed = is_bias ? bias_ : weight_;
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
      gb = gradient_out(g, bias, true);
    }
  } else {
    // convolution_backward is exactly what autograd runs for conv2d. An unbatched input (C, H, W) ran as
    // a batch of one (conv2d adds the batch dimension, and removes it from the output).
    const bool unbatched = x_sizes.size() == 3;
    const at::Tensor g4 = unbatched ? grad_out.unsqueeze(0) : grad_out;
    const at::Tensor x4 = unbatched ? x.unsqueeze(0) : x;
    auto grads = with_device_weights([&](const at::Tensor& w, const at::Tensor&) {
      const at::OptionalIntArrayRef bias_sizes =
          bias_.defined ? at::OptionalIntArrayRef(bias_.sizes) : at::OptionalIntArrayRef(c10::nullopt);
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
