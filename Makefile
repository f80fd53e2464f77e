# tf_relupool: `make demo` (the main job) and `make test` (the tests) each set up everything they
# need on a fresh machine with Python, g++ (and optionally nvcc): a virtual environment, TensorFlow,
# and the package built from this checkout.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := setup.py $(shell find cc tf_relupool -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.py' 2>/dev/null)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: all install demo test test-slow bench clean

all: install

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# --no-build-isolation: compile against the TensorFlow in this environment (see setup.py).
$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall .
	touch $@

install: $(VENV)/.installed

# Tests import the installed package, not the source tree (run from tests/, see tests/conftest.py).
test: install
	$(VENV)/bin/pytest -q tests

test-slow: install
	$(VENV)/bin/pytest -q -m slow tests

bench: install
	$(PY) benchmarks/bench_ops.py

demo: install
	$(PY) benchmarks/bench_ops.py --quick

clean:
	rm -rf build *.egg-info $(VENV) tf_relupool/_relu_max_pool_ops.so tf_relupool/_build_info.py

# ---- GPU harness: no TensorFlow; needs nvcc, an NVIDIA GPU and (for the cuDNN path) cuDNN 9. ----
# `make gpu-check` builds the CUDA kernels, the cuDNN path and the CPU reference with nvcc alone,
# checks every op bitwise against the CPU kernels and prints the timing table;
# `make gpu-sanitize` runs small sizes under compute-sanitizer (memcheck, racecheck, initcheck,
# synccheck). gpu_check/README.md has the details.
NVCC ?= $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc $(CUDA_PATH)/bin/nvcc) $(shell command -v nvcc 2>/dev/null) /usr/local/cuda/bin/nvcc)
CUDA_BIN := $(dir $(NVCC))
GPU_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
GPU_BUILD := build/gpu_check
GPU_BIN := $(GPU_BUILD)/gpu_check
GPU_CHECK_ARGS ?=
# Where cuDNN's headers may be (Debian packages name them cudnn_v9.h and so on).
CUDNN_SEARCH ?= $(CUDNN_HOME)/include /usr/include/x86_64-linux-gnu /usr/include /usr/local/cuda/include \
	$(wildcard $(VENV)/lib/python3*/site-packages/tensorflow/include/third_party/gpus/cudnn/include)
GPU_OBJS := $(addprefix $(GPU_BUILD)/,relu_max_pool_gpu.o relu_max_pool_cudnn.o gpu_check.o \
	relu_max_pool_cpu.o relu_max_pool_params.o)
GPU_DEPS := $(wildcard cc/kernels/*.h) $(GPU_BUILD)/cudnn_include/.stamp
GPU_NVCC_FLAGS := -O3 --std=c++17 -I. -I$(GPU_BUILD)/cudnn_include -Xcompiler -pthread

.PHONY: gpu-check gpu-sanitize gpu-build

$(GPU_BUILD)/cudnn_include/.stamp:
	@mkdir -p $(@D)
	@set -e; for d in $(CUDNN_SEARCH); do \
	  if ls $$d/cudnn*.h >/dev/null 2>&1; then d=$$(cd $$d && pwd); \
	    for f in $$d/cudnn*.h; do ln -sf $$f $(@D)/; done; \
	    for f in $$d/cudnn*_v9.h; do [ -e "$$f" ] || continue; b=$$(basename $$f _v9.h); \
	      [ -e $(@D)/$$b.h ] || ln -sf $$f $(@D)/$$b.h; done; \
	    echo "cuDNN headers from $$d"; break; fi; done; \
	test -e $(@D)/cudnn.h || { echo "no cuDNN headers in: $(CUDNN_SEARCH)"; exit 1; }
	@touch $@

$(GPU_BUILD)/%.o: cc/kernels/%.cu $(GPU_DEPS)
	$(NVCC) $(GPU_NVCC_FLAGS) $(GPU_ARCH) -c $< -o $@
$(GPU_BUILD)/%.o: cc/kernels/%.cc $(GPU_DEPS)
	$(NVCC) $(GPU_NVCC_FLAGS) -c $< -o $@
$(GPU_BUILD)/%.o: gpu_check/%.cu $(GPU_DEPS)
	$(NVCC) $(GPU_NVCC_FLAGS) $(GPU_ARCH) -c $< -o $@

$(GPU_BIN): $(GPU_OBJS)
	$(NVCC) $(GPU_ARCH) $(GPU_OBJS) -o $@ -ldl -lpthread

gpu-build:
	$(MAKE) --no-print-directory -j$$(nproc) $(GPU_BIN)

gpu-check: gpu-build
	$(GPU_BIN) $(GPU_CHECK_ARGS)

gpu-sanitize: gpu-build
	$(CUDA_BIN)compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 $(GPU_BIN) --small
	$(CUDA_BIN)compute-sanitizer --tool racecheck --error-exitcode 1 $(GPU_BIN) --small --no-cudnn
	$(CUDA_BIN)compute-sanitizer --tool initcheck --error-exitcode 1 $(GPU_BIN) --small --no-cudnn
	$(CUDA_BIN)compute-sanitizer --tool synccheck --error-exitcode 1 $(GPU_BIN) --small --no-cudnn
