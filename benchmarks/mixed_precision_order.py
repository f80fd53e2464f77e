"""Is the mixed_bfloat16 order effect ours? Trains the same Keras model
(tf_relupool/_example_models.py, same weights, same batch) several times in one process, in a given order of variants, and prints each
training's losses and GPU-allocator peak. Each scenario runs in a fresh process:

  no-library      stock, stock              tf_relupool never imported
  stock-first     stock, fused, stock, fused
  fused-first     fused, stock, fused, stock
  deterministic   stock, fused, stock, fused   with tf.config.experimental.enable_op_determinism()

If trainings of the same variant differ between positions even where tf_relupool is never
imported, the effect is TensorFlow's (cuDNN autotuning picks per process), not the fused op's.

    python benchmarks/mixed_precision_order.py [--model simple] [--batch 256] [--steps 3]
"""
import argparse
import os
import sys

import harness  # beside this script: the models, the worker protocol (no TensorFlow import)

SCENARIOS = {
    "no-library": (["stock", "stock"], False),
    "stock-first": (["stock", "fused", "stock", "fused"], False),
    "fused-first": (["fused", "stock", "fused", "stock"], False),
    "deterministic": (["stock", "fused", "stock", "fused"], True),
}


def worker(args):
    order, deterministic = SCENARIOS[args.scenario]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import keras
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.mixed_precision.set_global_policy(args.policy)
    x, y = harness.synthetic_batch(tf, args.batch, seeds=([0, 1], [2, 3]))
    gpu = bool(tf.config.list_physical_devices("GPU"))
    runs = []
    for variant in order:
        # stock, or fused: harness's fused argmax (tf_relupool is imported for it only)
        m = harness.build_model(tf, args.model, "argmax" if variant == "fused" else "stock")
        losses, peaks = [], []
        for _ in range(args.steps):
            if gpu:
                tf.config.experimental.reset_memory_stats("GPU:0")
            losses.append(harness.train_step(m, x, y))
            if gpu:
                peaks.append(tf.config.experimental.get_memory_info("GPU:0")["peak"] / harness.MIB)
        runs.append(dict(variant=variant, losses=losses, peak_mib=peaks))
    harness.print_result(runs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="simple")
    p.add_argument("--policy", default="mixed_bfloat16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--scenario", choices=tuple(SCENARIOS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.scenario:
        return worker(args)
    print(f"{args.model}, {args.policy}, batch {args.batch}, {args.steps} SGD steps from the same "
          "weights; losses and GPU:0 peak (MiB) per step")
    for name in SCENARIOS:
        runs, proc = harness.run_worker(
            [sys.executable, os.path.abspath(__file__), "--scenario", name, "--model", args.model,
             "--policy", args.policy, "--batch", str(args.batch), "--steps", str(args.steps)],
            timeout=600)
        if runs is None:
            print(f"{name}: failed (rc {proc.returncode}): {proc.stderr[-1500:]}")
            continue
        first = {}
        for i, r in enumerate(runs):
            same = first.setdefault(r["variant"], r["losses"]) == r["losses"]
            print(f"{name:14s} #{i + 1} {r['variant']:6s} losses {r['losses']} "
                  f"{'(= its first run)' if same else '(DIFFERS from its first run)'} "
                  f"peaks {[round(v, 1) for v in r['peak_mib']]}")


if __name__ == "__main__":
    main()
