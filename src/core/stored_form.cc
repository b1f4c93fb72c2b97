#include "layerstream/stored_form.h"

#include <stdexcept>
#include <string>

namespace layerstream {

const std::vector<StoredForm>& stored_forms() {
  using D = DeviceDecode;
  using P = ArenaParts;
  static const std::vector<StoredForm> forms = {
      {"plain", "torch", "streamed", D::kAsStored, P::kWeightBias,
       "a dense tensor (any dtype), streamed as it is"},
      {"float8-host", "layerstream", "streamed", D::kDequantize, P::kCodesScaleBias,
       "LAYERSTREAM_HOST_DTYPE=float8_*: a frozen weight kept as float8 codes with a float32 scale per output row"},
      {"lossless-bf16", "layerstream", "streamed", D::kLossless, P::kWeightBias,
       "LAYERSTREAM_HOST_DTYPE=lossless: a frozen bfloat16 weight packed exactly (lossless.h)"},
      {"quanto-qbytes", "optimum-quanto", "quantized", D::kDequantize, P::kCodesScaleBias,
       "optimum-quanto's (Weight)QBytesTensor, qint8/qfloat8: codes and a scale per row or per tensor"},
      {"torchao-float8", "torchao", "quantized", D::kDequantize, P::kCodesScaleBias,
       "torchao's Float8Tensor, weight-only: float8 codes and a scale per row or per tensor"},
      {"torchao-affine-float8", "torchao", "quantized", D::kDequantize, P::kCodesScaleBias,
       "torchao's AffineQuantizedTensor with Float8AQTTensorImpl: float8 codes and a scale per row or per tensor"},
      {"ostris", "ai-toolkit", "ostris", D::kOwnForward, P::kModuleTensors,
       "AI-Toolkit's OstrisLinear: its quantizer's buffers as stored; uintx, orbit, orbit-VQ, nvfp4, convrot "
       "decoded by layerstream's kernels where proven equal (ostris_fast.h), others by the layer's own forward"},
      {"bnb-4bit", "bitsandbytes", "bnb-4bit", D::kOwnForward, P::kModuleTensors,
       "bitsandbytes' Linear4bit (nf4, fp4): packed 4-bit codes and the quant_state's tensors (absmax, code, "
       "nested statistics), run by bitsandbytes' own forward"},
      {"generic", "any", "generic", D::kLibraryMove, P::kNone,
       "anything else: moved as stored and dequantized by its library at every call (no prefetch)"},
  };
  return forms;
}

const StoredForm& stored_form(std::string_view name) {
  for (const StoredForm& f : stored_forms()) {
    if (f.name == name) return f;
  }
  std::string known;
  for (const StoredForm& f : stored_forms()) known += (known.empty() ? "" : ", ") + std::string(f.name);
  throw std::invalid_argument("no stored form named '" + std::string(name) + "' (known: " + known + ")");
}

BlockLayout block_layout(const std::vector<std::size_t>& bytes) {
  BlockLayout layout;
  for (const std::size_t b : bytes) {
    const std::size_t offset = (layout.total + kStoredPartAlign - 1) / kStoredPartAlign * kStoredPartAlign;
    layout.offsets.push_back(offset);
    layout.total = offset + b;
  }
  return layout;
}

std::size_t decoded_scratch_bytes(const StoredForm& form, std::size_t count, std::size_t value_bytes) {
  const bool into_scratch = form.decode == DeviceDecode::kDequantize || form.decode == DeviceDecode::kLossless;
  return into_scratch ? count * value_bytes : 0;
}

}  // namespace layerstream
