# Cross-compiles layerstream for Windows x64 (the MSVC ABI) on Linux: clang-cl and lld-link against the
# sysroot scripts/windows/sysroot.sh assembles (MSVC 14.44 headers and import libs, Windows SDK 10.0.26100).
# Used by scripts/windows/build.sh; LAYERSTREAM_WIN_SYSROOT (or the environment's LSWIN_SYSROOT) names the sysroot.
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_VERSION 10.0)
set(CMAKE_SYSTEM_PROCESSOR AMD64)

if(NOT LAYERSTREAM_WIN_SYSROOT)
  set(LAYERSTREAM_WIN_SYSROOT "$ENV{LSWIN_SYSROOT}")
endif()
if(NOT IS_DIRECTORY "${LAYERSTREAM_WIN_SYSROOT}/msvc/include")
  message(FATAL_ERROR "LAYERSTREAM_WIN_SYSROOT (${LAYERSTREAM_WIN_SYSROOT}) is not a sysroot made by "
                      "scripts/windows/sysroot.sh")
endif()
# try_compile projects see the same sysroot.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES LAYERSTREAM_WIN_SYSROOT)
set(_root "${LAYERSTREAM_WIN_SYSROOT}")

set(CMAKE_C_COMPILER "${_root}/bin/clang-cl")
set(CMAKE_CXX_COMPILER "${_root}/bin/clang-cl")
set(CMAKE_LINKER "${_root}/bin/lld-link")
set(CMAKE_AR "${_root}/bin/llvm-lib")
set(CMAKE_RC_COMPILER "${_root}/bin/llvm-rc")
set(CMAKE_MT "${_root}/bin/llvm-mt")

# The MSVC version clang-cl claims (_MSC_VER 1944, Build Tools 14.44) must be the one of the headers: the STL
# refuses a compiler older than itself.
set(_flags "--target=x86_64-pc-windows-msvc -fms-compatibility-version=19.44 /EHsc")
foreach(_dir msvc/include sdk/include/ucrt sdk/include/um sdk/include/shared)
  string(APPEND _flags " /imsvc \"${_root}/${_dir}\"")
endforeach()
set(CMAKE_C_FLAGS_INIT "${_flags}")
set(CMAKE_CXX_FLAGS_INIT "${_flags}")
set(_link "/libpath:\"${_root}/msvc/lib\" /libpath:\"${_root}/sdk/lib/ucrt\" /libpath:\"${_root}/sdk/lib/um\"")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${_link}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "${_link}")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "${_link}")

set(CMAKE_FIND_ROOT_PATH "${_root}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
