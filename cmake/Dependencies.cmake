# Finds every dependency and exposes each as one target name, whatever the distribution calls it.
#   dflash::torch      libtorch from the torch wheel (imported by hand: find_package(Torch) from a
#                      CUDA wheel insists on a CUDA toolkit and adds flags we do not want)
#   dflash::yaml       yaml-cpp (target `yaml-cpp` in Debian 12's 0.7, `yaml-cpp::yaml-cpp` later)
#   dflash::nccl       NCCL from the wheel (the same library torch itself loads)
#   prometheus-cpp::core, spdlog::spdlog, dflash::httplib, dflash::concurrentqueue, GTest::gtest
find_package(Threads REQUIRED)
find_package(spdlog REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(PkgConfig REQUIRED)

find_package(yaml-cpp REQUIRED)
add_library(dflash_yaml INTERFACE)
if(TARGET yaml-cpp::yaml-cpp)
  target_link_libraries(dflash_yaml INTERFACE yaml-cpp::yaml-cpp)
else()
  target_link_libraries(dflash_yaml INTERFACE yaml-cpp)
endif()
add_library(dflash::yaml ALIAS dflash_yaml)

# Debian builds cpp-httplib as a compiled library (libcpp-httplib.so + header); elsewhere it is
# header-only. Either way one target.
pkg_check_modules(HTTPLIB IMPORTED_TARGET cpp-httplib)
add_library(dflash_httplib INTERFACE)
if(HTTPLIB_FOUND)
  target_link_libraries(dflash_httplib INTERFACE PkgConfig::HTTPLIB)
else()
  find_path(HTTPLIB_INCLUDE httplib.h REQUIRED)
  target_include_directories(dflash_httplib INTERFACE ${HTTPLIB_INCLUDE})
endif()
add_library(dflash::httplib ALIAS dflash_httplib)

find_path(CONCURRENTQUEUE_INCLUDE concurrentqueue.h PATH_SUFFIXES concurrentqueue concurrentqueue/moodycamel REQUIRED)
add_library(dflash_concurrentqueue INTERFACE)
target_include_directories(dflash_concurrentqueue SYSTEM INTERFACE ${CONCURRENTQUEUE_INCLUDE})
add_library(dflash::concurrentqueue ALIAS dflash_concurrentqueue)

# ---- libtorch from the wheel ----------------------------------------------------------------
if(NOT DFLASHD_TORCH_DIR)
  find_program(_python NAMES python3 REQUIRED)
  execute_process(COMMAND ${_python} -c "import os, torch; print(os.path.dirname(torch.__file__))"
                  OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "torch not found: pass -DDFLASHD_TORCH_DIR=.../site-packages/torch (make does this)")
  endif()
  set(DFLASHD_TORCH_DIR ${_torch_dir} CACHE PATH "" FORCE)
endif()
set(_tl ${DFLASHD_TORCH_DIR}/lib)
foreach(_lib torch torch_cpu c10)
  if(NOT EXISTS ${_tl}/lib${_lib}.so)
    message(FATAL_ERROR "${_tl}/lib${_lib}.so missing: DFLASHD_TORCH_DIR=${DFLASHD_TORCH_DIR} is not a torch wheel")
  endif()
endforeach()
set(DFLASHD_TORCH_HAS_CUDA OFF)
if(EXISTS ${_tl}/libtorch_cuda.so)
  set(DFLASHD_TORCH_HAS_CUDA ON)
endif()
get_filename_component(DFLASHD_SITE_PACKAGES ${DFLASHD_TORCH_DIR} DIRECTORY)
# The Python of the venv that holds the wheel runs the reference-model scripts of the tests.
if(NOT DFLASHD_PYTHON OR NOT EXISTS "${DFLASHD_PYTHON}")
  get_filename_component(_venv ${DFLASHD_SITE_PACKAGES}/../../.. ABSOLUTE)
  if(EXISTS ${_venv}/bin/python3)
    set(DFLASHD_PYTHON ${_venv}/bin/python3 CACHE FILEPATH "Python with torch and transformers (tests)" FORCE)
  endif()
endif()
add_library(dflash_torch INTERFACE)
target_include_directories(dflash_torch SYSTEM INTERFACE
  ${DFLASHD_TORCH_DIR}/include ${DFLASHD_TORCH_DIR}/include/torch/csrc/api/include)
# The wheels are built with the C++11 ABI since torch 2.7.
target_compile_definitions(dflash_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
target_link_libraries(dflash_torch INTERFACE ${_tl}/libtorch.so ${_tl}/libtorch_cpu.so ${_tl}/libc10.so)
# rpath so the binary finds the wheel's libraries (and they find the nvidia-* wheels by $ORIGIN).
target_link_options(dflash_torch INTERFACE "-Wl,-rpath,${_tl}")
if(DFLASHD_TORCH_HAS_CUDA)
  target_link_libraries(dflash_torch INTERFACE ${_tl}/libc10_cuda.so ${_tl}/libtorch_cuda.so)
  target_link_options(dflash_torch INTERFACE "-Wl,-rpath-link,${DFLASHD_SITE_PACKAGES}/nvidia/cu13/lib")
endif()
add_library(dflash::torch ALIAS dflash_torch)

# ---- CUDA ---------------------------------------------------------------------------------------
set(DFLASHD_WITH_CUDA OFF)
if(DFLASHD_CUDA AND DFLASHD_TORCH_HAS_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Hopper first (sm_90a: its wgmma kernels); Blackwell where the toolkit knows it. PTX of the
    # newest for forward compat.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a-real 100-real 120)
    endif()
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 has no CUDA20 mapping for nvcc; kernels need only C++17
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)  # one cudart in the process: the wheel's, as torch uses
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(DFLASHD_WITH_CUDA ON)
    target_include_directories(dflash_torch SYSTEM INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
    target_compile_definitions(dflash_torch INTERFACE DFLASHD_WITH_CUDA=1)
  else()
    message(WARNING "DFLASHD_CUDA=ON but no CUDA compiler found: building without the CUDA kernels")
  endif()
endif()
message(STATUS "dflashd: torch ${DFLASHD_TORCH_DIR} (cuda build: ${DFLASHD_TORCH_HAS_CUDA}), CUDA kernels: ${DFLASHD_WITH_CUDA}")

add_library(dflash_nccl INTERFACE)
if(DFLASHD_WITH_CUDA AND EXISTS ${DFLASHD_SITE_PACKAGES}/nvidia/nccl/lib/libnccl.so.2)
  target_include_directories(dflash_nccl SYSTEM INTERFACE ${DFLASHD_SITE_PACKAGES}/nvidia/nccl/include)
  target_link_libraries(dflash_nccl INTERFACE ${DFLASHD_SITE_PACKAGES}/nvidia/nccl/lib/libnccl.so.2)
  target_compile_definitions(dflash_nccl INTERFACE DFLASHD_WITH_NCCL=1)
endif()
add_library(dflash::nccl ALIAS dflash_nccl)
