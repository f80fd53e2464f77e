#!/bin/bash
# keras.applications ResNet50 (64x64, batch 2, 10 logits) and its stem (tests/xla_step_digest.py's
# ResNet50Stem) on the GPU in XLA's deterministic mode: two SGD steps under jit_compile=True,
# stock, enable_recompute() and enable_recompute(activations=True), each in a fresh process, the
# digests of tests/xla_step_digest.py (both steps' losses and gradients, every weight after
# them). From the project root, after the bundle's pieces are in /tmp/tfparts, with .tfgpu/common
# and .tfgpu/pkg carried (as scripts/gpu_segments.sh). Prints one line per model and variant and,
# per model, SAME when every variant's digest is stock's, else DIFFERENT; exits 1 on a
# difference. Output under $OUT (default build/resnet50_stem_gpu).
set -o pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/resnet50_stem_gpu}
mkdir -p "$OUT"
: > "$OUT/digests.txt"
source .tfgpu/common/setup_tf.sh || { echo "setup_tf.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
DET="$XLA_FLAGS --xla_gpu_deterministic_ops=true"   # XLA's deterministic mode
status=0
cd tests
for spec in ${MODELS:-ResNet50:64:2 ResNet50Stem:64:2}; do
  IFS=: read m s b <<< "$spec"
  for v in stock switch product; do
    XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 TF_FORCE_GPU_ALLOW_GROWTH=true timeout 400 \
      python3 xla_step_digest.py $m $s $b $v logits gpu > "$OUT/${m}_$v.log" 2>&1
    d=$(grep '^RESULT ' "$OUT/${m}_$v.log" | tail -1 | python3 -c \
      "import json,sys; print(json.loads(sys.stdin.read()[7:])['$v'])" 2>/dev/null)
    echo "$m $s $b $v ${d:-FAILED (see $OUT/${m}_$v.log)}" | tee -a "$OUT/digests.txt"
  done
  n=$(grep "^$m $s $b " "$OUT/digests.txt" | awk '{print $5}' | sort -u | wc -l)
  if [ "$n" = 1 ] && ! grep -q "^$m $s $b .*FAILED" "$OUT/digests.txt"; then
    echo "$m: SAME" | tee -a "$OUT/digests.txt"
  else
    echo "$m: DIFFERENT" | tee -a "$OUT/digests.txt"; status=1
  fi
done
exit $status
