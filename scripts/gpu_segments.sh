#!/bin/bash
# The activation recomputation on the GPU through TensorFlow (after the bundle's pieces are in
# /tmp/tfparts, ../shared/tools/tf-gpu/README.md), from the project root with .tfgpu/common and
# .tfgpu/pkg carried. PART=measure: steady peak and step time at Keras' default compile, stock
# against enable_recompute() and enable_recompute(activations=True), one fresh process per variant
# (benchmarks/largest_batch.py --no-search). PART=search: the largest batch under a 4 GiB
# memory_limit, beside the GPU tests of the recomputation in XLA's deterministic mode and the
# tie check (benchmarks/xla_ties.py). Output under $OUT.
set -o pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/gpu_segments}
mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || { echo "setup_tf.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
LB="python3 $ROOT/benchmarks/largest_batch.py"
case ${PART:-measure} in
  measure)
    (cd /tmp && timeout ${T:-560} $LB --models ${MODELS:-mobilenetv2,efficientnetb0,resnet50,vgg16} \
      --variants ${VARIANTS:-default,default-switch,default-switch-act} --no-search --rounds 10 \
      --out "$OUT/measure.md") > "$OUT/measure.log" 2>&1
    tail -30 "$OUT/measure.md" ;;
  search)
    (cd tests && XLA_FLAGS="$XLA_FLAGS --xla_gpu_deterministic_ops=true" TF_CUDNN_DETERMINISTIC=1 \
      timeout ${T:-540} python3 -m pytest -q -p no:cacheprovider ${TESTS:-test_segments.py test_bn_relu.py} \
      > "$OUT/gpu_tests.txt" 2>&1; tail -5 "$OUT/gpu_tests.txt" > "$OUT/gpu_tests_tail.txt") &
    (cd /tmp && timeout 300 python3 "$ROOT/benchmarks/xla_ties.py" --sample-batches 100 > "$OUT/xla_ties.txt" 2>&1) &
    (cd /tmp && timeout ${T:-540} $LB --models ${MODELS:-mobilenetv2,efficientnetb0,resnet50} \
      --variants ${VARIANTS:-default,default-switch-act} --no-measure --jobs 10 --trial-timeout 200 \
      --out "$OUT/search.md") > "$OUT/search.log" 2>&1
    wait
    tail -30 "$OUT/search.md"; cat "$OUT/gpu_tests_tail.txt"; tail -15 "$OUT/xla_ties.txt" ;;
esac
