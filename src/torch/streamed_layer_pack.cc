// StreamedLayer's packing: the stored form of a weight (as it is, float8 codes with a scale, or packed
// losslessly) chosen from the weight and LAYERSTREAM_HOST_DTYPE and built, the layer's tensors written into
// a new arena block, and the Parameters made views of it (identity kept); a library-quantized weight's codes
// and scale, and a layer's own tensors, packed as stored; the weight Parameter swapped to and from a
// PackedWeight. Everything that changes what the layer holds takes mu_.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/host_form.h"
#include "layerstream/log.h"
#include "layerstream/lossless.h"
#include "layerstream/stored_form.h"
#include "streamed_layer_internal.h"

namespace layerstream::torchglue {

using detail::align_up;
using detail::contiguous_layout;
using detail::is_python_tensor;
using detail::layout_of;
using detail::view_of;

namespace {

using Packed = StreamedLayer::Packed;

// LAYERSTREAM_HOST_DTYPE: how frozen floating-point weights are kept in the arena (and cross the bus).
struct HostStorage {
  std::optional<at::ScalarType> float8;  // 8-bit codes with a float32 scale per output channel (lossy)
  bool lossless = false;                  // bfloat16 weights packed exactly (lossless.h)
  std::optional<HostFormChoice> automatic;  // auto: lossless only for the weights auto_packs_weight takes
  bool any() const { return float8.has_value() || lossless; }
};

// auto's choice for a device of this mode (host_form.h), its INFO line said once per process (once per
// distinct line: a process with a simulated and a CUDA device hears both).
HostFormChoice auto_host_form(Mode mode) {
  HostFormFacts facts;
  facts.simulated = mode != Mode::kCuda;
#if defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA)
  facts.decoder = true;
#else
  facts.decoder = facts.simulated;  // the host reference decodes for the simulator and the CPU
#endif
  facts.encoder_threads = lossless_threads();
  HostFormChoice choice = choose_auto_host_form(facts);
  log_once("host-dtype-auto " + choice.reason, LogLevel::kInfo, choice.reason);
  return choice;
}

HostStorage host_storage_setting(Mode mode) {
  HostStorage h;
  const HostDtype d = Settings::current()->host_dtype;
  if (d == HostDtype::kFloat8E4M3) h.float8 = at::kFloat8_e4m3fn;
  if (d == HostDtype::kFloat8E5M2) h.float8 = at::kFloat8_e5m2;
  if (d == HostDtype::kAuto) h.automatic = auto_host_form(mode);
  h.lossless = d == HostDtype::kLossless || (h.automatic && h.automatic->lossless);
  return h;
}

double float8_max(at::ScalarType t) { return t == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

std::mutex g_pack_times_mu;
LosslessPackTimes g_pack_times;  // guarded by g_pack_times_mu
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Adds one weight's lossless packing to lossless_pack_times().
void note_lossless_pack(const LosslessPackTimes& one) {
  std::lock_guard<std::mutex> timing(g_pack_times_mu);
  g_pack_times.weights += one.weights;
  g_pack_times.bytes_in += one.bytes_in;
  g_pack_times.copy_s += one.copy_s;
  g_pack_times.table_s += one.table_s;
  g_pack_times.block_s += one.block_s;
}

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

// The compressed forms LAYERSTREAM_HOST_DTYPE gives this weight, frozen now or not (one frozen later is
// compressed at its next use). `decoder`: this process device can decode lossless weights.
struct HostTakes {
  bool float8 = false;
  bool lossless = false;
};

HostTakes host_takes(const at::Tensor& weight, const HostStorage& host, bool decoder) {
  const auto wt = weight.scalar_type();
  HostTakes takes;
  takes.float8 =
      host.float8.has_value() && weight.numel() > 0 && (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat);
  // Lossless: bfloat16 in the standard layout (the decoded weight is contiguous: another layout would
  // compute with other kernels than the plain path), within the encoding's 32-bit indices, where a
  // decoder runs. Others are stored as they are.
  takes.lossless = host.lossless && weight.numel() > 0 && wt == at::kBFloat16 && weight.is_contiguous() &&
                   static_cast<std::size_t>(weight.numel()) <= kLosslessMaxCount && decoder &&
                   (!host.automatic || auto_packs_weight(*host.automatic, true, weight.nbytes()));
  return takes;
}

// How pack() stores a weight in its block. `form` is its entry in stored_forms() (plain, float8-host or
// lossless-bf16), `w` describes the weight's part (the values, the float8 codes or the lossless bytes), `q` how
// a compressed one turns back into the weight.
struct StoredWeight {
  const StoredForm* form = nullptr;
  Packed w;
  std::optional<StreamedLayer::QuantParts> q;
  at::Tensor source;  // what the weight's part is copied from: the values (plain), the codes (float8)
  at::Tensor scale;   // float8: the scale part's source
  at::Tensor exact;   // lossless: the values in ordinary host memory, contiguous: the encoder's input
  LosslessPackTimes times;
  bool compressed() const { return form->decode != DeviceDecode::kAsStored; }
};

StoredWeight plain_form(const at::Tensor& values, at::ScalarType dtype) {
  StoredWeight s;
  s.w = describe(values, layout_of(values), dtype);
  s.source = values;
  return s;
}

// Frozen weight kept as 8-bit codes with a float32 scale per output channel (amax / largest code); the
// Parameter keeps its exact values in ordinary (pageable) host memory, outside the arena.
StoredWeight float8_form(const at::Tensor& values, at::ScalarType f8, at::ScalarType result) {
  StoredWeight s;
  const at::Tensor wf = values.detach().to(at::kCPU).to(at::kFloat);
  std::vector<std::int64_t> rest;
  for (std::int64_t d = 1; d < wf.dim(); ++d) rest.push_back(d);
  at::Tensor amax = rest.empty() ? wf.abs() : wf.abs().amax(rest, /*keepdim=*/true);
  s.scale = amax / float8_max(f8);
  s.scale.masked_fill_(s.scale == 0, 1.0);
  s.source = (wf / s.scale).clamp(-float8_max(f8), float8_max(f8)).to(f8);
  s.w = describe(s.source, s.source.strides().vec(), f8);
  s.q.emplace();
  s.q->scale = describe(s.scale, s.scale.strides().vec(), at::kFloat);
  s.q->math = at::kFloat;
  s.q->result = result;
  s.q->compressed = true;
  return s;
}

std::atomic<bool> g_staging_pin_failed{false};  // take_staging_pin_failure(): said once by the caller

// The exact values of `values` in host memory, contiguous, for the encoder (and the Parameter until it is
// wrapped as a PackedWeight, which frees them). A host tensor is its own copy when contiguous. From a GPU
// (AI-Toolkit places the transformer there before attach) the copy goes to page-locked memory from torch's
// caching host allocator: a copy into fresh pageable memory ran at 1.4-1.6 GB/s on the H200 machine (47 of
// FLUX.2's 76 s of lossless attach). One tensor lives at a time (the wrap follows each pack), so the
// allocator's cache keeps about one block per size class (rounded up to a power of two) after the attach.
// Where pinning fails (a limit on locked memory) the copy goes to pageable memory, as before.
at::Tensor host_values(const at::Tensor& values) {
  if (values.is_cuda()) {
    try {
      at::Tensor host = at::empty(values.sizes(), values.options().device(at::kCPU).pinned_memory(true));
      host.copy_(values.detach());  // blocking: the current stream's work on `values` is done first
      return host;
    } catch (const std::exception&) {
      g_staging_pin_failed = true;
    }
  }
  return values.detach().to(at::kCPU).contiguous();
}

// Frozen bfloat16 weight packed exactly (lossless.h), encoded straight into the block by pack(); the caller
// (module.cc) then makes the Parameter a PackedWeight of those bytes. The table first (one pass over the
// values). nullopt for a weight whose exponents spread too widely (8 bytes per exception): it packs no
// smaller, and is stored as it is.
std::optional<StoredWeight> lossless_form(const at::Tensor& values, const at::Tensor& weight) {
  StoredWeight s;
  auto t0 = std::chrono::steady_clock::now();
  s.exact = host_values(values);
  s.times.copy_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  const LosslessSpec spec =
      lossless_plan(static_cast<const std::uint16_t*>(s.exact.data_ptr()), static_cast<std::size_t>(s.exact.numel()));
  s.times.table_s = seconds_since(t0);
  if (spec.bytes() >= s.exact.nbytes()) return std::nullopt;
  s.w.sizes = {static_cast<std::int64_t>(spec.bytes())};
  s.w.strides = {1};
  s.w.dtype = at::kByte;
  s.w.bytes = spec.bytes();
  s.w.defined = true;
  s.q.emplace();
  s.q->math = weight.scalar_type();
  s.q->result = weight.scalar_type();
  s.q->compressed = true;
  s.q->lossless = spec;
  s.q->sizes = weight.sizes().vec();
  s.times.weights = 1;
  s.times.bytes_in = static_cast<std::int64_t>(s.exact.nbytes());
  return s;
}

// The forms pack() may store a weight in, tried in this order: the first whose builder takes the weight stores
// it. The compressed ones take a frozen weight LAYERSTREAM_HOST_DTYPE gives them (lossless only where the
// packing is smaller); plain takes every weight.
struct HostCodec {
  std::string_view form;  // its entry in stored_forms()
  std::optional<StoredWeight> (*build)(const at::Tensor& values, const at::Tensor& weight, const HostStorage& host,
                                       HostTakes takes);
};

const HostCodec kHostCodecs[] = {
    {"lossless-bf16",
     [](const at::Tensor& values, const at::Tensor& weight, const HostStorage&, HostTakes takes) {
       return takes.lossless && !weight.requires_grad() ? lossless_form(values, weight) : std::nullopt;
     }},
    {"float8-host",
     [](const at::Tensor& values, const at::Tensor& weight, const HostStorage& host, HostTakes takes) {
       if (!takes.float8 || weight.requires_grad()) return std::optional<StoredWeight>();
       return std::optional<StoredWeight>(float8_form(values, *host.float8, weight.scalar_type()));
     }},
    {"plain",
     [](const at::Tensor& values, const at::Tensor& weight, const HostStorage&, HostTakes) {
       return std::optional<StoredWeight>(plain_form(values, weight.scalar_type()));
     }},
};

// The stored form of `weight` (exact values `values`): the first of kHostCodecs that takes it.
StoredWeight choose_stored_weight(const at::Tensor& values, const at::Tensor& weight, const HostStorage& host,
                                  HostTakes takes) {
  for (const HostCodec& codec : kHostCodecs) {
    if (std::optional<StoredWeight> s = codec.build(values, weight, host, takes)) {
      s->form = &stored_form(codec.form);
      return std::move(*s);
    }
  }
  LS_FAIL("internal: no host form took the weight");  // plain takes every one
}

// Swaps the Parameters' data for their views in the block (identity kept). A compressed weight's Parameter
// keeps its exact values outside the arena, in pageable host memory (a lossless one until the caller makes
// it a PackedWeight: adopt_weight_parameter); returns those bytes. `tied`: the weight's data stays in the
// other layer's block.
std::int64_t swap_parameter_data(const at::Tensor& weight, const at::Tensor& bias, bool tied,
                                 const StoredWeight& stored, const std::vector<at::Tensor>& views) {
  std::int64_t pageable = 0;
  if (stored.compressed()) {
    // A lossless weight's host copy is `exact` (made from these values): no second copy from the GPU.
    if (!weight.is_cpu()) at::Tensor(weight).set_data(stored.exact.defined() ? stored.exact : weight.detach().to(at::kCPU));
    if (!is_python_tensor(weight)) pageable = static_cast<std::int64_t>(weight.nbytes());
  } else if (!tied) {
    LS_CHECK_ARG(!is_python_tensor(weight),
                 "layerstream: this layer's weight is a PackedWeight (LAYERSTREAM_HOST_DTYPE=lossless) that could "
                 "not be made plain to be stored as it is (another layer holds it); assign it a plain Parameter: "
                 "layer.weight = torch.nn.Parameter(layer.weight.clone(), requires_grad=...)");
    at::Tensor(weight).set_data(views[0]);
  }
  if (bias.defined()) at::Tensor(bias).set_data(views.back());
  return pageable;
}

}  // namespace

bool take_staging_pin_failure() { return g_staging_pin_failed.exchange(false); }

LosslessPackTimes lossless_pack_times() {
  std::lock_guard<std::mutex> lock(g_pack_times_mu);
  return g_pack_times;
}

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
  const HostStorage host = host_storage_setting(state_->mode());  // may log: before the lock
  // auto's choice took the decoder into account; an explicit lossless warns where there is none.
  const bool decoder = host.lossless && (host.automatic || lossless_decoder_here());
  std::lock_guard<std::mutex> lock(mu_);
  const HostTakes takes = host_takes(weight, host, decoder);
  StoredWeight stored = choose_stored_weight(values, weight, host, takes);
  const bool lossless = stored.form->decode == DeviceDecode::kLossless;
  Packed b;
  std::vector<std::pair<Packed*, at::Tensor>> parts{{&stored.w, lossless ? stored.exact : stored.source}};
  if (stored.form->parts == ArenaParts::kCodesScaleBias) parts.push_back({&stored.q->scale, stored.scale});
  if (bias.defined()) {
    b = describe(bias, layout_of(bias), bias.scalar_type());
    parts.push_back({&b, bias});
  }
  std::function<void(char*)> encode;  // lossless: the encoder writes straight into the block
  if (lossless) {
    encode = [&exact = stored.exact, s = *stored.q->lossless](char* dst) {
      lossless_encode(s, static_cast<const std::uint16_t*>(exact.data_ptr()), dst);
    };
  }
  std::vector<at::Tensor> views;
  // Frozen blocks may be shared between the ranks of the host; a trainable one is written by its optimizer.
  const bool shareable = !weight.requires_grad() && !(bias.defined() && bias.requires_grad());
  const std::size_t packed_part =
      stored.compressed() ? stored.w.bytes + (stored.q->scale.defined ? align_up(stored.q->scale.bytes) : 0) : 0;
  const auto t_block = std::chrono::steady_clock::now();
  auto block = new_block(parts, views, shareable, packed_part, encode);
  if (lossless) {
    stored.times.block_s = seconds_since(t_block);
    note_lossless_pack(stored.times);
  }
  count_pageable_locked(swap_parameter_data(weight, bias, tied, stored, views));
  // Then remember what the Parameters must look like.
  remember_identity(stored.w, weight);
  if (b.defined) remember_identity(b, bias);
  install(std::move(block), stored.form, std::move(stored.w), std::move(b), std::move(stored.q));
  packed_.weight_tied = tied;
  // Whether a use with the weight frozen should pack it again: not for weights the setting does not take,
  // nor for one lossless packing would not shrink (each use would pack it again, for nothing).
  takes_.compress_frozen = takes.float8 || (takes.lossless && (weight.requires_grad() || lossless));
  takes_.lossless = takes.lossless;
}

std::optional<StreamedLayer::PackedBytes> StreamedLayer::packed_weight_to_wrap() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::optional<QuantParts>& q = packed_.quant;
  if (!q || !q->lossless || !q->compressed || packed_.weight.wrapped || packed_.weight_tied) return std::nullopt;
  std::shared_ptr<void> keep = block_.account;  // the block and its count live as long as the bytes' storage
  PackedBytes out;
  out.codes = view_of(block_.ref->data(), packed_.weight, at::kCPU, [keep](void*) {});
  out.spec = *packed_.quant->lossless;
  out.sizes = packed_.quant->sizes;
  return out;
}

void StreamedLayer::forget_weight_parameter() {
  std::lock_guard<std::mutex> lock(mu_);
  packed_.weight.impl.reset();
  packed_.weight.storage.reset();
}

void StreamedLayer::adopt_weight_parameter(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mu_);
  remember_identity(packed_.weight, weight);
  if (packed_.weight.wrapped) {
    LS_CHECK_ARG(packed_.quant && packed_.quant->lossless,
                 "adopt_weight_parameter: this layer holds no losslessly packed weight");
    count_pageable_locked(0);
  }
}

bool StreamedLayer::holds_packed_parameter(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mu_);
  return packed_.weight.wrapped && matches(packed_.weight, weight);
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
  install(std::move(block), nullptr, std::move(w), std::move(b), std::move(q));
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
  install(std::move(block), nullptr, Packed{}, Packed{}, std::nullopt);
  packed_.tensors = std::move(packed);
  return views;
}

void StreamedLayer::adopt_tensor(std::size_t index, const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Packed>& tensors = packed_.tensors;
  LS_CHECK(index < tensors.size(), "internal: adopt_tensor(", index, ") of ", tensors.size(), " packed tensors");
  LS_CHECK(t.defined() && t.data_ptr() == tensors[index].data, "internal: adopt_tensor: not set to the packed view");
  remember_identity(tensors[index], t);
}

}  // namespace layerstream::torchglue
