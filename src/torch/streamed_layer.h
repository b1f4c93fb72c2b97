// StreamedLayer: one linear or conv2d layer whose weights live in the pinned arena and reach the device
// through the TransferEngine for each use, and the autograd functions that use it.
//
// The implementation is split by job (streamed_layer_internal.h lists the files).
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
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "device_state.h"
#include "layerstream/dequant.h"
#include "layerstream/lossless.h"
#include "layerstream/stored_form.h"

namespace layerstream::torchglue {

enum class LayerKind { kLinear, kConv2d };

struct ConvParams {
  std::vector<std::int64_t> stride{1, 1};
  std::vector<std::int64_t> padding{0, 0};
  std::vector<std::int64_t> dilation{1, 1};
  std::int64_t groups = 1;
};

// Codes (int8/float8) and a scale (one per output row, or one) -> the weight in `result`:
// ((codes.to(math) * scale) rounded to math).to(result), the libraries' formula (layerstream/dequant.h).
// With `use_core`, the core computes it (the fused kernel for CUDA tensors, on torch's current stream;
// the host reference for host tensors) where the layout allows; otherwise torch operations do.
at::Tensor dequantize_codes(const at::Tensor& codes, const at::Tensor& scale, at::ScalarType math,
                            at::ScalarType result, bool use_core);
// A bfloat16 tensor packed losslessly (layerstream/lossless.h) into new host bytes, with its spec; nullopt
// when `only_if_smaller` and the packing would take at least the tensor's own bytes.
std::optional<std::pair<at::Tensor, LosslessSpec>> lossless_pack(const at::Tensor& weight, bool only_if_smaller);
// A contiguous bfloat16 tensor rebuilt from losslessly packed bytes (layerstream/lossless.h), on the bytes'
// device: the CUDA kernels on torch's current stream (at most max_blocks thread blocks; 0: no limit), or the
// host reference.
at::Tensor lossless_unpack(const at::Tensor& codes, const LosslessSpec& spec, c10::IntArrayRef sizes,
                           unsigned max_blocks = 0);
// How many thread blocks a decode on the derive stream may use (0: as many as the values need). A decode
// beside the backward's GEMMs takes SMs from them; a narrower one takes fewer, for longer, and only has to
// keep ahead of the bus. LAYERSTREAM_DECODE_BLOCKS sets it at the first use; set_decode_blocks (the
// benchmark's sweep) changes it for the decodes enqueued from then on.
unsigned decode_blocks();
void set_decode_blocks(unsigned blocks);

// The quantized weights the fused path takes: int8/float8 codes with a float32/float16/bfloat16 scale,
// one per output row (shape [out, 1, ...]) or one for the tensor.
bool quantized_layout_supported(const at::Tensor& codes, const at::Tensor& scale);
// float32, float16 or bfloat16: the dtypes a scale, the math and a dequantized weight may have; the core's
// name of one (nullopt for any other dtype).
bool is_real_dtype(at::ScalarType t);
std::optional<RealType> real_type_of(at::ScalarType t);

// Host memory the managed layers hold, over the process (stats()): arena blocks, pinned, whose weight is
// packed (lossless or float8: the packed part) or stored as it is (weights, biases, buffers); and pageable
// host memory held for them (arena blocks that could not be pinned, and the plain copy a compressed weight's
// Parameter keeps beside its packed one: float8's, or a lossless one not turned into a PackedWeight).
// Blocks in the copy the host's ranks share are counted in host_shared_bytes instead.
struct HostMemoryCounts {
  std::int64_t pinned_packed = 0;
  std::int64_t pinned_plain = 0;
  std::int64_t pageable = 0;
};
HostMemoryCounts host_memory_counts();

// Where the time of lossless packing at attach goes, summed over the process (for the benchmark: attach time
// is what users see at every start): copying the weight to ordinary host memory (from the GPU when the model
// was placed there), building the table (a pass over the values), and the arena block (its allocation and
// the encode into it).
struct LosslessPackTimes {
  std::int64_t weights = 0;
  std::int64_t bytes_in = 0;
  double copy_s = 0, table_s = 0, block_s = 0;
};
LosslessPackTimes lossless_pack_times();
// True once after a lossless pack from a GPU could not pin its host copy and used pageable memory: for the
// caller to say so outside the layer's lock (a Python log sink takes the GIL).
bool take_staging_pin_failure();

class StreamedLayer : public torch::CustomClassHolder {
 public:
  // Where one tensor of the layer lies in its arena block, and which tensor it was packed from.
  struct Packed {
    std::vector<std::int64_t> sizes;
    std::vector<std::int64_t> strides;  // layout_of() the Parameter (streamed_layer_internal.h)
    at::ScalarType dtype = at::kFloat;
    std::size_t offset = 0;
    std::size_t bytes = 0;
    // Identity of the Parameter and of its storage (none for a tensor without one), and where its data
    // must point. Held weakly: the objects may go, but their memory is not reused while they are
    // remembered, so a Parameter allocated where a replaced, freed one was cannot look the same (it was
    // served the old bytes when the identity was two raw addresses).
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    const void* data = nullptr;
    std::uint32_t version = 0;
    bool defined = false;
    // The Parameter is a PackedWeight (packed_weight.py: a tensor subclass without storage that decodes
    // the packed bytes on demand): its identity is its TensorImpl alone.
    bool wrapped = false;
  };
  // A weight stored as codes and a scale (the packed weight then describes the codes), or packed losslessly
  // (the packed weight then describes the encoded bytes, `scale` is undefined, `lossless` the encoding).
  struct QuantParts {
    Packed scale;
    at::ScalarType math = at::kFloat;
    at::ScalarType result = at::kBFloat16;
    bool compressed = false;  // made here from a plain Parameter (LAYERSTREAM_HOST_DTYPE)
    std::optional<LosslessSpec> lossless;
    std::vector<std::int64_t> sizes;  // the weight's shape (the encoded bytes are one flat run)
  };

  StreamedLayer(std::shared_ptr<DeviceState> state, LayerKind kind, ConvParams conv = {});
  ~StreamedLayer() override;

  // Moves `weight` (and `bias`, which may be undefined) into one arena block and makes the Parameters
  // views of it (Parameter identity is kept, so optimizers and references stay valid).
  // `tied`: the weight Parameter is already a view of another managed layer's block (one Parameter in two
  // layers): this block holds a copy of its bytes for the transfers, and its data stays where it is (two
  // layers swapping it back and forth packed it again at every call).
  // `values`: the weight's exact values when `weight` is a PackedWeight (packed_weight.py; its values come
  // from Python: torch's C++ dispatch into a Python subclass is not used here), else undefined.
  void pack(const at::Tensor& weight, const at::Tensor& bias, bool tied = false, const at::Tensor& values = {});
  // What refresh() returns: this layer was brought up to date with the Parameters it was given. A caller
  // that runs no Python code between refresh() and forward() and holds the GIL throughout (so that no
  // other thread replaces or writes the Parameters in between: packed_weight_glue.cc, forward_paths.cc)
  // passes it to forward(), which then skips its own check (and the layer's mutex).
  class Refreshed {
   public:
    bool of(const StreamedLayer* layer) const { return layer_ == layer; }

   private:
    friend class StreamedLayer;
    explicit Refreshed(const StreamedLayer* layer) : layer_(layer) {}
    const StreamedLayer* layer_;
  };
  // Called at every use: re-packs when the Parameters were replaced or their data swapped, and drops
  // the device copy when they were modified in place.
  Refreshed refresh(const at::Tensor& weight, const at::Tensor& bias);
  // False when `weight` (the Parameter, or the codes tensor of a quantized weight) or `bias` is not what
  // was packed, or a quantized/compressed weight was modified in place: the caller must pack again. A
  // plain weight modified in place stays current (its device copy is dropped).
  bool is_current(const at::Tensor& weight, const at::Tensor& bias);

  // A weight quantized by a library (optimum-quanto, torchao): its codes (int8/float8, the weight's
  // shape) and its scale (one per output row, or one) go into the arena; the device gets the codes as
  // stored and dequantizes them per use: ((codes.to(math) * scale) rounded to math).to(result), the
  // libraries' own formula. Returns the arena views of codes and scale, which the caller puts back into
  // the weight object (so the host copy exists once). The bias (plain) is packed as pack() does.
  // `frozen`: the weight object takes no gradient (its block may then be shared between the host's ranks).
  std::array<at::Tensor, 2> pack_quantized(const at::Tensor& codes, const at::Tensor& scale, at::ScalarType math,
                                           at::ScalarType result, const at::Tensor& bias, bool frozen);
  // A layer whose state is a set of tensors its own forward uses (AI-Toolkit's OstrisLinear: quantizer
  // buffers, then the bias): all of them in one block, as stored. Returns the host views, in order (the
  // caller puts them back into the layer, so the host copy exists once).
  std::vector<at::Tensor> pack_tensors(const std::vector<at::Tensor>& tensors);
  // The tensor the layer holds for pack_tensors' view `index` when it is not the view itself but a tensor
  // set to it (a Parameter whose data was set to the view: the bias): tensors_current() then knows it.
  void adopt_tensor(std::size_t index, const at::Tensor& t);
  // False when a tensor is not the packed view any more (replaced): pack again. One modified in place
  // stays current (its device copy is dropped).
  bool tensors_current(const std::vector<at::Tensor>& tensors);
  // Runs `fn(staged)` for one call of a layer that runs its own forward (OstrisLinear): the packed tensors
  // are fetched through the engine (prefetched when predicted) and handed over over the region itself
  // (ring or resident), with no copy, as tensors of their own that share the staged storages and version
  // counters (never the staged tensors, which stay private to this call); the region is released after `fn`. When `fn` returns or
  // throws, a staged tensor that something still holds (autograd saved it, a view of it lives on) gets
  // memory of torch's allocator with a copy of its bytes, enqueued on torch's current stream before the
  // release, so what holds it never sees the region reused; one that `fn` wrote in place drops the layer's
  // device copy, so the next call copies the host bytes again (stock stages a fresh copy every call). `fn`
  // must enqueue the kernels that read the views on torch's current stream (the consumer the release
  // orders after).
  void with_staged_tensors(const std::function<void(const std::vector<at::Tensor>&)>& fn);

  // The managed forward of a layer whose weight takes no gradient (quantized): only x and the bias are
  // autograd inputs.
  at::Tensor forward_frozen(const at::Tensor& x, const at::Tensor& bias);
  // "float8_e4m3fn" / "float8_e5m2" when the weight is stored compressed (LAYERSTREAM_HOST_DTYPE) or
  // quantized, else the weight's dtype; for stats and tests.
  std::string stored_as() const;

  // The managed forward: weight and bias are the layer's current Parameters (autograd inputs). It refreshes
  // the layer first, unless `refreshed` says that this call just did (see Refreshed).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     std::optional<Refreshed> refreshed = std::nullopt);

  // Used by the autograd functions.
  at::Tensor compute_forward(const at::Tensor& x);
  std::array<at::Tensor, 3> compute_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                             const std::vector<std::int64_t>& x_sizes, bool x_col_major,
                                             bool x_fused, const at::Tensor& weight, const at::Tensor& bias,
                                             std::array<bool, 3> needs);

  // LAYERSTREAM_HOST_DTYPE=lossless and a Parameter that holds nothing but the packed bytes
  // (packed_weight.py). A weight packed losslessly whose Parameter still holds its plain values: the
  // host view of the packed bytes (its storage holds the block), their spec and the weight's shape, for
  // the caller to turn the Parameter into a PackedWeight; nullopt otherwise.
  struct PackedBytes {
    at::Tensor codes;
    LosslessSpec spec;
    std::vector<std::int64_t> sizes;
  };
  std::optional<PackedBytes> packed_weight_to_wrap();
  // torch.utils.swap_tensors refuses a TensorImpl that anything holds weakly, as the layer holds its
  // Parameter's: the caller forgets it before swapping the Parameter's contents (plain <-> PackedWeight),
  // then adopts what the Parameter is after the swap (a PackedWeight of this layer's packed bytes: its plain
  // host copy is no longer counted).
  void forget_weight_parameter();
  void adopt_weight_parameter(const at::Tensor& weight);
  // Whether the layer holds the weight Parameter as a PackedWeight, and that `weight` is it.
  bool holds_packed_parameter(const at::Tensor& weight);
  // Whether LAYERSTREAM_HOST_DTYPE=lossless takes this layer's weight when it is frozen.
  bool lossless_takes_weight() const { return takes_.lossless; }

  // The stored form pack() gave the weight: plain, or float8-host or lossless-bf16 where LAYERSTREAM_HOST_DTYPE
  // takes a frozen weight (an entry of stored_forms()). nullptr for a layer packed by pack_quantized or
  // pack_tensors, whose form is its recogniser's.
  const StoredForm* weight_form() const { return packed_.weight_form; }
  // Counts the packings (install()): a forward's graph remembers it, and its backward refuses to run
  // after the weights were packed again (replaced), when it would read the new ones.
  std::uint64_t packing() const { return packing_.load(std::memory_order_relaxed); }
  LayerKind kind() const { return kind_; }
  const std::shared_ptr<DeviceState>& state() const { return state_; }
  std::size_t packed_bytes() const;

 private:


  // A new block holding `parts` one after another (each 256-byte aligned; their sizes, strides and dtype
  // set, offsets set here), each filled from its source; `views` gets the host views in that order.
  // `shareable`: frozen contents that may live in the host copy the ranks share (host_share.h).
  // `packed`: how many of the block's bytes hold a packed (compressed) weight (host_memory_counts()).
  // The views' storages and block_.account keep the block and its count.
  // `encode`: fills the first part instead of copying its source (the lossless encoder, straight into the
  // block: no packed copy on the side).
  std::shared_ptr<HostBlockRef> new_block(const std::vector<std::pair<Packed*, at::Tensor>>& parts,
                                          std::vector<at::Tensor>& views, bool shareable, std::size_t packed = 0,
                                          const std::function<void(char*)>& encode = {});
  // Makes the new block current (the previous registration is left; its bytes stay valid until the
  // engine lets go of them). Caller holds mu_.
  void install(std::shared_ptr<HostBlockRef> block, const StoredForm* form, Packed w, Packed b,
               std::optional<QuantParts> q);
  at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, bool on_device) const;
  // The weight dequantized into the region's scratch (Lease::extra), or found there from an earlier use
  // of the same copy on the same stream; a use on another stream while it is there dequantizes into
  // memory of its own instead (the scratch is written only in the stream order of its readers).
  at::Tensor dequantize_in_scratch(const at::Tensor& codes, const at::Tensor& scale, const Lease& lease,
                                   at::Device where, StreamHandle consumer);
  // Scratch to ask of the engine for this layer: its dequantized weight, where the core dequantizes it
  // (a quantized layer on the simulator or on CUDA), else 0. Caller holds mu_; install() keeps it in
  // registered_.
  std::size_t scratch_bytes_locked() const;
  // For a losslessly packed layer: the engine's hook that decodes each ring copy into its scratch on the
  // engine's derive stream (none for other layers).
  TransferEngine::FillHook fill_hook_locked() const;
  // Whether this process device can decode losslessly packed weights (says once when it cannot).
  bool lossless_decoder_here() const;
  // The weight's shape: its codes' for a quantized one, the packed weight's for a losslessly packed one.
  std::vector<std::int64_t> weight_shape() const;
  // forward() and forward_frozen() after their checks: `weight` undefined for a quantized layer.
  at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
  at::Tensor compute_on_host(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) const;

  // Runs `fn(view, on_host, lease, consumer)` with the layer's block fetched onto the device
  // (view(packed) is the tensor at that place of the region) and releases the region after.
  template <typename Fn>
  auto with_region(Fn&& fn);
  // Runs `fn(weight_view, bias_view)` (the weight dequantized when it is stored as codes).
  template <typename Fn>
  auto with_device_weights(Fn&& fn);
  TransferEngine& registered_engine();
  // The engine this layer is registered in, or nullptr (not yet, or the engine was rebuilt since).
  TransferEngine* engine_if_registered();
  // Copies a gradient computed on the device into a new host tensor for autograd to take as the weight's
  // (is_bias: the bias's) gradient. The copy overlaps the rest of backward where nothing reads the
  // gradient before backward ends; otherwise it is joined before it is returned.
  at::Tensor grad_to_host(at::Tensor grad, const at::Tensor& param, bool is_bias);
  static bool matches(const Packed& p, const at::Tensor& t);
  // Counts `bytes` as this layer's pageable host memory (host_memory_counts()) in place of what it counted.
  // Caller holds mu_ (or is the destructor).
  void count_pageable_locked(std::int64_t bytes);

  // The arena block the layer holds, and the host memory it counts for itself (host_memory_counts()).
  struct HeldBlock {
    std::shared_ptr<HostBlockRef> ref;
    std::shared_ptr<void> account;      // counts `ref` in host_memory_counts() while anything holds it
    std::shared_ptr<void> new_account;  // new_block()'s, until install() takes it
    std::int64_t pageable = 0;          // the plain Parameter copy counted as pageable for this layer
  };
  // What the block holds, and the Parameters (or tensors) it was packed from.
  struct Contents {
    const StoredForm* weight_form = nullptr;  // weight_form()
    Packed weight, bias;
    std::optional<QuantParts> quant;
    std::vector<Packed> tensors;  // pack_tensors(): the layer's own tensors, in order
    bool weight_tied = false;     // pack(tied): the Parameter's data lies in another layer's block
  };
  // What LAYERSTREAM_HOST_DTYPE does with the weight, as the last pack() found it.
  struct HostDtypeTakes {
    bool compress_frozen = false;  // it takes this weight (packed again once frozen)
    bool lossless = false;         // lossless_takes_weight()
  };
  // The layer's registration in its DeviceState's current engine (registered_engine()).
  struct Registration {
    std::uint64_t generation = 0;  // engine generation the layer is registered in
    LayerId id = 0;
    std::size_t scratch = 0;  // scratch_bytes_locked() of the current block, asked of the engine
    // The resident bytes (its block's) the layer held when install() took it out to pack it again (a weight
    // replaced or written after the budget planned), else 0: registered_engine() makes the new block
    // resident in its place where it needs no more than that.
    std::size_t resident_before = 0;
  };
  // dequantize_in_scratch(): the copy (Lease::fill) whose codes the scratch holds dequantized, and the
  // stream that wrote them. Guarded by `mu`, held while the write is enqueued.
  struct DequantScratch {
    std::mutex mu;
    std::uint64_t fill = 0;
    void* stream = nullptr;
  };

  std::shared_ptr<DeviceState> state_;
  LayerKind kind_;
  ConvParams conv_;
  std::mutex mu_;  // held while packing or registering: block_, packed_, takes_ and registered_ change under it
  HeldBlock block_;
  Contents packed_;
  HostDtypeTakes takes_;
  Registration registered_;
  std::atomic<std::uint64_t> packing_{0};
  // A trainable weight or bias (set at each forward): its device copy is made again at every use. An
  // optimizer's step bumps the Parameter's version, but a write through .data (AI-Toolkit's EMA swap,
  // copy_to/restore) does not, and nothing else tells a reused copy from a stale one.
  std::atomic<bool> fresh_each_use_{false};
  DequantScratch dequant_scratch_;
};

}  // namespace layerstream::torchglue
