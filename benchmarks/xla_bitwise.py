"""Stock vs the switch under XLA on a GPU, bit for bit: a few Keras training steps each.

Each variant trains in a process of its own (XLA_FLAGS is read when TensorFlow starts) from the
same weights and data at Keras' default compile; the script prints each step's loss in hex and
whether every loss and final weight matches stock's. XLA on the GPU is deterministic only with
--xla_gpu_deterministic_ops=true (default here; --nondeterministic leaves XLA's default).

    python benchmarks/xla_bitwise.py --models simple,vgg,resnet --policy mixed_bfloat16
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys


def worker(model_name, variant, policy, batch, steps):
    import numpy as np
    import tensorflow as tf
    import gpu_memory  # beside this script: its models, variants and training step
    model = gpu_memory.build_model(tf, model_name, variant, policy=policy)
    x, y = gpu_memory.synthetic_batch(tf, batch, model=model)
    losses = [float(gpu_memory._step(model, x, y, variant)).hex() for _ in range(steps)]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w.numpy()).tobytes()
                                     for w in model.weights)).hexdigest()
    print("RESULT " + json.dumps({"losses": losses, "weights": digest,
                                  "jit_compile": bool(model.jit_compile)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="simple,vgg,resnet")
    p.add_argument("--variants", default="default-switch,default-layer")
    p.add_argument("--policy", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nondeterministic", action="store_true")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], a.policy, a.batch, a.steps)
        return 0
    env = dict(os.environ)
    if not a.nondeterministic:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    bad = 0
    for m in a.models.split(","):
        results = {}
        for v in ["default"] + a.variants.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", m, v, "--batch",
                   str(a.batch), "--steps", str(a.steps)] + (["--policy", a.policy] if a.policy else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(f"{m} {v}: failed:\n{proc.stderr[-2000:]}")
                bad += 1
                continue
            results[v] = json.loads(line[-1][7:])
        ref = results.get("default")
        for v, r in results.items():
            same = ref is not None and r["losses"] == ref["losses"] and r["weights"] == ref["weights"]
            bad += v != "default" and not same
            print(f"{m} {a.policy or 'float32'} {v}: jit_compile={r['jit_compile']} losses "
                  f"{' '.join(r['losses'])} weights {r['weights'][:12]}"
                  + ("" if v == "default" else f" {'BITWISE EQUAL' if same else 'DIFFERENT'}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
