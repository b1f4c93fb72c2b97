// StreamedLayer's codecs: a quantized weight dequantized (the core's kernel or host reference, or torch
// operations), a bfloat16 weight packed losslessly and decoded (host reference, CUDA kernels on torch's
// current stream, or on the engine's derive stream into the ring's scratch through the fill hook).
#include <c10/util/accumulate.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "layerstream/check.h"
#include "layerstream/dequant.h"
#include "layerstream/log.h"
#include "streamed_layer_internal.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace layerstream::torchglue {

using detail::view_of;

namespace {

std::optional<CodeType> code_type_of(at::ScalarType t) {
  if (t == at::kFloat8_e4m3fn) return CodeType::kFloat8E4M3;
  if (t == at::kFloat8_e5m2) return CodeType::kFloat8E5M2;
  if (t == at::kChar) return CodeType::kInt8;
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

std::optional<RealType> real_type_of(at::ScalarType t) {
  if (t == at::kFloat) return RealType::kFloat32;
  if (t == at::kHalf) return RealType::kFloat16;
  if (t == at::kBFloat16) return RealType::kBFloat16;
  return std::nullopt;
}

bool is_real_dtype(at::ScalarType t) { return real_type_of(t).has_value(); }

bool quantized_layout_supported(const at::Tensor& codes, const at::Tensor& scale) {
  return code_type_of(codes.scalar_type()).has_value() && is_real_dtype(scale.scalar_type()) &&
         codes.numel() > 0 && per_row_or_single(scale.sizes(), codes.sizes());
}

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
  return packed_.quant && packed_.quant->lossless ? packed_.quant->sizes : packed_.weight.sizes;
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
  if (packed_.quant->lossless) {  // one decoder, wherever the bytes are (exact: nothing to match upstream's math)
    return lossless_unpack(codes, *packed_.quant->lossless, packed_.quant->sizes);
  }
  // The simulator's "device" copy is host memory: the kernel's host reference computes it, so CI runs the
  // routine the CUDA kernel mirrors. A CPU process device uses torch operations (upstream's math).
  const bool use_core = on_device || state_->mode() == Mode::kSim;
  return dequantize_codes(codes, scale, packed_.quant->math, packed_.quant->result, use_core);
}

at::Tensor StreamedLayer::dequantize_in_scratch(const at::Tensor& codes, const at::Tensor& scale, const Lease& lease,
                                                 at::Device where, StreamHandle consumer) {
  const std::vector<std::int64_t> sizes = weight_shape();
  const std::size_t bytes =
      static_cast<std::size_t>(c10::multiply_integers(sizes)) * c10::elementSize(packed_.quant->result);
  LS_CHECK(lease.extra_bytes >= bytes, "internal: scratch of ", lease.extra_bytes, " bytes for a weight of ", bytes);
  at::Tensor out = at::from_blob(lease.extra, sizes, at::TensorOptions().dtype(packed_.quant->result).device(where));
  const bool on_host = where.is_cpu();
  if (packed_.quant->lossless) {  // decoded on the derive stream before the copy's ready event (fill_hook_locked)
    if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, false);
    state_->note_dequant(DequantUse::kOnCopy);
    return out;
  }
  std::lock_guard<std::mutex> lock(dequant_scratch_.mu);
  // This copy, dequantized on this stream.
  if (lease.fill == dequant_scratch_.fill && consumer.raw == dequant_scratch_.stream) {
    if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, false);
    state_->note_dequant(DequantUse::kReused);
    return out;
  }
  if (lease.fill == dequant_scratch_.fill) {  // there, but written on another stream: do not touch it
    state_->note_dequant(DequantUse::kOwnMemory);
    return dequantize(codes, scale, !on_host);
  }
  // A new copy: its H2D copy waited for every earlier reader of this memory, and the consumer waited for
  // the copy, so the write below is ordered after all of them.
  const std::optional<DequantSpec> spec = core_dequant_spec(codes, scale, packed_.quant->math, packed_.quant->result);
  LS_CHECK(spec.has_value(), "internal: scratch was asked for a weight the core cannot dequantize");
  if (on_host) state_->backend().annotate_host_access(lease.extra, bytes, true);
  run_core_dequant(*spec, codes, scale, out);
  dequant_scratch_.fill = lease.fill;
  dequant_scratch_.stream = consumer.raw;
  state_->note_dequant(DequantUse::kIntoScratch);
  return out;
}

std::size_t StreamedLayer::scratch_bytes_locked() const {
  if (!packed_.quant || state_->mode() == Mode::kCpu) return 0;
  const QuantParts& q = *packed_.quant;
  if (q.lossless) return q.lossless->count * c10::elementSize(q.result);  // pack() checked the decoder
  // The device views have the host views' dtypes, sizes and strides: ask on the host ones, for the device.
  const at::Tensor codes = view_of(block_.ref->data(), packed_.weight, at::kCPU);
  const at::Tensor scale = view_of(block_.ref->data(), q.scale, at::kCPU);
  if (!core_dequant_spec(codes, scale, q.math, q.result)) return 0;
#if !(defined(LAYERSTREAM_WITH_CUDA) && defined(LAYERSTREAM_TORCH_CUDA))
  if (state_->mode() == Mode::kCuda) return 0;  // no kernel: torch operations, into memory of their own
#endif
  return static_cast<std::size_t>(codes.numel()) * c10::elementSize(q.result);
}

TransferEngine::FillHook StreamedLayer::fill_hook_locked() const {
  // Packed weights are decoded on the engine's derive stream right after their copy, beside the next copy
  // and off the compute stream; the consumer then finds them decoded (dequantize_in_scratch).
  if (!packed_.quant || !packed_.quant->lossless || registered_.scratch == 0) return {};
  const LosslessSpec spec = *packed_.quant->lossless;
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

}  // namespace layerstream::torchglue
