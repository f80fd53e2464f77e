# tf_relupool: `make demo` (the main job) and `make test` (the tests) each set up everything they
# need on a fresh machine with Python, g++ (and optionally nvcc): a virtual environment, TensorFlow,
# and the package built from this checkout.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := setup.py $(shell find cc tf_relupool -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.py' 2>/dev/null)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: all install demo test test-slow test-compat bench clean wheel test-wheel test-legacy-keras

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
# Both passes run in parallel (pytest-xdist, one worker per core, idle workers stealing queued
# tests) and print their 25 slowest tests. `make test` runs what is not marked `slow`;
# `make test-slow` (CI runs both) the `slow` tests, in the same two passes.
# The second pass runs every module whose results can depend on the CPU as an AVX2-only CPU runs
# it: oneDNN off (TF_ENABLE_ONEDNN_OPTS=0: stock's plain Eigen kernels, TensorFlow's default on
# CPUs without AVX-512, where stock has no NCHW Conv2D/MaxPool), XLA's CPU code capped at AVX2
# (--xla_cpu_max_isa=AVX2) and the op library's CPU kernels on their AVX2 path
# (TF_RELUPOOL_CPU_ISA), so that neither a result nor a test that holds only on an AVX-512 machine
# with oneDNN can land. CPU_INDEPENDENT are the modules left out of it, each because what it
# asserts reads no kernel's, oneDNN's or XLA's bits (docs/install.md has the table), and tests
# marked first_pass_only are cases whose CPU-dependent bits a sibling case checks there.
CPU_INDEPENDENT ?= tests/test_loader.py tests/test_versions.py tests/test_gpu.py \
	tests/test_gpu_build.py tests/test_examples.py tests/test_compat.py tests/test_hooks.py \
	tests/test_no_compiler.py tests/test_legacy_keras.py tests/test_results_index.py \
	tests/test_measure.py tests/test_largest_batch.py tests/test_harness.py tests/test_config.py \
	tests/test_autotune_cache.py tests/test_random_state.py tests/test_distribute.py \
	tests/test_recompute_plan.py
STOCK_TESTS ?= $(filter-out $(CPU_INDEPENDENT),$(sort $(wildcard tests/test_*.py)))
AVX2_ENV := TF_ENABLE_ONEDNN_OPTS=0 XLA_FLAGS="$$XLA_FLAGS --xla_cpu_max_isa=AVX2" TF_RELUPOOL_CPU_ISA=avx2
PYTEST_JOBS ?= auto
PYTEST := $(VENV)/bin/pytest -q -n $(PYTEST_JOBS) --dist worksteal --durations=25

test: install
	$(PYTEST) tests
	$(AVX2_ENV) $(PYTEST) -m "not slow and not first_pass_only" $(STOCK_TESTS)

# Builds the package against other TensorFlow releases (one venv each under build/compat) and runs
# the smoke subset with each: scripts/test_compat.sh; docs/install.md has the table.
TF_VERSIONS ?=
test-compat:
	scripts/test_compat.sh $(TF_VERSIONS)

# A binary wheel (the op library built for the venv's TensorFlow, CUDA kernels where nvcc is
# found, metadata pinning that TensorFlow's minor version, a manylinux tag from auditwheel) in
# dist/; test-wheel installs it into a fresh venv with no compiler reachable and runs the smoke
# subset; test-legacy-keras installs it beside tf-keras (TF_USE_LEGACY_KERAS=1). scripts/wheel.sh.
wheel: $(VENV)/.deps
	scripts/wheel.sh build

test-wheel: wheel
	scripts/wheel.sh test

test-legacy-keras: wheel
	scripts/wheel.sh legacy-keras

# The slow tests, and in the second mode also make test's first_pass_only cases (so that CI runs
# every test in both modes); test_huge.py (12 GB a case) alone and serially, in the first only.
test-slow: install
	$(PYTEST) -m slow --ignore=tests/test_huge.py tests
	$(AVX2_ENV) $(PYTEST) -m "slow or first_pass_only" $(filter-out tests/test_huge.py,$(STOCK_TESTS))
	$(VENV)/bin/pytest -q -m slow --durations=25 tests/test_huge.py

bench: install
	$(PY) benchmarks/bench_ops.py

# The main job: a short CIFAR-10 training, the stock model then the same model under
# tf_relupool.enable_recompute() (the one line), from the same weights, printing their peak step
# memory and step time side by side, then the quick memory/speed report (build/demo/).
# Synthetic data by default (offline); `make demo DATA=../shared/data/cifar10-jpeg.tar.gz` (or an
# image-folder directory, or DATA=keras) trains one epoch on 5,000 real images instead.
# DEVICE=auto (default) measures the GPU's allocator when TensorFlow sees a GPU, else the CPU's;
# DEVICE=cpu or gpu chooses. On the GPU the report is benchmarks/gpu_memory.py's (~5 min).
DEVICE ?= auto
demo: install
	$(PY) examples/cifar10.py --device $(DEVICE) --model simple --recompute off,argmax --batch-size 128 \
	  $(if $(DATA),--data $(DATA) --epochs 1 --limit 5000 --test-limit 2000,--epochs 2 --steps-per-epoch 12)
	$(PY) benchmarks/memory_report.py --quick --device $(DEVICE)

clean:
	rm -rf build *.egg-info $(VENV) tf_relupool/_relu_max_pool_ops.so tf_relupool/_build_info.py

# ---- The CPU kernels, compiled once per instruction set ----
# cc/kernels/relu_max_pool_cpu_kernels.cc is compiled with each set's define
# (cc/kernels/relu_max_pool_cpu_isa.h; setup.py and BUILD pass the same): $(call cpu_kernel_objs,DIR)
# are DIR/<set>/relu_max_pool_cpu_kernels.o, compiled by the CPU_KERNELS_COMPILE command of the
# binary they go into (a target-specific variable, which its prerequisites inherit).
CPU_KERNELS_SRC := cc/kernels/relu_max_pool_cpu_kernels.cc
CPU_ISA_DEFINES_baseline :=
CPU_ISA_DEFINES_avx2 := -DTFRP_CPU_ISA_AVX2
CPU_ISA_DEFINES_avx512 := -DTFRP_CPU_ISA_AVX512
cpu_kernel_objs = $(foreach isa,baseline avx2 avx512,$(1)/$(isa)/relu_max_pool_cpu_kernels.o)

%/relu_max_pool_cpu_kernels.o: $(CPU_KERNELS_SRC) $(wildcard cc/kernels/*.h)
	@mkdir -p $(@D)
	$(CPU_KERNELS_COMPILE) $(CPU_ISA_DEFINES_$(notdir $*)) -c $< -o $@

# ---- GPU harness: no TensorFlow; needs nvcc, an NVIDIA GPU and (for the cuDNN path) cuDNN 9. ----
# `make gpu-check` builds the CUDA kernels, the cuDNN path and the CPU reference with nvcc alone,
# checks every op bitwise against the CPU kernels and prints the timing table;
# `make gpu-sanitize` runs small sizes under compute-sanitizer (memcheck, racecheck, initcheck,
# synccheck). gpu_check/README.md has the details.
NVCC ?= $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc $(CUDA_PATH)/bin/nvcc) $(shell command -v nvcc 2>/dev/null) /usr/local/cuda/bin/nvcc)
CUDA_BIN := $(dir $(NVCC))
GPU_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
GPU_BUILD ?= build/gpu_check
GPU_BIN := $(GPU_BUILD)/gpu_check
GPU_CHECK_ARGS ?=
# Where cuDNN's headers may be (Debian packages name them cudnn_v9.h and so on).
CUDNN_SEARCH ?= $(CUDNN_HOME)/include /usr/include/x86_64-linux-gnu /usr/include /usr/local/cuda/include \
	$(wildcard $(VENV)/lib/python3*/site-packages/tensorflow/include/third_party/gpus/cudnn/include)
GPU_OBJS := $(addprefix $(GPU_BUILD)/,relu_max_pool_gpu.o relu_max_pool_cudnn.o gpu_check.o \
	relu_max_pool_cpu.o relu_max_pool_params.o) $(call cpu_kernel_objs,$(GPU_BUILD))
GPU_DEPS := $(wildcard cc/kernels/*.h) $(GPU_BUILD)/cudnn_include/.stamp
GPU_NVCC_FLAGS := -O3 --std=c++17 -I. -I$(GPU_BUILD)/cudnn_include -Xcompiler -pthread,-ffp-contract=off $(GPU_EXTRA_FLAGS)

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

$(GPU_BIN): CPU_KERNELS_COMPILE = $(NVCC) $(GPU_NVCC_FLAGS)
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

# ---- GPU through TensorFlow: on the H200 with ../shared/tools/tf-gpu's trimmed TF 2.21 sourced ----
# `make gpu-test` runs the whole suite with the GPU visible (tests/test_gpu.py holds the GPU-only
# checks; it is skipped elsewhere), from tests/ so that the installed tf_relupool is imported
# rather than the source tree. scripts/tf_gpu.sh runs it with the op benchmark and the memory
# report; docs/gpu.md says how.
GPU_PYTHON ?= python3
GPU_TEST_ARGS ?=
.PHONY: gpu-test
# Deterministic mode (XLA's first configuration, cuDNN's deterministic algorithms): tests that
# compare two compilations of a step (stock and the switch) need both to pick the same cuDNN
# algorithms, which autotuning does not promise on a GPU (docs/gpu.md). Not TensorFlow's op
# determinism (TF_DETERMINISTIC_OPS) for the whole suite: under it stock's max-pool gradient has
# no XLA form on a GPU ("GPU MaxPool gradient ops do not yet have a deterministic XLA
# implementation"); the tests that need it outside XLA turn it on themselves.
gpu-test:
	cd tests && XLA_FLAGS="$$XLA_FLAGS --xla_gpu_deterministic_ops=true" TF_CUDNN_DETERMINISTIC=1 \
	  $(GPU_PYTHON) -m pytest -q -rs -p no:cacheprovider $(GPU_TEST_ARGS) .

# ---- Bazel: the op library and the Python tests with Bazel 4.2 (Debian's bazel-bootstrap). ----
# `make bazel-test` installs bazel-bootstrap with apt when no bazel is on PATH, sets up the venv,
# builds //:relu_max_pool_ops against the venv's TensorFlow (CUDA kernels too when nvcc is found,
# as in setup.py; TF_RELUPOOL_CUDA=0 turns them off) and runs //:op_tests. Offline: the WORKSPACE
# declares only local repositories. Bazel's output stays in build/bazel-root (build/bazel-bin etc.
# are the convenience links); its server exits after $(BAZEL_IDLE_SECS) s idle.
BAZEL ?= bazel
BAZEL_ROOT ?= $(CURDIR)/build/bazel-root
BAZEL_IDLE_SECS ?= 600
BAZEL_FLAGS ?=
BAZEL_CMD = TF_RELUPOOL_PYTHON=$(abspath $(PY)) $(BAZEL) --output_user_root=$(BAZEL_ROOT) \
	--max_idle_secs=$(BAZEL_IDLE_SECS)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: bazel-install bazel-build bazel-test bazel-clean

bazel-install:
	@command -v $(BAZEL) >/dev/null 2>&1 || { $(SUDO) apt-get update && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y bazel-bootstrap; }

bazel-build: bazel-install $(VENV)/.deps
	$(BAZEL_CMD) build $(BAZEL_FLAGS) //:relu_max_pool_ops

bazel-test: bazel-install $(VENV)/.deps
	$(BAZEL_CMD) test $(BAZEL_FLAGS) //:op_tests

bazel-clean:
	-[ ! -d $(BAZEL_ROOT) ] || $(BAZEL_CMD) shutdown
	rm -rf $(BAZEL_ROOT) build/bazel-bin build/bazel-out build/bazel-testlogs build/bazel-$(notdir $(CURDIR))

# ---- CIFAR-10 examples ----
.PHONY: report demo-real
# The full memory/speed report: three models, four variants, several batch sizes (~20-30 min);
# on a GPU (DEVICE=auto or gpu) the GPU report -> benchmarks/results/gpu_memory.md.
report: install
	$(PY) benchmarks/memory_report.py --device $(DEVICE)

demo-real: install
	$(MAKE) --no-print-directory demo DATA=$(or $(DATA),../shared/data/cifar10-jpeg.tar.gz)

# ---- Reliability: fuzzing and sanitizers. docs/reliability.md. ----
# `make fuzz` runs FUZZ_CALLS random calls (valid and invalid) of every op in worker processes
# and prints counts (ok, errors by type, crashes); FUZZ_SEED picks the calls, so a failure replays.
# `make sanitize` runs the framework-free kernel test under ASan+UBSan, then builds the op library
# with ASan+UBSan into build/sanitize (the normal install is untouched) and runs the op tests with
# it, the ASan runtime preloaded into python. `make tsan` runs the kernel test under TSan.
FUZZ_CALLS ?= 10000
FUZZ_SEED ?= 1
FUZZ_JOBS ?= 2
SAN_BUILD := build/sanitize
SAN_CXXFLAGS ?= -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -O1
# GCC's null / nonnull-attribute checks make absl's constexpr function-pointer comparisons in
# TensorFlow's headers non-constant (a compile error), so the TF build goes without those three;
# ASan still catches null dereferences, and the framework-free kernel test keeps all of UBSan.
SAN_LIB_CXXFLAGS ?= $(SAN_CXXFLAGS) -fno-sanitize=null,nonnull-attribute,returns-nonnull-attribute
SAN_TESTS ?= tests/test_ops.py tests/test_bad_input.py tests/test_fuzz.py tests/test_concurrency.py tests/test_threads.py
SAN_FUZZ_CALLS ?= 1000
CC_TEST_SRCS := tests/cc/kernels_test.cc cc/kernels/relu_max_pool_cpu.cc cc/kernels/relu_max_pool_params.cc
CC_TEST_ITERS ?= 2000
CXX_TEST ?= g++
# libstdc++ is preloaded with the ASan runtime: python does not link it, and ASan's __cxa_throw
# interceptor must find it at start-up (else "CHECK failed: real___cxa_throw != 0").
SAN_ENV = LD_PRELOAD="$$($(CXX_TEST) -print-file-name=libasan.so) $$($(CXX_TEST) -print-file-name=libstdc++.so.6)" \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	PYTHONPATH=$(abspath $(SAN_BUILD)/lib) TF_RELUPOOL_FUZZ_CALLS=$(SAN_FUZZ_CALLS)

.PHONY: fuzz sanitize sanitize-cc sanitize-lib sanitize-py tsan cc-test

fuzz: install
	$(PY) tests/fuzz_ops.py --calls $(FUZZ_CALLS) --seed $(FUZZ_SEED) --jobs $(FUZZ_JOBS)

# The kernel test binaries: CC_TEST_SRCS and the kernel objects (beside the binary, in <binary>.cpu/),
# all compiled with the binary's CC_TEST_COMPILE.
cc_test_kernels = $(call cpu_kernel_objs,$(1).cpu)
CC_TEST_LINK = $(CC_TEST_COMPILE) $(CC_TEST_SRCS) $(call cc_test_kernels,$@) -o $@ -pthread
$(SAN_BUILD)/kernels_test_asan: CC_TEST_COMPILE = $(CXX_TEST) -std=c++17 -ffp-contract=off $(SAN_CXXFLAGS) -fno-sanitize-recover=all -I.
$(SAN_BUILD)/kernels_test_tsan: CC_TEST_COMPILE = $(CXX_TEST) -std=c++17 -ffp-contract=off -fsanitize=thread -g -O1 -I.
# The same kernel test built as setup.py builds the library (-O3, no sanitizer): the code that
# ships, on every CPU path the machine has (`make cc-test`; CI runs it and sanitize-cc).
CC_BUILD := build/cc
$(CC_BUILD)/kernels_test: CC_TEST_COMPILE = $(CXX_TEST) -std=c++17 -O3 -ffp-contract=off -I.
CC_TESTS := $(SAN_BUILD)/kernels_test_asan $(SAN_BUILD)/kernels_test_tsan $(CC_BUILD)/kernels_test
$(CC_TESTS): CPU_KERNELS_COMPILE = $(CC_TEST_COMPILE)
.SECONDEXPANSION:
$(CC_TESTS): $(CC_TEST_SRCS) $(wildcard cc/kernels/*.h) $$(call cc_test_kernels,$$@)
	@mkdir -p $(@D)
	$(CC_TEST_LINK)

cc-test: $(CC_BUILD)/kernels_test
	$< --iters $(CC_TEST_ITERS)

sanitize-cc: $(SAN_BUILD)/kernels_test_asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $< --iters $(CC_TEST_ITERS)

tsan: $(SAN_BUILD)/kernels_test_tsan
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $< --iters $$(( $(CC_TEST_ITERS) / 4 )) --threads 4

# The op library and the Python package, built with the sanitizers, in build/sanitize/lib.
$(SAN_BUILD)/.built: $(VENV)/.deps $(SOURCES)
	rm -rf $(SAN_BUILD)/lib $(SAN_BUILD)/tmp
	TF_RELUPOOL_CUDA=0 TF_RELUPOOL_CXXFLAGS="$(SAN_LIB_CXXFLAGS)" $(PY) setup.py -q \
	  build_py --build-lib $(SAN_BUILD)/lib \
	  build_ext --build-lib $(SAN_BUILD)/lib --build-temp $(SAN_BUILD)/tmp
	touch $@

sanitize-lib: $(SAN_BUILD)/.built

sanitize-py: sanitize-lib
	cd $(SAN_BUILD) && $(SAN_ENV) $(abspath $(PY)) -c "import tf_relupool._loader as l; p = l.library_path(); \
	  assert p.startswith('$(abspath $(SAN_BUILD))'), p; l.load_library(); print('sanitized library:', p)"
	$(SAN_ENV) $(VENV)/bin/pytest -q -p no:cacheprovider $(SAN_TESTS)

sanitize: sanitize-cc sanitize-py
