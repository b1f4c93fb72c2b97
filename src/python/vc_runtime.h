// The VC++ runtime check of layerstream's Windows extensions (both modules call it first at import).
//
// An extension compiled with MSVC's STL 14.40 or newer needs msvcp140.dll 14.40 or newer: older ones (an old
// "Visual C++ Redistributable" on the PC, Wine's built-in DLL) lay out std::mutex differently and crash or
// compute wrong results far from the cause. This reads the file version of the msvcp140.dll the process
// loaded (and of vcruntime140.dll) and returns the refusal, naming the fix, when it is too old.
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

// The VC++ runtime DLLs checked, each with the oldest (major, minor) this build works with: msvcp140.dll must
// be as new as the STL the extension was compiled with (14.40 changed std::mutex); vcruntime140.dll must be
// Microsoft's (Wine's built-in one, which has no version resource, breaks autograd in backward).
struct Need {
  const wchar_t* dll;
  const char* name;
  unsigned major, minor;
};
constexpr Need kNeeds[] = {{L"msvcp140.dll", "msvcp140.dll", 14, 40}, {L"vcruntime140.dll", "vcruntime140.dll", 14, 0}};

// "" when every loaded runtime DLL is new enough (or the check does not apply); else the message.
inline std::string refusal() {
#if defined(_WIN32) && defined(_MSVC_STL_UPDATE)
  for (const Need& need : kNeeds) {
    HMODULE module = GetModuleHandleW(need.dll);
    if (module == nullptr) continue;  // linked statically: nothing to check
    wchar_t path[MAX_PATH * 2];
    const DWORD length = GetModuleFileNameW(module, path, static_cast<DWORD>(sizeof path / sizeof path[0]));
    if (length == 0) continue;
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
    if (major > need.major || (major == need.major && minor >= need.minor)) continue;
    std::string where(length, '?');
    for (DWORD i = 0; i < length; ++i) where[i] = path[i] < 128 ? static_cast<char>(path[i]) : '?';
    const std::string found = major == 0 ? std::string("of no readable version")
                                         : std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(build);
    return "layerstream needs the Microsoft Visual C++ Redistributable 14.40 or newer, but this process loaded " +
           std::string(need.name) + " " + found + " (" + where +
           "). Install the current \"Microsoft Visual C++ Redistributable for Visual Studio 2015-2022\" (x64) "
           "from Microsoft (https://aka.ms/vs/17/release/vc_redist.x64.exe), or remove the older " + need.name +
           " that the program's folder or PATH puts first, then start Python again.";
  }
#endif
  return "";
}

}  // namespace layerstream::vc_runtime
