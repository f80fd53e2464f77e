#!/bin/bash
# Builds the harness, runs the checks and the timing table, then the sanitizers on small sizes.
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
if [ -z "$SKIP_SANITIZE" ]; then
  S=/usr/local/cuda/bin/compute-sanitizer
  B=build/gpu_check/gpu_check
  for tool in memcheck racecheck initcheck synccheck; do
    extra="--no-cudnn"; [ $tool = memcheck ] && extra=""
    echo "== compute-sanitizer --tool $tool $B --small $extra" | tee -a "$OUT/sanitize.txt"
    timeout 240 $S --tool $tool --error-exitcode 9 $B --small $extra > /tmp/san-$tool.txt 2>&1
    echo "exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|ALL CHECKS|CHECKS FAILED' /tmp/san-$tool.txt | tr '\n' ' ')" | tee -a "$OUT/sanitize.txt"
    { echo "== $tool"; cat /tmp/san-$tool.txt; } >> "$OUT/sanitize-logs.txt"
  done
fi
exit $rc
