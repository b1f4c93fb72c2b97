#include "setting_text.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "layerstream/settings.h"

namespace layerstream {
namespace setting_text {

// Digits only (no sign, space or exponent), within 64 bits; nullopt otherwise.
std::optional<std::uint64_t> digits(const std::string& text) {
  if (text.empty()) return std::nullopt;
  std::uint64_t n = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const std::uint64_t d = static_cast<std::uint64_t>(c - '0');
    if (n > (std::numeric_limits<std::uint64_t>::max() - d) / 10) return std::nullopt;
    n = n * 10 + d;
  }
  return n;
}

std::optional<std::uint64_t> whole(const std::string& text, std::uint64_t least, std::uint64_t most) {
  const std::optional<std::uint64_t> n = digits(text);
  return n && *n >= least && *n <= most ? n : std::nullopt;
}

std::optional<std::size_t> mib(const std::string& text, std::uint64_t least) {
  const std::optional<std::uint64_t> n = whole(text, least, kMostMiB);
  return n ? std::optional<std::size_t>(static_cast<std::size_t>(*n) * kMiB) : std::nullopt;
}

// A plain decimal number (digits, one point, an exponent; no sign, hex, inf or nan) that is finite;
// `rest` receives what follows it (a unit). nullopt when the text does not start with one.
std::optional<double> decimal(const std::string& text, std::string& rest) {
  if (text.empty() || !(std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.')) return std::nullopt;
  if (text.find_first_of("xX") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(v)) return std::nullopt;
  rest = end;
  return v;
}

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

std::optional<bool> switch_of(const std::string& text) {
  const std::string v = lower(text);
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  return std::nullopt;
}

std::string on_off(bool on) { return on ? "1" : "0"; }
std::string mib_text(std::size_t bytes) { return std::to_string(bytes / kMiB); }
std::string mib_text(const std::optional<std::size_t>& bytes) { return bytes ? mib_text(*bytes) : std::string(); }
std::string seconds_text(double s) {
  char out[32];
  for (int digits = 1; digits <= 17; ++digits) {  // the fewest that read back as `s`
    std::snprintf(out, sizeof out, "%.*g", digits, s);
    if (std::strtod(out, nullptr) == s) break;
  }
  return out;
}

// A size's unit, case-insensitive, as a power of 1024 (k, m, g, t with or without b or ib), or nullopt.
std::optional<double> binary_unit(const std::string& text) {
  std::string unit = lower(text);
  if (unit.empty() || unit == "b") return 1.0;
  if (unit.size() >= 2 && unit.compare(unit.size() - 2, 2, "ib") == 0) unit.resize(unit.size() - 2);
  else if (unit.size() >= 2 && unit.back() == 'b') unit.pop_back();
  const std::string prefixes = "kmgt";
  if (unit.size() != 1 || prefixes.find(unit[0]) == std::string::npos) return std::nullopt;
  return std::pow(1024.0, static_cast<double>(prefixes.find(unit[0]) + 1));
}

}  // namespace setting_text

using namespace setting_text;

std::optional<VramBudget> VramBudget::parse(const std::string& text) {
  VramBudget b;
  const std::string v = lower(text);
  if (v.empty() || v == "min") return b;  // the memory-first mode
  b.enabled = true;
  if (v == "auto") {
    b.automatic = true;
    return b;
  }
  std::string unit;
  const std::optional<double> number = decimal(v, unit);
  const std::size_t start = unit.find_first_not_of(' ');  // "24 GiB": spaces before the unit, not after a number
  if (!number || (!unit.empty() && start == std::string::npos)) return std::nullopt;
  const std::optional<double> scale = binary_unit(unit.substr(start == std::string::npos ? 0 : start));
  if (!scale) return std::nullopt;
  const double bytes = *number * *scale;
  if (bytes < static_cast<double>(kMiB) || bytes > static_cast<double>(kMostMiB) * static_cast<double>(kMiB)) {
    return std::nullopt;
  }
  b.bytes = static_cast<std::size_t>(bytes);
  return b;
}

}  // namespace layerstream
