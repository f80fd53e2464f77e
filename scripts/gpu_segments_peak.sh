#!/bin/bash
# Study: steady peaks of keras.applications models at Keras' default compile on the GPU, stock
# against enable_recompute(activations=True) with the table's holds and with every G held
# (TF_RELUPOOL_SEGMENT_HOLD=all), processes in parallel, and what XLA holds at each
# executable's peak (from its buffer assignment). Output under $OUT.
ROOT=$(pwd); OUT=${OUT:-$ROOT/build/gpu_segments_peak}; mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || exit 1
for m in ${MODELS:-MobileNetV2 EfficientNetB0}; do
  for v in stock act act-hold; do
    d=/tmp/dump_${m}_$v; rm -rf $d
    ( cd /tmp && env $( [ $v = act-hold ] && echo TF_RELUPOOL_SEGMENT_HOLD=all ) \
      XLA_FLAGS="$XLA_FLAGS --xla_dump_to=$d --xla_dump_hlo_module_re=.*one_step_on.*" \
      timeout ${T:-420} python3 $ROOT/benchmarks/segments_gpu_peak.py $m --variant ${v%-hold} \
      --batch ${BATCH:-32} > /tmp/log_${m}_$v.txt 2>&1 ) &
  done
done
wait
for m in ${MODELS:-MobileNetV2 EfficientNetB0}; do
  for v in stock act act-hold; do
    grep RESULT /tmp/log_${m}_$v.txt || tail -3 /tmp/log_${m}_$v.txt
    f=$(ls -S /tmp/dump_${m}_$v/*buffer-assignment.txt 2>/dev/null | head -1)
    [ -n "$f" ] && { echo "== $m $v $(grep -m1 'Total bytes used' $f)"; grep -A60 'Live ranges at .*(peak)' $f | head -61; } >> "$OUT/peaks_$m.txt"
  done
done
