#include "layerstream/host_form.h"

namespace layerstream {

namespace {
constexpr const char* kPrefix = "layerstream: LAYERSTREAM_HOST_DTYPE=auto: ";
constexpr const char* kHowToChoose =
    " (LAYERSTREAM_HOST_DTYPE=same or =lossless chooses explicitly)";
}  // namespace

HostFormChoice choose_auto_host_form(const HostFormFacts& facts) {
  HostFormChoice c;
  if (!facts.decoder) {
    c.reason = std::string(kPrefix) +
               "weights stored as they are: this build has no decoder for packed weights on this device "
               "(a CPU-only build of layerstream or of torch)" + kHowToChoose;
    return c;
  }
  if (!facts.simulated && facts.encoder_threads < kAutoLosslessLeastThreads) {
    c.reason = std::string(kPrefix) + "weights stored as they are: the encoder has " +
               std::to_string(facts.encoder_threads) + " CPU thread(s), fewer than " +
               std::to_string(kAutoLosslessLeastThreads) + ", so packing would slow the attach" + kHowToChoose;
    return c;
  }
  c.lossless = true;
  c.reason = std::string(kPrefix) + "frozen bfloat16 weights of " +
             std::to_string(kAutoLosslessLeastBytes >> 20) +
             " MiB or more packed lossless (exact: about 0.75x their bytes in host RAM and over the bus, "
             "decoded on the device bit for bit); other weights stored as they are" + kHowToChoose;
  return c;
}

bool auto_packs_weight(const HostFormChoice& choice, bool is_bfloat16, std::size_t bytes) {
  return choice.lossless && is_bfloat16 && bytes >= kAutoLosslessLeastBytes;
}

}  // namespace layerstream
