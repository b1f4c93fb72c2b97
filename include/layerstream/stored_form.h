// The stored forms of a managed layer's weight: how its bytes lie in the pinned arena, how a call gets the
// weight's values from them on the device, how many bytes that takes, and how the form names itself in logs
// and stats(). One table (stored_forms()) lists every form; the torch glue's recognisers (one per source
// library, src/torch/layer_kinds.cc) map a module to one entry, and everything downstream asks the entry.
// Adding a format is one entry here, one recogniser there, and (when its decode is new) its kernel.
//
// Plain data, no memory, no streams: entries are constants that live as long as the process.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

namespace layerstream {

// How a call gets the weight's values from the stored bytes on the device.
enum class DeviceDecode : unsigned char {
  kAsStored,     // the bytes are the values: the layer's math runs on them
  kDequantize,   // int8/float8 codes and a scale: the core's dequantize kernel (dequant.h), into scratch
  kLossless,     // losslessly packed bfloat16: the core's lossless decoder (lossless.h), into scratch
  kOwnForward,   // the module's own forward runs on the staged tensors (its library decodes them); OstrisLinear
                 // layouts layerstream knows are decoded by its fused kernels instead (ostris_decode.h)
  kLibraryMove,  // not streamed: moved as stored and dequantized by its library at every call
};

// What one arena block of the layer holds, in block order (each part starts on kStoredPartAlign).
enum class ArenaParts : unsigned char {
  kWeightBias,          // the weight's part (values, codes or packed bytes), then the bias
  kCodesScaleBias,      // codes, their scale, then the bias
  kModuleTensors,       // the tensors the module's own forward reads, in the recogniser's order, then the bias
  kNone,                // nothing in the arena
};

struct StoredForm {
  std::string_view name;     // in logs, stats() and LayerManager.form: "plain", "bnb-nf4", ...
  std::string_view library;  // where such weights come from: "torch", "torchao", "layerstream", ...
  std::string_view path;     // the forward path Python reads as LayerManager.path
  DeviceDecode decode;
  ArenaParts parts;
  std::string_view summary;  // one line: what the bytes are (docs/architecture.md lists these)
};

// Every stored form, each once; names are unique.
const std::vector<StoredForm>& stored_forms();
// The entry named `name`; throws std::invalid_argument naming the known forms when there is none.
const StoredForm& stored_form(std::string_view name);

// Parts of a block start on this boundary.
constexpr std::size_t kStoredPartAlign = 256;
// Where each part of `bytes` starts in a block holding them one after another, and the block's size.
struct BlockLayout {
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
};
BlockLayout block_layout(const std::vector<std::size_t>& bytes);

// The scratch a ring copy of this form needs on the device for its decoded weight: `count` values of
// `value_bytes` each for the forms decoded by layerstream's kernels into scratch, else 0.
std::size_t decoded_scratch_bytes(const StoredForm& form, std::size_t count, std::size_t value_bytes);

}  // namespace layerstream
