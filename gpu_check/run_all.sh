#!/bin/bash
# Builds the harness, runs the checks and the timing table, then `make gpu-sanitize`.
# Used on the H200: writes logs under ${OUT:-gpu_check/out}.
# VARIANTS="name:flags ..." also builds and times variants of the kernels (e.g. w1:-DTFRP_FAST_WAVES=1).
set -o pipefail
OUT=${OUT:-gpu_check/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
ARCH="${GPU_ARCH:--gencode arch=compute_90,code=sm_90}"
make gpu-build GPU_ARCH="$ARCH" > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
for v in $VARIANTS; do  # build the variants (in parallel) before anything is timed
  ( make gpu-build GPU_ARCH="$ARCH" GPU_BUILD="build/gpu_check_${v%%:*}" GPU_EXTRA_FLAGS="${v#*:}" \
      >> "$OUT/build-variants.txt" 2>&1 ) &
done
wait
build/gpu_check/gpu_check "$@" 2>&1 | tee "$OUT/gpu_check.txt"
rc=$?
for v in $VARIANTS; do
  echo "== variant ${v%%:*} (${v#*:})" | tee -a "$OUT/variants.txt"
  build/gpu_check_${v%%:*}/gpu_check --configs 10 2>&1 | grep -E '^\||CHECKS|copy' | tee -a "$OUT/variants.txt"
done
if [ -z "$SKIP_SANITIZE" ]; then  # the Makefile's four tools; the full log, then its verdicts
  make --no-print-directory gpu-sanitize GPU_ARCH="$ARCH" > "$OUT/sanitize-logs.txt" 2>&1 || rc=1
  grep -E 'compute-sanitizer --tool|ERROR SUMMARY|RACECHECK SUMMARY|ALL CHECKS|CHECKS FAILED|Error' \
    "$OUT/sanitize-logs.txt" | tee "$OUT/sanitize.txt"
fi
exit $rc
