"""Training under tf.distribute with tf_relupool: MultiWorkerMirroredStrategy and MirroredStrategy.

**Several machines** (`--strategy multi_worker`, the default): one process per worker, each started
with the cluster in `TF_CONFIG` (TensorFlow's convention), in a custom training loop
(`strategy.run` inside a `tf.function`, `tf.nn.compute_average_loss` over the global batch: the
loop TensorFlow documents for this strategy; Keras 3's `fit` fails under it, keras-team/keras#20585):

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}' python examples/distributed.py
    (the same on host1 with "index": 1)

or, to try it on one machine, `--local-workers N` starts N worker processes on localhost (free
ports picked here, outside the OS's ephemeral range) and waits for them:

    python examples/distributed.py --local-workers 2 --variants off,switch,layer --steps 4

**The devices of one machine** (`--strategy mirrored`): Keras `fit` under MirroredStrategy over
`--replicas N` devices: the first N GPUs; N logical devices on one GPU when there are fewer (then
HierarchicalCopyAllReduce: NCCL cannot reduce between logical devices of one GPU); N logical CPUs
without a GPU (or with --device cpu). `--memory-limit MIB` caps each GPU replica.

    python examples/distributed.py --strategy mirrored --replicas 2 --variants off,switch

What tf_relupool adds is one line, `tf_relupool.enable_recompute()` before the first step: Keras
turns XLA off under a strategy, so the step runs through Grappler, where the switch fuses each
`Conv2D(activation="relu") -> MaxPooling2D` of the stock model (and its gradient). The "layer"
variant uses `tf_relupool.rewrite_model` (ReluMaxPool2D layers) instead.

Several comma-separated variants train the same initial weights on the same batches one after
another in the same processes. Per variant each worker prints its global step losses (reduced over
all replicas: the same on every worker), a digest of the final weights, the median peak memory of
a step on each replica's allocator (above resident; the CPU's needs TF_CPU_ALLOCATOR_USE_BFC=true,
which this script sets; logical CPUs share one) and the pooling, ReLU and convolution ops
TensorFlow executed (`tf_relupool.run_metadata.executed_nodes`), and which forward tensors the pooling
backward ops read. `--json FILE` writes the same as JSON
({task} in FILE becomes the worker's index); --deterministic turns TensorFlow's op determinism on.

A worker that dies or stops: the others fail with TensorFlow's error (UnavailableError from the
collective, or the coordination service's "tasks are unhealthy (stopped sending heartbeats)")
within about 10 s, TensorFlow's default heartbeat timeout; --collective-timeout also bounds each
collective (seconds; 0: no bound of its own).
"""
import argparse
import errno
import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import devices  # noqa: E402  (no TensorFlow import)

STRATEGIES = ("multi_worker", "mirrored")
VARIANTS = ("off", "switch", "layer")
MIB = 2.0 ** 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="multi_worker")
    p.add_argument("--variants", default="off,switch",
                   help="comma-separated: off (stock), switch (enable_recompute), layer "
                        "(rewrite_model's ReluMaxPool2D layers)")
    p.add_argument("--keep", choices=("argmax", "input"), default="argmax")
    p.add_argument("--model", default="simple",
                   help="simple, vgg, resnet (tf_relupool/_example_models.py, 32x32) or vgg16 "
                        "(keras.applications, --image-size, default 224)")
    p.add_argument("--image-size", type=int, default=0, help="vgg16's input size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--deterministic", action="store_true", help="tf op determinism")
    p.add_argument("--device", choices=devices.DEVICE_CHOICES, default="auto",
                   help="auto: GPUs when TensorFlow sees one, else the CPU")
    p.add_argument("--replicas", type=int, default=0,
                   help="mirrored: how many devices (0: every GPU, or 2 logical CPUs)")
    p.add_argument("--memory-limit", type=int, default=0,
                   help="mirrored: each GPU replica's memory limit in MiB (0: none)")
    p.add_argument("--collective-timeout", type=float, default=0.0,
                   help="multi_worker: seconds a collective may wait for its peers (0: no bound "
                        "of its own)")
    p.add_argument("--local-workers", type=int, default=0,
                   help="multi_worker: start this many worker processes on localhost, wait")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with --local-workers: seconds before the workers are stopped")
    p.add_argument("--json", help="write this process's results here as JSON; {task} in the "
                                  "name becomes the worker's index (results-{task}.json)")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(set(args.variants)) != len(args.variants):
        p.error("--variants: each variant at most once")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    if args.model not in ("simple", "vgg", "resnet", "vgg16"):
        p.error(f"--model: unknown model {args.model!r}")
    for name in ("steps", "global_batch_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("replicas", "memory_limit", "local_workers", "image_size"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.local_workers and args.strategy != "multi_worker":
        p.error("--local-workers goes with --strategy multi_worker")
    return args


# ---- the cluster: TF_CONFIG and local worker processes (no TensorFlow here) ----

#: Linux's default ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), where the OS picks
#: the local port of every outgoing connection and of every bind to port 0.
EPHEMERAL_DEFAULT = (32768, 60999)
_PORT_FLOOR = 10000   # below: the well-known and registered services' usual ports


def ephemeral_port_range():
    """(low, high) of the ports the OS hands out by itself (Linux's setting, else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def _bindable(port):
    """Whether `port` can be bound now on every IPv4 address, and on every IPv6 one where the
    machine has IPv6: where TensorFlow's gRPC server listens (0.0.0.0, dual-stack where it can)."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, host in families:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue   # no IPv6 here
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            # the family has no such address here (IPv6 switched off): nothing can take it there
        finally:
            s.close()
    return True


def free_ports(n):
    """n distinct TCP ports free on this machine now, outside the OS's ephemeral range.

    The workers bind them seconds later (after importing TensorFlow). A port from the ephemeral
    range (a bind to port 0) could be taken in between by any process's outgoing connection, the
    workers' own included, and a worker would then fail to start its server ("Could not start
    gRPC server") at random on a busy machine. Outside that range only a process that names the
    port itself can take it. Chosen with the OS's randomness (not the `random` module, which a
    seeded process repeats), so concurrent runs do not pick the same ports. Where the ephemeral
    range leaves no room, ports from a bind to port 0 (bound and released together)."""
    low, high = ephemeral_port_range()
    spans = [(a, b) for a, b in ((_PORT_FLOOR, low - 1), (high + 1, 65535)) if a <= b]
    total = sum(b - a + 1 for a, b in spans)
    picker = random.SystemRandom()
    ports = []
    for _ in range(200 * n if total >= 100 * n else 0):
        k = picker.randrange(total)
        for a, b in spans:   # the k-th port of the spans
            if k <= b - a:
                port = a + k
                break
            k -= b - a + 1
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports, index):
    """TF_CONFIG for worker `index` of a localhost cluster on `ports`."""
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def start_local_workers(n, argv, env=None, outputs=None, **popen_kwargs):
    """Starts n copies of this script as the workers of a localhost cluster; the Popen objects.
    outputs: one file per worker for its stdout and stderr (default: this process's)."""
    ports = free_ports(n)
    procs = []
    for i in range(n):
        worker_env = dict(os.environ if env is None else env, TF_CONFIG=tf_config(ports, i))
        if outputs is not None:
            popen_kwargs.update(stdout=outputs[i], stderr=subprocess.STDOUT)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                      env=worker_env, **popen_kwargs))
    return procs


def _without_local_workers(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local-workers":
            skip = True
        elif not a.startswith("--local-workers="):
            out.append(a)
    return out


def run_local(args, argv):
    """--local-workers: starts the workers, waits up to --timeout; the exit status."""
    procs = start_local_workers(args.local_workers, _without_local_workers(argv))
    deadline = time.monotonic() + args.timeout
    status = 0
    for i, proc in enumerate(procs):
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"worker {i}: still running after {args.timeout:.0f} s, stopped", file=sys.stderr)
            for p in procs:
                p.kill()
            return 1
        if rc:
            print(f"worker {i}: exit status {rc}", file=sys.stderr)
            status = status or rc
    return status


# ---- what every variant shares ----

def image_shape(args):
    if args.model == "vgg16":
        size = args.image_size or 224
        return (size, size, 3)
    return (32, 32, 3)


def build_model(args, variant):
    import keras
    import tf_relupool
    keras.utils.set_random_seed(0)   # the same initial weights in every process and variant
    if args.model == "vgg16":
        model = keras.applications.VGG16(weights=None, input_shape=image_shape(args), classes=10)
    else:
        from tf_relupool import _example_models as models
        model = models.build(args.model)
    return tf_relupool.rewrite_model(model, keep=args.keep) if variant == "layer" else model


def synthetic_data(args, n, seed=1):
    import numpy as np
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, *image_shape(args))).astype("float32"),
            rng.integers(0, 10, size=(n,)).astype("int32"))


def set_switch(variant, keep):
    import tf_relupool
    if variant == "switch":
        tf_relupool.enable_recompute(keep)   # the one line (before the first step)
    else:
        tf_relupool.disable_recompute()


def _reported(op_type):
    """The executed ops reported: pools, ReLUs, convolutions (stock's and the fused)."""
    return any(k in op_type for k in ("Pool", "Relu", "Conv2D"))


#: The pooling backward ops, and which of their inputs are forward tensors kept for them.
POOL_GRADS = {"MaxPoolGrad": (0, 1), "_MklNativeMaxPoolGrad": (0, 1), "ReluMaxPoolGrad": (0,),
              "ReluMaxPoolGradFromWindowArgmax": (2,)}


def kept_for_pool_grads(nodes):
    """What each executed pooling backward op reads from the forward pass: a sorted list of
    "backward op <- producer op:output" (the producer's op type and output index, through
    Identity nodes), one entry per kept input (POOL_GRADS). For the fused argmax gradient that is
    ReluMaxPoolWithWindowArgmax:1, its one-byte codes; for stock's MaxPoolGrad the ReLU'd tensor
    and the pooled output; for keep="input" the ReLU's input."""
    by_name = {n.name: n for n in nodes}

    def producer(ref):
        name, _, slot = ref.lstrip("^").partition(":")
        node = by_name.get(name)
        while node is not None and node.op == "Identity" and node.input:
            name, _, slot = node.input[0].partition(":")
            node = by_name.get(name)
        return f"{node.op if node is not None else '?'}:{slot or 0}"
    return sorted(f"{n.op} <- {producer(n.input[i])}" for n in nodes if n.op in POOL_GRADS
                  for i in POOL_GRADS[n.op] if i < len(n.input))


def summary(losses, weights, peaks, nodes, seconds):
    """One variant's results. peaks: {device: [bytes per step]} (the first step also traces and
    optimizes: the median of the later ones); nodes: the NodeDefs the first step executed;
    seconds: step times, likewise."""
    import numpy as np
    from tf_relupool import grappler
    stats = grappler.stats()
    ops = {}
    for n in nodes:
        ops[n.op] = ops.get(n.op, 0) + 1
    later = lambda v: v[1:] or v  # noqa: E731
    return {"losses": [np.float32(v).tobytes().hex() for v in losses],
            "loss_values": [float(v) for v in losses],
            "weights_sha256": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
            "peak_step_bytes": {d: statistics.median(later(p)) for d, p in peaks.items()
                                if p and p[0] is not None},
            "step_peaks_bytes": peaks,
            "step_seconds": statistics.median(later(seconds)),
            "executed_ops": {k: v for k, v in sorted(ops.items()) if _reported(k)},
            "kept_for_pool_grads": kept_for_pool_grads(nodes),
            "pass_fusions": stats["fused_with_grad"] + stats["fused_forward_only"]}


def print_results(results, prefix):
    for variant, r in results["variants"].items():
        peaks = ", ".join(f"{d} {b / MIB:.1f} MiB" for d, b in r["peak_step_bytes"].items())
        print(f"{prefix}{variant}: losses {[round(v, 6) for v in r['loss_values']]}, weights "
              f"{r['weights_sha256'][:12]}, peak step {peaks or 'n/a'}, step "
              f"{r['step_seconds'] * 1e3:.1f} ms, ops {r['executed_ops']}", flush=True)


# ---- MultiWorkerMirroredStrategy: one worker, a custom training loop ----

def train_multi_worker(tf, strategy, args, variant, dev):
    import keras
    from tf_relupool import grappler, run_metadata

    set_switch(variant, args.keep)
    global_batch = args.global_batch_size
    with strategy.scope():
        model = build_model(args, variant)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y = synthetic_data(args, global_batch * min(args.steps, 8))   # repeated past 8 steps

    def dataset_fn(ctx):
        # each worker reads its own shard and batches its share of the global batch
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(per_replica, drop_remainder=True).repeat()

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function(jit_compile=False)
    def train_step(iterator):
        def step_fn(inputs):
            images, labels = inputs
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(labels, logits),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        per_replica = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    meter = devices.StepMemory(tf, dev)
    grappler.reset_stats()
    losses, peaks, seconds, nodes = [], [], [], []
    task = strategy.cluster_resolver.task_id
    for step in range(args.steps):
        meter.begin()
        t = time.perf_counter()
        if step == 0:   # the first step: record the ops TensorFlow executed
            loss, nodes = run_metadata.executed_nodes(train_step, iterator)
        else:
            loss = train_step(iterator)
        losses.append(float(loss))
        seconds.append(time.perf_counter() - t)
        peaks.append(meter.end())
        print(f"[worker {task}] {variant} step {step} loss {losses[-1]:.6f}", flush=True)
    set_switch("off", args.keep)
    return summary(losses, model.get_weights(), {dev.name: peaks}, nodes, seconds)


def run_worker(args):
    devices.prepare_environment()
    tf, dev = devices.setup(args.device, deterministic=args.deterministic)
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=args.collective_timeout or None)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    task = strategy.cluster_resolver.task_id
    results = {"strategy": "multi_worker", "task": task,
               "replicas": strategy.num_replicas_in_sync, "device": dev.label(), "variants": {}}
    for variant in args.variants:
        results["variants"][variant] = train_multi_worker(tf, strategy, args, variant, dev)
    print_results(results, f"[worker {task}] ")
    return results


# ---- MirroredStrategy: the devices of one machine, Keras fit ----

def mirrored_devices(tf, args):
    """(device names, allocator names, cross-device ops, description) for --replicas."""
    gpus = tf.config.list_physical_devices("GPU") if args.device != "cpu" else []
    if args.device == "gpu" and not gpus:
        raise devices.DeviceError("no GPU visible to TensorFlow; use --device cpu or auto")
    if not gpus:
        tf.config.set_visible_devices([], "GPU")
        n = args.replicas or 2
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n)
        # logical CPUs share the process's CPU allocator: one peak for all replicas
        return ([f"/cpu:{i}" for i in range(n)], ["CPU:0"], None,
                f"{n} logical CPUs ({devices.cpu_description()})")
    n = args.replicas or len(gpus)
    limit = {"memory_limit": args.memory_limit} if args.memory_limit else {}
    if n <= len(gpus):
        for g in gpus[:n]:
            if limit:
                tf.config.set_logical_device_configuration(
                    g, [tf.config.LogicalDeviceConfiguration(**limit)])
        tf.config.set_visible_devices(gpus[:n], "GPU")
        cross = None   # MirroredStrategy's default: NCCL all-reduce
        what = f"{n} GPUs"
    else:
        # fewer GPUs than replicas: logical GPUs on the first one (every replica needs a limit)
        tf.config.set_visible_devices(gpus[:1], "GPU")
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(
                memory_limit=args.memory_limit or 16384)] * n)
        cross = tf.distribute.HierarchicalCopyAllReduce()
        what = f"{n} logical GPUs on one"
    details = tf.config.experimental.get_device_details(gpus[0])
    return ([f"/gpu:{i}" for i in range(n)], [f"GPU:{i}" for i in range(n)], cross,
            f"{what} ({details.get('device_name', 'GPU')})")


def train_mirrored(tf, strategy, allocators, args, variant):
    import keras
    from tf_relupool import grappler, run_metadata

    set_switch(variant, args.keep)
    with strategy.scope():
        model = build_model(args, variant)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = synthetic_data(args, args.global_batch_size * min(args.steps, 8))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch_size).repeat()
    meters = {a: devices.StepMemory(tf, devices.Device("gpu" if a.startswith("GPU") else "cpu",
                                                       a)) for a in allocators}
    for a, m in meters.items():
        m.name = a
    losses, seconds, peaks, start = [], [], {a: [] for a in allocators}, [0.0]

    def begin(batch, logs=None):
        for m in meters.values():
            m.begin()
        start[0] = time.perf_counter()

    def end(batch, logs=None):
        losses.append(float(logs["loss"]))   # waits for the step
        seconds.append(time.perf_counter() - start[0])
        for a, m in meters.items():
            peaks[a].append(m.end())

    cb = keras.callbacks.LambdaCallback(on_train_batch_begin=begin, on_train_batch_end=end)
    grappler.reset_stats()
    _, nodes = run_metadata.executed_nodes(model.fit, ds, epochs=1, steps_per_epoch=args.steps,
                                       verbose=0, callbacks=[cb])
    set_switch("off", args.keep)
    # the losses are what Keras logs after each step: the running mean over the epoch
    out = summary(losses, model.get_weights(), peaks, nodes, seconds)
    out["jit_compile"] = bool(model.jit_compile)
    return out


def run_mirrored(args):
    devices.prepare_environment(memory_limit_mib=args.memory_limit or None)
    import tensorflow as tf
    names, allocators, cross, what = mirrored_devices(tf, args)
    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
    strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=cross)
    results = {"strategy": "mirrored", "replicas": strategy.num_replicas_in_sync,
               "device": what, "tensorflow": tf.__version__, "variants": {}}
    for variant in args.variants:
        results["variants"][variant] = train_mirrored(tf, strategy, allocators, args, variant)
    print_results(results, "")
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.local_workers:
        return run_local(args, argv)
    if args.strategy == "multi_worker" and "TF_CONFIG" not in os.environ:
        print("TF_CONFIG is not set: start one process per worker with it, or use "
              "--local-workers N (or --strategy mirrored for the devices of one machine)",
              file=sys.stderr)
        return 2
    results = run_worker(args) if args.strategy == "multi_worker" else run_mirrored(args)
    if args.json:
        with open(args.json.replace("{task}", str(results.get("task", 0))), "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
