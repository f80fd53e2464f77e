#!/bin/bash
# The activation recomputation on the GPU through TensorFlow (after the bundle's pieces are in
# /tmp/tfparts, ../shared/tools/tf-gpu/README.md), from the project root with .tfgpu/common and
# .tfgpu/pkg carried. PART=measure: steady peak and step time at Keras' default compile, stock
# against enable_recompute() and enable_recompute(activations=True), one fresh process per variant
# (benchmarks/largest_batch.py --no-search). PART=search: the largest batch under a 4 GiB
# memory_limit, beside the GPU tests of the recomputation in XLA's deterministic mode and the
# tie check (benchmarks/xla_ties.py). PART=tests: the GPU tests of the recomputation and the pool
# fusion's activations in XLA's deterministic mode, beside two SGD steps of keras.applications
# models on the GPU, stock and product in fresh processes (tests/xla_step_digest.py; the digests
# must agree). PART=account: stock and activations=True side by side in one process per model,
# steps interleaved, with what XLA compiled for each: kernels, bytes moved, what is live at the
# peak, per block (benchmarks/segments_step_time.py). Output under $OUT.
set -o pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/gpu_segments}
mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || { echo "setup_tf.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
LB="python3 $ROOT/benchmarks/largest_batch.py"
DET="$XLA_FLAGS --xla_gpu_deterministic_ops=true"   # XLA's deterministic mode, for the tests
case ${PART:-measure} in
  measure)
    (cd /tmp && timeout ${T:-560} $LB --models ${MODELS:-mobilenetv2,efficientnetb0,resnet50,vgg16} \
      --variants ${VARIANTS:-default,default-switch,default-switch-act} --no-search --rounds 10 \
      --out "$OUT/measure.md") > "$OUT/measure.log" 2>&1
    tail -30 "$OUT/measure.md" ;;
  search)
    (cd tests && XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 \
      timeout ${T:-540} python3 -m pytest -q -p no:cacheprovider ${TESTS:-test_segments.py test_bn_relu.py} \
      > "$OUT/gpu_tests.txt" 2>&1; tail -5 "$OUT/gpu_tests.txt" > "$OUT/gpu_tests_tail.txt") &
    (cd /tmp && timeout 300 python3 "$ROOT/benchmarks/xla_ties.py" --sample-batches 100 > "$OUT/xla_ties.txt" 2>&1) &
    (cd /tmp && timeout ${T:-540} $LB --models ${MODELS:-mobilenetv2,efficientnetb0,resnet50} \
      --variants ${VARIANTS:-default,default-switch-act} --no-measure --jobs 10 --trial-timeout 200 \
      --out "$OUT/search.md") > "$OUT/search.log" 2>&1
    wait
    tail -30 "$OUT/search.md"; cat "$OUT/gpu_tests_tail.txt"; tail -15 "$OUT/xla_ties.txt" ;;
  tests)
    for t in ${TESTS:-test_pool_activations.py test_segments.py test_bn_relu.py}; do
      (cd tests && XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 TF_FORCE_GPU_ALLOW_GROWTH=true \
        timeout ${T:-560} python3 -m pytest -q -p no:cacheprovider $t > "$OUT/gpu_tests_${t%.py}.txt" 2>&1) &
    done
    (cd tests && for spec in ${DIGESTS:-ConvNeXtTiny:64:2 MobileNetV3Small:96:4 MobileNetV2:64:4 EfficientNetB0:64:4}; do
      IFS=: read m s b <<< "$spec"
      for v in stock product; do
        XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 TF_FORCE_GPU_ALLOW_GROWTH=true timeout 300 \
          python3 xla_step_digest.py $m $s $b $v logits gpu 2>&1 | grep RESULT | sed "s/^/$m $s $b /"
      done
    done > "$OUT/gpu_digests.txt" 2>&1) &
    wait
    for f in "$OUT"/gpu_tests_*.txt; do echo "== $f"; tail -4 "$f"; done; cat "$OUT/gpu_digests.txt" ;;
  account)
    for m in ${MODELS:-MobileNetV2 EfficientNetB0 ResNet50}; do
      D=/tmp/dump_$m; rm -rf $D
      (cd /tmp && XLA_FLAGS="$XLA_FLAGS --xla_dump_to=$D --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*one_step_on_data.*" \
        timeout ${T:-250} python3 $ROOT/benchmarks/segments_step_time.py $m --batch ${BATCH:-32} --dump $D \
        > "$OUT/account_$m.txt" 2>&1)
      grep -v "^[IWE]0000\|^WARNING" "$OUT/account_$m.txt" | grep -A200 RESULT | head -80
      for v in stock act; do   # the two files --analyze reads, for benchmarks/results
        mkdir -p "$OUT/dump_$m/$v"
        f=$(ls -S $D/$v/*one_step_on_data*after_optimizations.txt | head -1)
        xz -c "$f" > "$OUT/dump_$m/$v/one_step_on_data.after_optimizations.txt.xz"
        f=$(ls -S $D/$v/*one_step_on_data*buffer-assignment.txt | head -1)
        xz -c "$f" > "$OUT/dump_$m/$v/one_step_on_data.buffer-assignment.txt.xz"
      done
    done ;;
esac
