# The two commands of the README, and the steps they are made of.
#   make demo   bootstrap, build, run the daemon on its embedded default config
#   make test   bootstrap, build, run every test that needs no GPU
# The venv with the torch wheel and the ccache live outside the clone ($(DFLASHD_CACHE)).
DFLASHD_CACHE ?= $(HOME)/.cache/dflashd
PRESET ?= default
BUILD_DIR := $(if $(filter default,$(PRESET)),build,build-$(PRESET))
export DFLASHD_CACHE
# The tests compare against transformers (deploy/requirements-test.txt).
export DFLASHD_TEST_PY ?= 1
export CCACHE_DIR ?= $(DFLASHD_CACHE)/ccache
export CCACHE_MAXSIZE ?= 5G
# Hits across clones in different directories: relative paths, the build directory kept out of
# the hash (debug info would otherwise put it there), and the precompiled headers made
# cacheable (with -fpch-preprocess, set in CMakeLists.txt when ccache is used).
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1
export CCACHE_SLOPPINESS ?= pch_defines,time_macros,include_file_mtime,include_file_ctime
CUDACXX ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc))
export CUDACXX

.PHONY: all bootstrap configure build test test-gpu demo clean

all: build

bootstrap:
	@deploy/bootstrap.sh

$(BUILD_DIR)/.configured: CMakeLists.txt CMakePresets.json cmake/Dependencies.cmake cmake/Sanitizers.cmake | bootstrap
	cmake --preset $(PRESET) -DDFLASHD_TORCH_DIR="$$(deploy/bootstrap.sh --print-torch-dir)"
	@touch $@

configure: bootstrap $(BUILD_DIR)/.configured

build: configure
	cmake --build $(BUILD_DIR) -j$$(nproc)

# One intra-op thread per test process: ctest runs one test per core, and two processes whose
# OpenMP threads spin against each other ran the small-op decoding tests 4-15x slower.
test: build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} ctest --test-dir $(BUILD_DIR) --output-on-failure -j$$(nproc)

# On a GPU host: every GPU test (named as tests/gpu_test_names_check.py says and checks), one at a
# time, after transformers' FP8 checkpoint for Fp8.GpuTappedStatesMatchTransformersFp8 (which
# transformers writes on the GPU, so the target stops where there is none).
FP8_REFERENCE := $(CURDIR)/$(BUILD_DIR)/tests/reference/fp8
test-gpu: build
	$(DFLASHD_CACHE)/venv/bin/python3 tests/reference/make_fp8_reference.py $(FP8_REFERENCE)
	DFLASHD_FP8_REFERENCE_DIR=$(FP8_REFERENCE) ctest --test-dir $(BUILD_DIR) --output-on-failure \
	  -R "$$(python3 tests/gpu_test_names_check.py --ctest-regex)"

demo: build
	deploy/demo.sh $(BUILD_DIR)/daemon/dflashd

clean:
	rm -rf build build-cpu build-asan build-tsan
