#!/bin/bash
# The activation recomputation on the GPU (HOLD=...: TF_RELUPOOL_SEGMENT_HOLD, the study lever):
# tests/test_segments.py in XLA's deterministic mode (bitwise with stock), beside the steady
# peaks of ResNet50 and VGG16 (stock vs act, in parallel). Output under $OUT.
ROOT=$(pwd); OUT=${OUT:-$ROOT/build/gpu_segments_check}; mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || exit 1
rm -f /tmp/log_*.txt
[ -n "$HOLD" ] && export TF_RELUPOOL_SEGMENT_HOLD=$HOLD
(cd tests && XLA_FLAGS="$XLA_FLAGS --xla_gpu_deterministic_ops=true" TF_CUDNN_DETERMINISTIC=1 \
  timeout ${T:-400} python3 -m pytest -q -p no:cacheprovider -x ${TESTS:-test_segments.py} > "$OUT/gpu_tests.txt" 2>&1) &
for m in ${MODELS:-ResNet50 VGG16}; do for v in stock act; do
  (cd /tmp && timeout ${T:-400} python3 $ROOT/benchmarks/segments_gpu_peak.py $m --variant $v > /tmp/log_${m}_$v.txt 2>&1) &
done; done
wait
grep -h RESULT /tmp/log_*.txt | tee "$OUT/peaks.txt"
tail -15 "$OUT/gpu_tests.txt"
