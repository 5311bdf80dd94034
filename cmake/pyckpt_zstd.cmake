# Finds the system libzstd and exposes it as the target pyckpt::zstd.
# Order: zstd sources given with PYCKPT_ZSTD_SOURCE (compiled in, for distribution wheels), then
# CMake config package (Debian/Ubuntu/Fedora/conda/brew ship zstdConfig.cmake), then pkg-config,
# then a fatal error that says what to install.
set(PYCKPT_ZSTD_MIN_VERSION 1.4.0)

# zstd sources compiled into the extension (PIC) instead of a system libzstd: a zstd source
# tree (with lib/zstd.h) or a directory holding the single-file zstd.c + zstd.h.
set(PYCKPT_ZSTD_SOURCE "" CACHE PATH "zstd sources to compile into the extension")
set(_pyckpt_zstd_target "")
if(PYCKPT_ZSTD_SOURCE)
  # Distribution wheels: distributions' libzstd.a is often built without -fPIC (Debian's is),
  # so it cannot go into a shared extension; compiling the sources here always can.
  enable_language(C)
  if(EXISTS "${PYCKPT_ZSTD_SOURCE}/zstd.c" AND EXISTS "${PYCKPT_ZSTD_SOURCE}/zstd.h")
    set(_zsrc "${PYCKPT_ZSTD_SOURCE}/zstd.c")
    set(_zinc "${PYCKPT_ZSTD_SOURCE}")
  elseif(EXISTS "${PYCKPT_ZSTD_SOURCE}/lib/zstd.h")
    file(GLOB _zsrc "${PYCKPT_ZSTD_SOURCE}/lib/common/*.c" "${PYCKPT_ZSTD_SOURCE}/lib/compress/*.c"
      "${PYCKPT_ZSTD_SOURCE}/lib/decompress/*.c")
    set(_zinc "${PYCKPT_ZSTD_SOURCE}/lib")
  else()
    message(FATAL_ERROR "PYCKPT_ZSTD_SOURCE=${PYCKPT_ZSTD_SOURCE} holds neither lib/zstd.h (a zstd "
      "source tree) nor zstd.c + zstd.h (the single-file library)")
  endif()
  add_library(pyckpt_zstd_bundled STATIC ${_zsrc})
  target_include_directories(pyckpt_zstd_bundled SYSTEM PUBLIC "${_zinc}")
  # No assembly (portable), no zstd threads (pyckpt runs its own); hidden symbols, so the
  # extension neither exports zstd nor clashes with another copy loaded in the process.
  target_compile_definitions(pyckpt_zstd_bundled PRIVATE ZSTD_DISABLE_ASM=1
    ZSTDLIB_VISIBLE= ZSTDERRORLIB_VISIBLE= ZDICTLIB_VISIBLE=)
  set_target_properties(pyckpt_zstd_bundled PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    C_VISIBILITY_PRESET hidden)
  set(_pyckpt_zstd_target pyckpt_zstd_bundled)
else()
  find_package(zstd ${PYCKPT_ZSTD_MIN_VERSION} CONFIG QUIET)
endif()
if(zstd_FOUND)
  if(PYCKPT_ZSTD_STATIC AND TARGET zstd::libzstd_static)
    set(_pyckpt_zstd_target zstd::libzstd_static)
  elseif(TARGET zstd::libzstd_shared)
    set(_pyckpt_zstd_target zstd::libzstd_shared)
  elseif(TARGET zstd::libzstd)
    set(_pyckpt_zstd_target zstd::libzstd)
  elseif(TARGET zstd::libzstd_static)
    set(_pyckpt_zstd_target zstd::libzstd_static)
  endif()
endif()

if(NOT _pyckpt_zstd_target)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    if(PYCKPT_ZSTD_STATIC)
      pkg_check_modules(PYCKPT_PC_ZSTD QUIET IMPORTED_TARGET GLOBAL STATIC libzstd>=${PYCKPT_ZSTD_MIN_VERSION})
    else()
      pkg_check_modules(PYCKPT_PC_ZSTD QUIET IMPORTED_TARGET GLOBAL libzstd>=${PYCKPT_ZSTD_MIN_VERSION})
    endif()
    if(PYCKPT_PC_ZSTD_FOUND)
      set(_pyckpt_zstd_target PkgConfig::PYCKPT_PC_ZSTD)
    endif()
  endif()
endif()

# A static link was asked for (distribution wheels): pkg-config's flags (-lzstd) would pick the
# shared library when both are installed, so use the archive itself, or fail rather than ship a
# wheel that needs libzstd.so on the user's machine.
if(PYCKPT_ZSTD_STATIC AND NOT _pyckpt_zstd_target STREQUAL "zstd::libzstd_static"
   AND NOT _pyckpt_zstd_target STREQUAL "pyckpt_zstd_bundled")
  find_library(PYCKPT_ZSTD_ARCHIVE NAMES libzstd.a
    HINTS ${PYCKPT_PC_ZSTD_STATIC_LIBRARY_DIRS} ${PYCKPT_PC_ZSTD_LIBRARY_DIRS})
  find_path(PYCKPT_ZSTD_INCLUDE NAMES zstd.h
    HINTS ${PYCKPT_PC_ZSTD_STATIC_INCLUDE_DIRS} ${PYCKPT_PC_ZSTD_INCLUDE_DIRS})
  if(NOT PYCKPT_ZSTD_ARCHIVE OR NOT PYCKPT_ZSTD_INCLUDE)
    message(FATAL_ERROR
      "PYCKPT_ZSTD_STATIC=ON needs the static zstd library (libzstd.a, built with -fPIC) and "
      "zstd.h; none was found. Point CMake at a prefix that has it "
      "(-Ccmake.define.zstd_ROOT=<prefix>) or at zstd sources to compile in "
      "(-Ccmake.define.PYCKPT_ZSTD_SOURCE=<dir>)")
  endif()
  add_library(pyckpt_zstd_archive STATIC IMPORTED)
  set_target_properties(pyckpt_zstd_archive PROPERTIES
    IMPORTED_LOCATION "${PYCKPT_ZSTD_ARCHIVE}"
    INTERFACE_INCLUDE_DIRECTORIES "${PYCKPT_ZSTD_INCLUDE}")
  set(_pyckpt_zstd_target pyckpt_zstd_archive)
endif()

if(NOT _pyckpt_zstd_target)
  message(FATAL_ERROR
    "pyckpt needs the zstd library and headers (>= ${PYCKPT_ZSTD_MIN_VERSION}), and none was found.\n"
    "Install them with one of:\n"
    "  Debian/Ubuntu:  sudo apt-get install libzstd-dev\n"
    "  Fedora/RHEL:    sudo dnf install libzstd-devel\n"
    "  macOS:          brew install zstd\n"
    "  conda:          conda install zstd\n"
    "or point CMake at an installation prefix: pip install . -Ccmake.define.zstd_ROOT=<prefix>")
endif()

add_library(pyckpt::zstd INTERFACE IMPORTED)
target_link_libraries(pyckpt::zstd INTERFACE ${_pyckpt_zstd_target})
message(STATUS "pyckpt: using zstd from ${_pyckpt_zstd_target}")
