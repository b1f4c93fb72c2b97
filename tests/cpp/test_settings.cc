// Settings (settings.h): each setting declared once in settings.cc's table. The defaults Settings::parse gives
// are the declared ones, every value a setting holds reads back as text its own parser takes, and a default
// that is a description ("no cap") leaves the setting unset.
#include <gtest/gtest.h>

#include <string>

#include "layerstream/check.h"
#include "layerstream/settings.h"

namespace layerstream {
namespace {

TEST(Settings, AnUnsetSettingHoldsItsDeclaredDefault) {
  const Settings defaults = Settings::parse({});
  int values = 0, descriptions = 0;
  for (const SettingSpec& spec : Settings::table()) {
    if (!spec.native) continue;
    const std::string shown = Settings::text_of(defaults, spec.name);
    // The declared default given explicitly: a value parses to the same setting; a description is refused.
    const bool is_value = !Settings::refusal(spec.name, spec.default_value).has_value() &&
                          std::string(spec.default_value).find(' ') == std::string::npos;
    if (is_value) {
      ++values;
      const Settings given = Settings::parse({{spec.name, spec.default_value}});
      EXPECT_EQ(shown, Settings::text_of(given, spec.name)) << spec.name;
      EXPECT_FALSE(shown.empty()) << spec.name;
    } else {
      ++descriptions;
      EXPECT_EQ(shown, "") << spec.name << ": its default '" << spec.default_value << "' describes it unset";
    }
  }
  EXPECT_EQ(values, 17);       // every native setting but the five below
  EXPECT_EQ(descriptions, 5);  // RING_MB, SHARE_TOKEN, PINNED_CAP_MB, SIM_FAULTS, SIM_PINNABLE_MB
}

TEST(Settings, TheDefaultsAreTheDeclaredOnesNotTheStructsZeros) {
  const Settings s = Settings::parse({});
  EXPECT_TRUE(s.prefetch);
  EXPECT_EQ(s.prefetch_layers, 8u);
  EXPECT_EQ(s.chunk_bytes, std::size_t{256} << 20);
  EXPECT_EQ(s.share_timeout_s, 600.0);
  EXPECT_EQ(s.log_every, 100u);
  EXPECT_TRUE(s.ostris_decode);
  EXPECT_EQ(s.host_dtype, HostDtype::kAuto);
  EXPECT_EQ(s.vram_peak, VramPeak::kCycles);
  EXPECT_TRUE(s.vram_budget.enabled && s.vram_budget.automatic);  // auto
  EXPECT_EQ(s.sim_device_bytes, std::size_t{64} << 30);
  EXPECT_FALSE(s.ring_bytes || s.pinned_cap_bytes || s.share_token || s.sim_faults || s.sim_pinnable_bytes);
}

TEST(Settings, EveryValueReadsBackAsTextItsParserTakes) {
  for (const SettingSpec& spec : Settings::table()) {
    if (!spec.native) continue;
    const Settings s = Settings::parse({{spec.name, spec.example}});
    const std::string shown = Settings::text_of(s, spec.name);
    ASSERT_FALSE(shown.empty()) << spec.name;
    EXPECT_FALSE(Settings::refusal(spec.name, shown).has_value()) << spec.name << "=" << shown;
    EXPECT_EQ(Settings::text_of(Settings::parse({{spec.name, shown}}), spec.name), shown) << spec.name;
  }
  EXPECT_EQ(Settings::text_of(Settings::parse({{"LAYERSTREAM_VRAM_BUDGET", "24GiB"}}), "LAYERSTREAM_VRAM_BUDGET"),
            std::to_string(std::size_t{24} << 30));
  EXPECT_EQ(Settings::text_of(Settings::parse({{"LAYERSTREAM_SHARE_TIMEOUT_S", "1.5"}}), "LAYERSTREAM_SHARE_TIMEOUT_S"),
            "1.5");
  EXPECT_EQ(Settings::text_of(Settings::parse({}), "LAYERSTREAM_LOG"), "");  // read by the Python package
  EXPECT_THROW(Settings::text_of(Settings::parse({}), "LAYERSTREAM_RING"), InvalidArgument);
}

}  // namespace
}  // namespace layerstream
