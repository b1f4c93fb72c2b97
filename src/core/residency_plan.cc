#include "layerstream/residency_plan.h"

namespace layerstream {

std::vector<bool> spread_residency(const std::vector<std::size_t>& bytes, std::size_t room) {
  std::vector<bool> keep(bytes.size(), false);
  long double total = 0;
  for (std::size_t b : bytes) total += static_cast<long double>(b);
  if (total == 0) return keep;
  const long double share = static_cast<long double>(room) / total;  // the fraction of bytes that fits
  std::size_t kept = 0;
  long double seen = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    seen += static_cast<long double>(bytes[i]);
    if (kept + bytes[i] <= room && static_cast<long double>(kept + bytes[i]) <= share * seen) {
      keep[i] = true;
      kept += bytes[i];
    }
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {  // what the sweep's rounding left
    if (!keep[i] && kept + bytes[i] <= room) {
      keep[i] = true;
      kept += bytes[i];
    }
  }
  return keep;
}

}  // namespace layerstream
