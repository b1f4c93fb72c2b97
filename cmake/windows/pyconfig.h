/* pyconfig.h for building extension modules of the official Windows x64 CPython 3.12 (python.org's
 * build, MSVC ABI) with clang-cl on another host. Only what the public headers ask of an extension's build:
 * the platform, the type sizes of the LLP64 model, and that the API is imported from python312.dll.
 * Used by scripts/windows/sysroot.sh in place of the host's own pyconfig.h. */
#ifndef LAYERSTREAM_WINDOWS_PYCONFIG_H
#define LAYERSTREAM_WINDOWS_PYCONFIG_H

#if !defined(_WIN64) || !defined(_MSC_VER)
#error "this pyconfig.h is for Windows x64 builds with an MSVC-compatible compiler (cl or clang-cl)"
#endif

#include <io.h>
#include <basetsd.h>
#include <limits.h>

#define MS_WIN64
#define MS_WIN32
#define MS_WINDOWS
#define NT_THREADS
#define WITH_THREAD
#define PLATFORM "win32"
#define COMPILER "[clang-cl]"

/* The interpreter lives in python312.dll: its functions and data are imported. */
#define Py_ENABLE_SHARED 1
#define HAVE_DECLSPEC_DLL

/* LLP64: long is 32 bits, pointers and size_t 64. */
#define SIZEOF_SHORT 2
#define SIZEOF_INT 4
#define SIZEOF_LONG 4
#define SIZEOF_LONG_LONG 8
#define SIZEOF_FLOAT 4
#define SIZEOF_DOUBLE 8
#define SIZEOF_VOID_P 8
#define SIZEOF_SIZE_T 8
#define SIZEOF_TIME_T 8
#define SIZEOF_WCHAR_T 2
#define SIZEOF_OFF_T 4
#define SIZEOF_FPOS_T 8
#define SIZEOF_HKEY 8
#define SIZEOF__BOOL 1
#define ALIGNOF_SIZE_T 8
#define ALIGNOF_MAX_ALIGN_T 8
#define HAVE_LONG_LONG 1
#define PY_LONG_LONG long long
#define PYLONG_BITS_IN_DIGIT 30
#define DOUBLE_IS_LITTLE_ENDIAN_IEEE754 1

/* Windows has no ssize_t; CPython's own Windows build defines it as the 64-bit Py_ssize_t. */
typedef __int64 Py_ssize_t;
#define HAVE_PY_SSIZE_T 1
#define PY_SSIZE_T_MAX _I64_MAX
typedef Py_ssize_t ssize_t;
#define HAVE_SSIZE_T 1
#define pid_t int

#define HAVE_WCHAR_H 1
#define HAVE_STDDEF_H 1
#define HAVE_SYS_STAT_H 1
#define HAVE_IO_H 1
#define HAVE_PROCESS_H 1
#define HAVE_DIRECT_H 1

#endif /* LAYERSTREAM_WINDOWS_PYCONFIG_H */
