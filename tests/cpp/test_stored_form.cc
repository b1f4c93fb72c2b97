#include "layerstream/stored_form.h"

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

namespace layerstream {
namespace {

TEST(StoredForm, NamesAreUniqueAndFound) {
  std::set<std::string_view> names;
  for (const StoredForm& f : stored_forms()) {
    EXPECT_TRUE(names.insert(f.name).second) << f.name;
    EXPECT_EQ(&stored_form(f.name), &f);
    EXPECT_FALSE(f.library.empty()) << f.name;
    EXPECT_FALSE(f.path.empty()) << f.name;
    EXPECT_FALSE(f.summary.empty()) << f.name;
  }
  EXPECT_GE(names.size(), 8u);
}

TEST(StoredForm, UnknownNameSaysWhichAreKnown) {
  try {
    stored_form("gguf-q4");
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("no stored form named 'gguf-q4' (known: plain, ", 0), 0u) << what;
  }
}

TEST(StoredForm, BlockLayoutAlignsEachPart) {
  const BlockLayout l = block_layout({1000, 4, 0, 300});
  ASSERT_EQ(l.offsets.size(), 4u);
  EXPECT_EQ(l.offsets[0], 0u);
  EXPECT_EQ(l.offsets[1], 1024u);
  EXPECT_EQ(l.offsets[2], 1280u);
  EXPECT_EQ(l.offsets[3], 1280u);
  EXPECT_EQ(l.total, 1580u);
  EXPECT_EQ(block_layout({}).total, 0u);
}

TEST(StoredForm, ScratchOnlyForFormsDecodedIntoIt) {
  EXPECT_EQ(decoded_scratch_bytes(stored_form("plain"), 100, 2), 0u);
  EXPECT_EQ(decoded_scratch_bytes(stored_form("lossless-bf16"), 100, 2), 200u);
  EXPECT_EQ(decoded_scratch_bytes(stored_form("quanto-qbytes"), 100, 4), 400u);
  EXPECT_EQ(decoded_scratch_bytes(stored_form("ostris"), 100, 2), 0u);
  EXPECT_EQ(decoded_scratch_bytes(stored_form("generic"), 100, 2), 0u);
}

}  // namespace
}  // namespace layerstream
