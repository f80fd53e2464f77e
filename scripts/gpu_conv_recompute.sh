#!/bin/bash
# enable_recompute(memory_budget=b) on the GPU, from the project root once the bundle's pieces
# are in /tmp/tfparts (.tfgpu/common and .tfgpu/pkg carried, as scripts/gpu_segments.sh):
#   bits   XLA's deterministic mode, tests/xla_step_digest.py's digests of two SGD steps, stock
#          and memory_budget=0 each in a fresh process (MobileNetV2 96x96 b8, ResNet50 64x64 b4),
#          and tests/conv_bn_pool_bits.py (the pool fusion after a bias / BatchNormalization)
#   time   benchmarks/segments_step_time.py: stock, activations=True and budgets side by side in
#          one process per model (224x224, batch 32, fp32): steady peaks and interleaved times
#   batch  benchmarks/largest_batch.py: the largest batch under a 4 GiB memory_limit
# Output under $OUT (default build/gpu_conv_recompute).
set -o pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/gpu_conv_recompute}
mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || { echo "setup_tf.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for phase in ${PHASES:-bits time batch}; do
  case $phase in
  bits)
    DET="$XLA_FLAGS --xla_gpu_deterministic_ops=true"
    ( cd tests
      for spec in ${BIT_MODELS:-MobileNetV2:96:8 ResNet50:64:4}; do
        IFS=: read m s b <<< "$spec"
        for v in stock budget0; do
          XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 timeout 300 python3 xla_step_digest.py \
            $m $s $b $v logits gpu 2>&1 | grep '^RESULT ' | tail -1 | python3 -c \
            "import json,sys; r=json.loads(sys.stdin.read()[7:]); print('$m $s $b $v', r['$v'], r['stats']['by_activation'])"
        done
      done
      XLA_FLAGS="$DET" TF_CUDNN_DETERMINISTIC=1 timeout 300 python3 conv_bn_pool_bits.py 2>&1 \
        | grep '^|\|TensorFlow'
    ) | tee "$OUT/bits.txt" ;;
  time)
    for m in ${TIME_MODELS:-MobileNetV2 ResNet50}; do
      timeout ${TIME_LIMIT:-280} python3 benchmarks/segments_step_time.py $m --batch 32 \
        --rounds ${ROUNDS:-8} --steps 5 --variants ${TIME_VARIANTS:-stock,act,b50,b0} 2>&1 \
        | grep '^RESULT' | tee -a "$OUT/time.txt"
    done ;;
  batch)
    timeout ${BATCH_LIMIT:-540} python3 benchmarks/largest_batch.py --models ${BATCH_MODELS:-mobilenetv2} \
      --variants ${BATCH_VARIANTS:-default-switch-b0} --no-measure --memory-limit 4096 \
      --jobs ${JOBS:-8} --out "$OUT/largest_batch.md" > "$OUT/batch.log" 2>&1
    tail -30 "$OUT/batch.log" ;;
  esac
done
