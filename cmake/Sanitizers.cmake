# DFLASHD_SANITIZE: the whole build instrumented for the CPU test suite (presets `asan`, `tsan`;
# `make test PRESET=asan`).
#   address  AddressSanitizer and UndefinedBehaviorSanitizer (any undefined behaviour fails)
#   thread   ThreadSanitizer
# nvcc does not take these flags, so an instrumented build has no CUDA sources (DFLASHD_CUDA=OFF).
# libtorch, libgomp and the other wheels' libraries are not instrumented. The runtime options
# and TSan's suppression of libgomp's interceptors are compiled into every executable
# (common/sanitizer_options.cc), so a test, the daemon processes the tests start and a binary
# run by hand all report alike.
set(DFLASHD_SANITIZE "" CACHE STRING "Instrument the build: address (ASan + UBSan), thread (TSan), or empty")
set_property(CACHE DFLASHD_SANITIZE PROPERTY STRINGS "" address thread)
if(DFLASHD_SANITIZE STREQUAL "address")
  set(_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined)
  # With ASan's instrumentation GCC's flow analysis reports copies in ATen's and libstdc++'s
  # headers (std::optional<Generator> defaults, <regex>'s states) as maybe uninitialised; the
  # same code builds without the warning uninstrumented.
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>)
elseif(DFLASHD_SANITIZE STREQUAL "thread")
  set(_sanitize_flags -fsanitize=thread)
elseif(NOT DFLASHD_SANITIZE STREQUAL "")
  message(FATAL_ERROR "DFLASHD_SANITIZE=${DFLASHD_SANITIZE}: expected address, thread or empty")
endif()
if(DEFINED _sanitize_flags)
  if(DFLASHD_CUDA)
    message(FATAL_ERROR "DFLASHD_SANITIZE=${DFLASHD_SANITIZE} needs DFLASHD_CUDA=OFF (nvcc does not instrument): "
                        "use the presets asan or tsan")
  endif()
  add_compile_options(${_sanitize_flags} -fno-omit-frame-pointer)
  add_link_options(${_sanitize_flags})
  # Linked into every executable defined after this point (the object's hooks must be in the
  # executable itself, where the sanitizer's runtime looks for them).
  add_library(dflash_sanitizer_options OBJECT ${CMAKE_CURRENT_LIST_DIR}/../common/sanitizer_options.cc)
  target_compile_definitions(dflash_sanitizer_options PRIVATE DFLASHD_SANITIZE_${DFLASHD_SANITIZE})
  link_libraries(dflash_sanitizer_options)
endif()
