#!/usr/bin/env bash
# Builds tf_relupool against several TensorFlow releases and runs the smoke tests with each.
# Usage: scripts/test_compat.sh [X.Y.Z[:KERAS] ...]   (default: 2.20.0, the oldest release declared)
# For each release: a venv $COMPAT_DIR/venv-X.Y with tensorflow==X.Y.Z, a Keras 3 that works with
# it (the newest; `2.21.0:3.10.0` pins Keras 3.10.0 instead, in venv-2.21-keras3.10.0), numpy,
# pytest, pytest-xdist and hypothesis; a copy of this working tree (without .venv/.git/.tfgpu/build)
# in $COMPAT_DIR/src-X.Y; a CPU-only build (TF_RELUPOOL_CUDA=0) installed into the venv; then
# the smoke subset below (ops, layers, the Grappler passes, patterns, XLA, loader, bn_relu) from
# the copy's tests/ with 30 hypothesis examples, one pytest worker per core.
# Prints one summary line per release (logs: $COMPAT_DIR/X.Y-{install,build,test}.log) and exits
# nonzero if any release fails. COMPAT_DIR defaults to build/compat under the repository root.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPAT_DIR=${COMPAT_DIR:-$ROOT/build/compat}
PYTHON=${PYTHON:-python3}
SMOKE=(test_ops.py test_layers.py test_grappler.py test_fuse_relu_max_pool.py test_fold_transposes.py
       test_patterns.py test_xla.py test_loader.py test_bn_relu.py test_compat.py
       test_pool_activations.py)
[ $# -gt 0 ] || set -- 2.20.0
mkdir -p "$COMPAT_DIR" && COMPAT_DIR=$(cd "$COMPAT_DIR" && pwd)

keras_for() {  # $1 = X.Y.Z[:KERAS] (Keras 3.3.3, pip's old pick for 2.16, has fit bugs)
  case $1 in *:*) echo "keras==${1#*:}" ;; *) echo "keras>=3" ;; esac
}

copy_tree() {  # the working tree, as it is (uncommitted changes too), into $1
  if command -v rsync > /dev/null; then
    rsync -a --exclude .venv --exclude .git --exclude .tfgpu --exclude build "$ROOT/" "$1/"
  else
    mkdir -p "$1" && tar -C "$ROOT" --exclude=./.venv --exclude=./.git --exclude=./.tfgpu \
      --exclude=build -cf - . | tar -C "$1" -xf -
  fi
}

run_one() {  # $1 = X.Y.Z[:KERAS]; prints the result, returns nonzero on failure
  local tf=${1%%:*}; local mm=${tf%.*}
  case $1 in *:*) mm=$mm-keras${1#*:} ;; esac
  local venv=$COMPAT_DIR/venv-$mm src=$COMPAT_DIR/src-$mm log=$COMPAT_DIR/$mm
  [ -x "$venv/bin/pip" ] || "$PYTHON" -m venv "$venv" || { echo "venv failed"; return 1; }
  "$venv/bin/pip" install -q "tensorflow==$tf" "$(keras_for "$1")" numpy pytest pytest-xdist hypothesis \
    > "$log-install.log" 2>&1 || { echo "pip install failed ($log-install.log)"; return 1; }
  copy_tree "$src" || { echo "copying the tree failed"; return 1; }
  (cd "$src" && TF_RELUPOOL_CUDA=0 "$venv/bin/pip" install --no-build-isolation --no-deps \
    --force-reinstall .) > "$log-build.log" 2>&1 || { echo "build failed ($log-build.log)"; return 1; }
  local keras rc=0
  keras=$("$venv/bin/python" -c "import keras; print(keras.__version__)" 2> /dev/null | tail -1)
  (cd "$src/tests" && TF_RELUPOOL_EXAMPLES=30 TF_CPP_MIN_LOG_LEVEL=2 timeout 1500 \
    "$venv/bin/pytest" -q -x -p no:cacheprovider -n auto --durations=10 "${SMOKE[@]}") > "$log-test.log" 2>&1 || rc=$?
  echo "build ok, keras $keras, $(tail -1 "$log-test.log" | sed -E 's/^=+ | =+$//g')$([ $rc = 124 ] \
    && echo ' (timed out)')"
  return $rc
}

failed=0
for v in "$@"; do
  t0=$SECONDS
  if out=$(run_one "$v"); then status=PASS; else status=FAIL; failed=1; fi
  echo "tensorflow ${v%%:*}$(case $v in *:*) echo " with keras ${v#*:}" ;; esac): $status: $out [$((SECONDS - t0))s]"
done
exit $failed
