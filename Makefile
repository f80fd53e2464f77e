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
