"""Where does ResNet50's gradient with the switch on first differ from the switch off (GPU)?
Per-variable gradient comparison (model order) and the stem's executed nodes, both runs."""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CUDNN_USE_AUTOTUNE", "0")
import numpy as np
import tensorflow as tf
import keras
import tf_relupool
from tf_relupool import grappler
from tensorflow.python.eager import context
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.experimental.enable_op_determinism()
tf.random.set_seed(0)
keras.utils.set_random_seed(0)
size = int(sys.argv[1]) if len(sys.argv) > 1 else 32
if "layout-off" in sys.argv:
    tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
if "remapper-off" in sys.argv:
    tf.config.optimizer.set_experimental_options({"remapping": False})
if "arith-off" in sys.argv:
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
x = tf.random.stateless_normal([2, size, size, 3], seed=[1, 2])
V = model.trainable_variables

def make():
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=True)
            loss = tf.reduce_sum(y * y)
        return [y] + tape.gradient(loss, [x] + V)
    return step

def run(on):
    (tf_relupool.enable_recompute if on else tf_relupool.disable_recompute)()
    ctx = context.context(); ctx.enable_graph_collection()
    out = tf.function(make(), jit_compile=False)(x)
    meta = ctx.export_run_metadata(); ctx.disable_graph_collection()
    nodes = [n for g in meta.function_graphs for n in g.post_optimization_graph.node]
    return [o.numpy() for o in out], nodes

off, off_nodes = run(False)
on, on_nodes = run(True)
print("stats", grappler.stats())
names = ["y", "x"] + [v.path for v in V]
for name, a, b in zip(names, off, on):
    same = a.tobytes() == b.tobytes()
    d = float(np.max(np.abs(a - b))) if a.size else 0.0
    n = int(np.sum(a != b))
    print(f"{'SAME' if same else 'DIFF'} {name} {list(a.shape)} ndiff={n} maxdiff={d:.3g} max={float(np.max(np.abs(a))):.3g}")

from collections import Counter
def sig(n):
    fmt = n.attr["data_format"].s.decode() if "data_format" in n.attr else ""
    return f"{n.op}{'/' + fmt if fmt else ''}"
co, cn = Counter(sig(n) for n in off_nodes), Counter(sig(n) for n in on_nodes)
print("ops only off:", dict(co - cn)); print("ops only on:", dict(cn - co))
def stem(nodes, tag):
    print(f"--- {tag}: gradient nodes of conv1_bn / pool1 / conv1_relu ---")
    for n in nodes:
        if any(k in n.name for k in ("conv1_bn", "pool1_", "conv1_relu")) and n.op not in ("Const", "_Arg", "ReadVariableOp"):
            print(f"  {sig(n):28s} {n.name[-60:]:60s} <- {[i[-45:] for i in n.input][:3]}")
stem(off_nodes, "off"); stem(on_nodes, "on")
