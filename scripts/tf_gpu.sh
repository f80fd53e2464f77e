#!/bin/bash
# The GPU through TensorFlow: one `run` call on the H200 after the bundle's four pieces are in
# /tmp/tfparts (see ../shared/tools/tf-gpu/README.md): sources the trimmed TensorFlow, then runs
# STEPS (default "test bench"), each writing under $OUT (default build/tf_gpu):
#   test     make gpu-test: the whole suite with the GPU visible    -> gpu_test.txt
#   bench    benchmarks/bench_ops.py --device gpu: op speed vs stock -> bench_gpu.md
#   memory   benchmarks/memory_report.py on the GPU (MEMORY_ARGS)   -> gpu_memory.md
#   grappler benchmarks/grappler_gpu.py: the pass on the GPU       -> grappler_gpu.txt
#   breakdown benchmarks/memory_breakdown.py per BREAKDOWN_RUNS ("model:config ...", default
#            "simple:default"), raw profiles kept          -> breakdown/, breakdown.txt
#   order    benchmarks/mixed_precision_order.py (ORDER_ARGS)      -> mixed_precision_order.txt
#   ties     benchmarks/xla_ties.py: tied max-pool windows under XLA, stock vs the switch
#            (TIES_ARGS, default --sample-batches 300)              -> xla_ties.txt
#   cpubench benchmarks/bench_ops.py on the host CPU, GPU hidden; one run per ';'-separated
#            argument list in CPUBENCH_RUNS (default: all tables, oneDNN on and off)
#                                                                   -> bench_cpu.md, lscpu.txt
#   cputrain benchmarks/gpu_memory.py --device cpu: a Keras training step on the host CPU, stock
#            vs fused vs the switch (CPUTRAIN_ARGS)              -> cpu_training_step.md/.json
#   harness  make gpu-check (TensorFlow-free kernel checks + table)  -> gpu_check.txt
#   sanitize make gpu-sanitize (compute-sanitizer, small sizes)     -> gpu_sanitize.txt
# Run from the project root with .tfgpu/common and .tfgpu/pkg carried.
set -o pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/tf_gpu}
mkdir -p "$OUT"
source .tfgpu/common/setup_tf.sh || { echo "setup_tf.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia-smi.txt" 2>&1
rc=0
for step in ${STEPS:-test bench}; do
  echo "== $step $(date +%T)"
  case $step in
    test)
      timeout ${TEST_TIMEOUT:-420} make --no-print-directory gpu-test GPU_TEST_ARGS="${GPU_TEST_ARGS:--x -n 8}" \
        > "$OUT/gpu_test.txt" 2>&1 || rc=1
      tail -25 "$OUT/gpu_test.txt" ;;
    bench)
      (cd /tmp && timeout ${BENCH_TIMEOUT:-300} python3 "$ROOT/benchmarks/bench_ops.py" --device gpu $BENCH_ARGS) \
        > "$OUT/bench_gpu.md" 2>"$OUT/bench_gpu.err" || { rc=1; tail -20 "$OUT/bench_gpu.err"; }
      cat "$OUT/bench_gpu.md" ;;
    memory)
      (cd /tmp && timeout ${MEMORY_TIMEOUT:-360} python3 "$ROOT/benchmarks/memory_report.py" $MEMORY_ARGS) \
        > "$OUT/gpu_memory.txt" 2>&1 || rc=1
      tail -40 "$OUT/gpu_memory.txt" ;;
    grappler)
      (cd /tmp && timeout ${GRAPPLER_TIMEOUT:-300} python3 "$ROOT/benchmarks/grappler_gpu.py") \
        > "$OUT/grappler_gpu.txt" 2>&1 || rc=1
      tail -30 "$OUT/grappler_gpu.txt" ;;
    breakdown)
      for mc in ${BREAKDOWN_RUNS:-simple:default}; do
        (cd /tmp && timeout ${BREAKDOWN_TIMEOUT:-200} python3 "$ROOT/benchmarks/memory_breakdown.py" \
          --device gpu --model ${mc%%:*} --config ${mc##*:} --keep "$OUT/breakdown" $BREAKDOWN_ARGS) \
          >> "$OUT/breakdown.txt" 2>&1 || rc=1
      done
      grep -E "^###|in use at the peak" "$OUT/breakdown.txt" | tail -20 ;;
    order)
      (cd /tmp && timeout ${ORDER_TIMEOUT:-300} python3 "$ROOT/benchmarks/mixed_precision_order.py" $ORDER_ARGS) \
        > "$OUT/mixed_precision_order.txt" 2>&1 || rc=1
      tail -20 "$OUT/mixed_precision_order.txt" ;;
    ties)
      (cd /tmp && timeout ${TIES_TIMEOUT:-500} python3 "$ROOT/benchmarks/xla_ties.py" \
        ${TIES_ARGS:---sample-batches 300}) > "$OUT/xla_ties.txt" 2>"$OUT/xla_ties.err" \
        || { rc=1; tail -20 "$OUT/xla_ties.err"; }
      cat "$OUT/xla_ties.txt" ;;
    cpubench)
      lscpu > "$OUT/lscpu.txt" 2>&1
      IFS=';' read -ra runs <<< "${CPUBENCH_RUNS:- }"
      for args in "${runs[@]}"; do
        (cd /tmp && CUDA_VISIBLE_DEVICES=-1 timeout ${CPUBENCH_TIMEOUT:-500} \
          python3 "$ROOT/benchmarks/bench_ops.py" $args) >> "$OUT/bench_cpu.md" 2>>"$OUT/bench_cpu.err" \
          || { rc=1; tail -20 "$OUT/bench_cpu.err"; }
        echo >> "$OUT/bench_cpu.md"
      done
      cat "$OUT/bench_cpu.md" ;;
    cputrain)
      (cd /tmp && CUDA_VISIBLE_DEVICES=-1 timeout ${CPUTRAIN_TIMEOUT:-500} python3 "$ROOT/benchmarks/gpu_memory.py" \
        --device cpu --models simple --variants stock,argmax,switch --batch-sizes 128 --time-batch 128 \
        --no-search --rounds 15 --out "$OUT/cpu_training_step.md" $CPUTRAIN_ARGS) > "$OUT/cputrain.txt" 2>&1 || rc=1
      tail -20 "$OUT/cputrain.txt" ;;
    harness)
      timeout ${HARNESS_TIMEOUT:-400} make --no-print-directory gpu-check GPU_ARCH="-gencode arch=compute_90,code=sm_90" \
        GPU_CHECK_ARGS="$HARNESS_ARGS" > "$OUT/gpu_check.txt" 2>&1 || rc=1
      grep -E "CHECKS|FAIL|^\|" "$OUT/gpu_check.txt" | tail -30 ;;
    sanitize)
      make --no-print-directory gpu-sanitize GPU_ARCH="-gencode arch=compute_90,code=sm_90" > "$OUT/gpu_sanitize.txt" 2>&1 || rc=1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|CHECKS|rror" "$OUT/gpu_sanitize.txt" | tail -12 ;;
  esac
done
exit $rc
