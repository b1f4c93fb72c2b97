// LAYERSTREAM_HOST_DTYPE=auto's rule (host_form.h): each fact that makes it store weights as they are, and
// the weights it packs, with the line it logs.
#include <gtest/gtest.h>

#include "layerstream/host_form.h"

namespace layerstream {
namespace {

HostFormFacts gpu(unsigned threads) {
  HostFormFacts f;
  f.decoder = true;
  f.encoder_threads = threads;
  return f;
}

TEST(HostForm, AGpuWithADecoderAndEnoughThreadsPacksBfloat16WeightsOfAMibOrMore) {
  const HostFormChoice c = choose_auto_host_form(gpu(kAutoLosslessLeastThreads));
  EXPECT_TRUE(c.lossless);
  EXPECT_EQ(c.reason,
            "layerstream: LAYERSTREAM_HOST_DTYPE=auto: frozen bfloat16 weights of 1 MiB or more packed lossless "
            "(exact: about 0.75x their bytes in host RAM and over the bus, decoded on the device bit for bit); "
            "other weights stored as they are (LAYERSTREAM_HOST_DTYPE=same or =lossless chooses explicitly)");
  EXPECT_TRUE(auto_packs_weight(c, true, std::size_t{1} << 20));
  EXPECT_FALSE(auto_packs_weight(c, true, (std::size_t{1} << 20) - 1));
  EXPECT_FALSE(auto_packs_weight(c, false, std::size_t{1} << 30));  // float32, float16: as they are
}

TEST(HostForm, NoDecoderStoresEveryWeightAsItIs) {
  HostFormFacts f = gpu(64);
  f.decoder = false;
  const HostFormChoice c = choose_auto_host_form(f);
  EXPECT_FALSE(c.lossless);
  EXPECT_EQ(c.reason,
            "layerstream: LAYERSTREAM_HOST_DTYPE=auto: weights stored as they are: this build has no decoder for "
            "packed weights on this device (a CPU-only build of layerstream or of torch) "
            "(LAYERSTREAM_HOST_DTYPE=same or =lossless chooses explicitly)");
  EXPECT_FALSE(auto_packs_weight(c, true, std::size_t{1} << 30));
}

TEST(HostForm, AGpuHostWithFewThreadsStoresWeightsAsTheyAre) {
  const HostFormChoice c = choose_auto_host_form(gpu(kAutoLosslessLeastThreads - 1));
  EXPECT_FALSE(c.lossless);
  EXPECT_EQ(c.reason,
            "layerstream: LAYERSTREAM_HOST_DTYPE=auto: weights stored as they are: the encoder has 3 CPU "
            "thread(s), fewer than 4, so packing would slow the attach "
            "(LAYERSTREAM_HOST_DTYPE=same or =lossless chooses explicitly)");
  EXPECT_FALSE(auto_packs_weight(c, true, std::size_t{1} << 30));
}

TEST(HostForm, TheSimulatorPacksWhateverTheThreads) {
  HostFormFacts f = gpu(1);
  f.simulated = true;
  EXPECT_TRUE(choose_auto_host_form(f).lossless);
}

}  // namespace
}  // namespace layerstream
