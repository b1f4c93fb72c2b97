// The VC++ runtime check of layerstream's Windows extensions (both modules call it first at import).
//
// An extension compiled with MSVC's STL 14.40 or newer needs msvcp140.dll 14.40 or newer: older ones (an old
// "Visual C++ Redistributable" on the PC, Wine's built-in DLL) lay out std::mutex differently and crash or
// compute wrong results far from the cause. This reads the file version of the msvcp140.dll the process
// loaded and returns the refusal, naming the fix, when it is older than the STL the extension was built with.
// Nothing on other platforms, nor for builds with another STL.
#pragma once

#include <string>

#if defined(_WIN32) && defined(_MSVC_STL_UPDATE)
#define WIN32_LEAN_AND_MEAN
#define NOMINMAX
#include <windows.h>

#include <cstdint>
#include <vector>

#pragma comment(lib, "version.lib")
#endif

namespace layerstream::vc_runtime {

// The oldest msvcp140.dll (major, minor) that an STL of this build works with.
constexpr unsigned kNeedMajor = 14;
constexpr unsigned kNeedMinor = 40;

// "" when the loaded msvcp140.dll is new enough (or the check does not apply); else the message.
inline std::string refusal() {
#if defined(_WIN32) && defined(_MSVC_STL_UPDATE)
  HMODULE module = GetModuleHandleW(L"msvcp140.dll");
  if (module == nullptr) return "";  // the STL linked statically: nothing to check
  wchar_t path[MAX_PATH * 2];
  const DWORD length = GetModuleFileNameW(module, path, static_cast<DWORD>(sizeof path / sizeof path[0]));
  if (length == 0) return "";
  DWORD ignored = 0;
  const DWORD size = GetFileVersionInfoSizeW(path, &ignored);
  unsigned major = 0, minor = 0, build = 0;
  if (size != 0) {
    std::vector<std::uint8_t> info(size);
    VS_FIXEDFILEINFO* fixed = nullptr;
    UINT fixed_size = 0;
    if (GetFileVersionInfoW(path, 0, size, info.data()) &&
        VerQueryValueW(info.data(), L"\\", reinterpret_cast<void**>(&fixed), &fixed_size) && fixed != nullptr) {
      major = HIWORD(fixed->dwFileVersionMS);
      minor = LOWORD(fixed->dwFileVersionMS);
      build = HIWORD(fixed->dwFileVersionLS);
    }
  }
  if (major > kNeedMajor || (major == kNeedMajor && minor >= kNeedMinor)) return "";
  std::string where(length, '?');
  for (DWORD i = 0; i < length; ++i) where[i] = path[i] < 128 ? static_cast<char>(path[i]) : '?';
  const std::string found = major == 0 ? std::string("of no readable version")
                                       : std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(build);
  return "layerstream needs the Microsoft Visual C++ Redistributable " + std::to_string(kNeedMajor) + "." +
         std::to_string(kNeedMinor) + " or newer, but this process loaded msvcp140.dll " + found + " (" + where +
         "). Install the current \"Microsoft Visual C++ Redistributable for Visual Studio 2015-2022\" (x64) "
         "from Microsoft (https://aka.ms/vs/17/release/vc_redist.x64.exe), or remove the older msvcp140.dll "
         "that the program's folder or PATH puts first, then start Python again.";
#else
  return "";
#endif
}

}  // namespace layerstream::vc_runtime
