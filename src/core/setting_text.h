// The text of LAYERSTREAM_* values (settings.cc): the parsers' primitives (whole numbers, MiB, decimals,
// switches, binary units) and the showers' (a value back as the text its parser takes). Pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace layerstream::setting_text {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::uint64_t kMostMiB = std::uint64_t{1} << 30;  // 1 PiB: more than any host or device holds

// Digits only (no sign, space or exponent), within 64 bits; nullopt otherwise.
std::optional<std::uint64_t> digits(const std::string& text);
// A whole number from `least` to `most`.
std::optional<std::uint64_t> whole(const std::string& text, std::uint64_t least, std::uint64_t most);
// A whole number of MiB from `least` to kMostMiB, in bytes.
std::optional<std::size_t> mib(const std::string& text, std::uint64_t least);
// A plain decimal number (digits, one point, an exponent; no sign, hex, inf or nan) that is finite;
// `rest` receives what follows it (a unit). nullopt when the text does not start with one.
std::optional<double> decimal(const std::string& text, std::string& rest);
std::string lower(std::string text);
// 1, true, on, yes or 0, false, off, no (any case).
std::optional<bool> switch_of(const std::string& text);
// A size's unit, case-insensitive, as a power of 1024 (k, m, g, t with or without b or ib), or nullopt.
std::optional<double> binary_unit(const std::string& text);

std::string on_off(bool on);
std::string mib_text(std::size_t bytes);
std::string mib_text(const std::optional<std::size_t>& bytes);  // "" when unset
std::string seconds_text(double s);                              // as few digits as give `s` back

}  // namespace layerstream::setting_text
