# Finds the system libzstd and exposes it as the target pyckpt::zstd.
# Order: CMake config package (Debian/Ubuntu/Fedora/conda/brew ship zstdConfig.cmake),
# then pkg-config, then a fatal error that says what to install.
set(PYCKPT_ZSTD_MIN_VERSION 1.4.0)

find_package(zstd ${PYCKPT_ZSTD_MIN_VERSION} CONFIG QUIET)
set(_pyckpt_zstd_target "")
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
