#include <gtest/gtest.h>

#include "layerstream/log.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Fallback warnings are expected in error-path tests; keep the output readable.
  layerstream::set_log_sink([](layerstream::LogLevel, const std::string&) {});
  return RUN_ALL_TESTS();
}
