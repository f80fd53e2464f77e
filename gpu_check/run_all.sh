#!/bin/bash
# Builds the harness, runs the checks and the timing table, then the sanitizers on small sizes.
# Used on the lent H200 (`run` tool): writes logs under ${OUT:-gpu_check/out}.
set -o pipefail
OUT=${OUT:-gpu_check/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
make gpu-build GPU_ARCH="${GPU_ARCH:--gencode arch=compute_90,code=sm_90}" > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
build/gpu_check/gpu_check "$@" 2>&1 | tee "$OUT/gpu_check.txt"
rc=$?
if [ -z "$SKIP_SANITIZE" ]; then
  S=/usr/local/cuda/bin/compute-sanitizer
  B=build/gpu_check/gpu_check
  for tool in memcheck racecheck initcheck synccheck; do
    extra="--no-cudnn"; [ $tool = memcheck ] && extra=""
    echo "== compute-sanitizer --tool $tool $B --small $extra" | tee -a "$OUT/sanitize.txt"
    timeout 240 $S --tool $tool --error-exitcode 9 $B --small $extra > "$OUT/sanitize-$tool.txt" 2>&1
    echo "exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|ALL CHECKS|CHECKS FAILED' "$OUT/sanitize-$tool.txt" | tr '\n' ' ')" | tee -a "$OUT/sanitize.txt"
  done
fi
exit $rc
