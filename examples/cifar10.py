"""Train a CIFAR-10 CNN with Keras, stock or with tf_relupool's fused ReLU + max pool.

The models (tf_relupool/_example_models.py) use stock Keras layers only. --recompute names what
trains:

    off     the stock model as written
    argmax  the stock model after the one line a user adds before compile():
                tf_relupool.enable_recompute()                 # keep="argmax", the default
    input   the same with tf_relupool.enable_recompute(keep="input")
    layer   the model rewritten to tf_relupool's layer, the switch left off:
                model = tf_relupool.rewrite_model(model, keep="argmax")   # -> ReluMaxPool2D

Several comma-separated modes (--recompute off,argmax) train the same initial weights on the same
batches once per mode, one after another, and print a side-by-side summary. Per epoch, after
Keras's progress bar: loss, accuracy, median step time and peak training-step memory (bytes
allocated during a step above what was resident before it, from the allocator statistics of the
device that trains: the GPU's when TensorFlow sees one, else the CPU's BFC allocator), and for
each mode how many ReLU + max pool pairs its training step fuses. The output names the device
measured; --device cpu|gpu chooses it, --layout-optimizer/--remapper off turn those Grappler
passes off, --memory-limit caps the GPU's memory.

examples:
  python examples/cifar10.py                                  # simple CNN, stock, synthetic data
  python examples/cifar10.py --recompute off,argmax           # stock vs enable_recompute()
  python examples/cifar10.py --model vgg --recompute off,argmax,layer --epochs 2
  python examples/cifar10.py --data ../shared/data/cifar10-jpeg.tar.gz --limit 10000
  python examples/cifar10.py --data keras                     # keras.datasets.cifar10
  python examples/cifar10.py --device gpu --layout-optimizer off --batch-size 1024
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data as data_lib  # noqa: E402  (no TensorFlow import)
import devices  # noqa: E402  (no TensorFlow import)

MODELS = ("simple", "vgg", "resnet")
MODES = ("off", "argmax", "input", "layer")
# What each mode trains, as the summary names it.
MODE_LABELS = {"off": "stock", "argmax": "enable_recompute()",
               "input": "enable_recompute(keep='input')",
               "layer": "rewrite_model(keep='argmax') (ReluMaxPool2D)"}
MIB = 2.0 ** 20


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(name, minimum=1):
    def parse(text):
        kind = "a positive" if minimum == 1 else "a non-negative"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind} integer, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = name
    return parse


def _on_off(text):
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value == "on"


def _modes(text):
    modes = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(
            f"invalid choice {','.join(bad) or text!r} (choose from {', '.join(MODES)}, "
            "or several separated by commas)")
    return modes


def parse_args(argv=None):
    head, examples = __doc__.split("\nexamples:\n")
    p = OneLineParser(prog="cifar10.py", description=head.strip(), epilog="examples:\n" + examples,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="simple",
                   help="simple CNN, VGG-style or ResNet-style (default simple)")
    p.add_argument("--jit-compile", choices=("auto", "true", "false"), default="auto",
                   help="Keras' jit_compile: auto (default, what compile() does: XLA whenever a "
                        "GPU is visible, the fused op's XLA form then), true or false")
    p.add_argument("--recompute", type=_modes, default=["off"],
                   metavar="{off,argmax,input,layer}",
                   help="off: the stock model; argmax: the stock model under "
                        "tf_relupool.enable_recompute() (its default, 1-byte argmax codes); "
                        "input: under enable_recompute(keep='input'); layer: "
                        "tf_relupool.rewrite_model(model, keep='argmax'), the switch off; several, "
                        "comma-separated, train one after another from the same weights "
                        "(default off)")
    p.add_argument("--batch-size", type=_positive_int("batch size"), default=128)
    p.add_argument("--epochs", type=_positive_int("epochs"), default=1)
    p.add_argument("--steps-per-epoch", type=_positive_int("steps"), default=None)
    p.add_argument("--data", default="synthetic",
                   help="synthetic (offline default), keras (keras.datasets.cifar10), an "
                        "image-folder directory (<class>/ or train/<class>/ + test/<class>/) "
                        "or a .tar.gz of one")
    p.add_argument("--limit", type=_positive_int("image count"), default=None,
                   help="use only this many training images")
    p.add_argument("--test-limit", type=_positive_int("image count"), default=None,
                   help="use only this many test images")
    p.add_argument("--prefetch", type=_positive_int("batch count", minimum=0), default=2,
                   help="batches the input pipeline makes ahead on its own threads (default 2); "
                        "0 makes each batch inside the step that reads it, so that no input "
                        "allocation runs beside the step and the CPU's peak repeats")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record-ops", action="store_true",
                   help="record the pooling ops TensorFlow executed in fit (JSON: "
                        "executed_pool_ops; tf_relupool.run_metadata.executed_ops)")
    p.add_argument("--deterministic", action="store_true",
                   help="tf.config.experimental.enable_op_determinism() (bitwise-repeatable)")
    p.add_argument("--inter-op-threads", type=int, default=1,
                   help="TensorFlow inter-op parallelism; 1 (default) makes the peak memory "
                        "comparable between runs, 0 is TensorFlow's default")
    p.add_argument("--device", choices=devices.DEVICE_CHOICES, default="auto",
                   help="auto (default): the first GPU when TensorFlow sees one, else the CPU; "
                        "the peak memory is read from that device's allocator")
    p.add_argument("--layout-optimizer", type=_on_off, default=True, metavar="{on,off}",
                   help="Grappler's layout optimizer (default on, TensorFlow's default; on the "
                        "GPU it turns fp32 NHWC convolutions into NCHW with transposes)")
    p.add_argument("--remapper", type=_on_off, default=True, metavar="{on,off}",
                   help="Grappler's remapper (default on; on the GPU it fuses Conv2D+BiasAdd+Relu)")
    p.add_argument("--memory-limit", type=_positive_int("MiB"), default=None, metavar="MIB",
                   help="GPU only: the GPU's memory_limit in MiB (a logical device set before "
                        "TensorFlow initialises the GPU); a batch that does not fit fails with "
                        "an out-of-memory error")
    p.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2),
                   help="Keras fit verbosity (1: progress bar)")
    p.add_argument("--json", metavar="FILE", help="also write the results (per-step losses, "
                   "accuracies, times, peaks) to FILE as JSON")
    args = p.parse_args(argv)
    try:
        args.data = data_lib.check_source(args.data)
    except data_lib.DataError as e:
        p.error(f"argument --data: {e}")
    return args, p


def _setup_tensorflow(args, parser):
    """TensorFlow configured for args.device; returns (tf, devices.Device)."""
    # On the CPU, the BFC allocator keeps the statistics read below; it must be chosen before TF
    # starts. A GPU memory limit must be set before TF initialises the GPU, without growth.
    devices.prepare_environment(memory_limit_mib=args.memory_limit)
    try:
        tf, dev = devices.setup(args.device, memory_limit_mib=args.memory_limit,
                                layout_optimizer=None if args.layout_optimizer else False,
                                remapper=None if args.remapper else False,
                                inter_op_threads=args.inter_op_threads,
                                deterministic=args.deterministic)
    except devices.DeviceError as e:
        parser.error(f"argument --device: {e}")
    if args.memory_limit and dev.kind != "gpu":
        parser.error("argument --memory-limit: needs a GPU (TensorFlow trains on the CPU here)")
    return tf, dev


def switch_fusions():
    """ReLU + max pool pairs the switch has fused in this process so far: at trace time inside
    XLA (tf_relupool.keras_fusion) plus, with their gradient, by the Grappler pass."""
    from tf_relupool import grappler, keras_fusion
    return keras_fusion.stats()["fused"] + grappler.stats()["fused_with_grad"]


def _step_stats_callback(tf, dev, fusions=None):
    """The per-step statistics callback; `fusions`, a counter read before the first step and
    after it, gives `first_step_fusions`: what the switch fused in the training step."""
    import keras

    class StepStats(keras.callbacks.Callback):
        """Per training step: wall time, peak allocator bytes above resident, loss."""

        def __init__(self):
            super().__init__()
            self.first_step_fusions = None
            self._fusions_before = fusions() if fusions else None
            self.epochs = []
            self.meter = devices.StepMemory(tf, dev)
            self.memory = self.meter.available  # False: e.g. CPU without TF_CPU_ALLOCATOR_USE_BFC

        def on_epoch_begin(self, epoch, logs=None):
            self.times, self.peaks, self.losses = [], [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.meter.begin()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            loss = float(logs["loss"])  # waits for the step
            self.times.append(time.perf_counter() - self.start)
            self.losses.append(loss)
            if self.memory:
                self.peaks.append(self.meter.end())
            if fusions and self.first_step_fusions is None:  # the step was traced and optimized
                self.first_step_fusions = fusions() - self._fusions_before

        def on_epoch_end(self, epoch, logs=None):
            times = self.times[1:] if epoch == 0 and len(self.times) > 1 else self.times
            stats = {"epoch": epoch + 1, "loss": float(logs["loss"]),
                     "accuracy": float(logs["accuracy"]),
                     "step_time_s": statistics.median(times),
                     "peak_bytes": max(self.peaks) if self.peaks else None,
                     "median_peak_bytes": statistics.median(self.peaks) if self.peaks else None,
                     "step_losses": self.losses, "step_peak_bytes": self.peaks}
            self.epochs.append(stats)
            peak = (f"peak step memory on {dev.name} {stats['peak_bytes'] / MIB:.1f} MiB "
                    f"(median {stats['median_peak_bytes'] / MIB:.1f})" if self.peaks
                    else f"peak step memory n/a ({self.meter.reason}; on the CPU set "
                         "TF_CPU_ALLOCATOR_USE_BFC=true)")
            print(f"epoch {epoch + 1}: loss {stats['loss']:.4f}, accuracy "
                  f"{stats['accuracy']:.4f}, step time {stats['step_time_s'] * 1e3:.0f} ms "
                  f"(median), {peak}", flush=True)

    return StepStats()


def train_one(args, mode, tf, dev):
    """Builds, (rewrites,) compiles, fits and evaluates the model for one --recompute mode."""
    import keras
    from tf_relupool import _example_models as models
    import tf_relupool

    keras.utils.set_random_seed(args.seed)  # same initial weights and batches for every mode
    train, test, description, num_classes = data_lib.load(args.data, args.batch_size, args.limit,
                                             args.test_limit, args.seed,
                                             prefetch=args.prefetch)
    if args.steps_per_epoch:  # epochs of a fixed number of steps: never run out of data
        train = train.repeat()
    model = models.build(args.model, num_classes=num_classes)
    tf_relupool.disable_recompute()
    if mode in ("argmax", "input"):
        tf_relupool.enable_recompute(keep=mode)  # the one line; the model stays as written
    elif mode == "layer":
        model = tf_relupool.rewrite_model(model, keep="argmax")  # new model, same weights
    layers = sum(isinstance(l, tf_relupool.ReluMaxPool2D) for l in _all_layers(model))
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"],
                  jit_compile={"auto": "auto", "true": True, "false": False}[args.jit_compile])
    print(f"== {args.model}, recompute {mode}: {MODE_LABELS[mode]}"
          + (f", {layers} ReluMaxPool2D layer(s)" if mode == "layer" else "")
          + f"; {description}; batch {args.batch_size}", flush=True)
    switched = mode in ("argmax", "input")
    stats = _step_stats_callback(tf, dev, fusions=switch_fusions if switched else None)
    callbacks = [stats]
    if args.verbose:  # the progress bar first, so that each epoch's line follows its bar
        callbacks.insert(0, keras.callbacks.ProgbarLogger())
    fit = dict(epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks,
               verbose=args.verbose)
    executed = None
    if args.record_ops:   # the pooling ops the training steps executed (partition graphs)
        from tf_relupool import run_metadata
        _, ops = run_metadata.executed_ops(model.fit, train, **fit)
        executed = {k: v for k, v in sorted(ops.items()) if "Pool" in k}
    else:
        model.fit(train, **fit)
    # The pairs fused in the training step: the layer's are its layers; the switch's are those
    # it fused while Keras traced the first step (XLA) or TensorFlow optimized it (Grappler).
    fused = stats.first_step_fusions if switched else layers
    if switched:
        print(f"enable_recompute() fused {fused} ReLU + max pool pair(s) in the training step",
              flush=True)
    test_loss, test_acc = model.evaluate(test, verbose=0)
    print(f"test: loss {test_loss:.4f}, accuracy {test_acc:.4f}", flush=True)
    tf_relupool.disable_recompute()
    return {"mode": mode, "variant": MODE_LABELS[mode], "model": args.model,
            "fused_pairs": fused, "fused_layers": layers, "epochs": stats.epochs,
            "test_loss": float(test_loss), "test_accuracy": float(test_acc),
            "executed_pool_ops": executed}


def _all_layers(model):
    for layer in model.layers:
        yield layer
        if hasattr(layer, "layers"):
            yield from _all_layers(layer)


def summary(results, dev=None):
    """A side-by-side table of the last epoch of each mode, with the device measured."""
    ref = results[0]["epochs"][-1]
    lines = []
    if dev is not None:
        lines += [f"device measured: {dev.label()}; Grappler layout optimizer "
                  f"{dev.grappler.get('layout_optimizer', 'on')}, remapper "
                  f"{dev.grappler.get('remapper', 'on')}"
                  + (f"; memory limit {dev.memory_limit_mib} MiB" if dev.memory_limit_mib else ""),
                  ""]
    lines += ["| recompute | what trains | pairs fused | peak step memory, max (MiB) | "
              "median (MiB) | median vs first | step time (ms) | speed vs first | train loss | "
              "test accuracy |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r["epochs"][-1]
        peak = f"{e['peak_bytes'] / MIB:.1f}" if e["peak_bytes"] else "n/a"
        median = f"{e['median_peak_bytes'] / MIB:.1f}" if e["peak_bytes"] else "n/a"
        ratio = f"{e['median_peak_bytes'] / ref['median_peak_bytes']:.2f}x" if \
            e["peak_bytes"] and ref["peak_bytes"] else "n/a"
        lines.append(f"| {r['mode']} | {MODE_LABELS[r['mode']]} | {r['fused_pairs']} | {peak} | "
                     f"{median} | {ratio} | {e['step_time_s'] * 1e3:.0f} | "
                     f"{ref['step_time_s'] / e['step_time_s']:.2f}x | {e['loss']:.4f} | "
                     f"{r['test_accuracy']:.4f} |")
    if len(results) > 1:
        same = all(r["epochs"][i]["step_losses"] == results[0]["epochs"][i]["step_losses"]
                   for r in results[1:] for i in range(len(r["epochs"])))
        lines.append("")
        lines.append("per-step training losses bitwise equal across modes: "
                     f"{'yes' if same else 'no'}")
        if not same and dev is not None and dev.kind == "gpu" and \
                dev.grappler.get("remapper") == "on" and any(r["mode"] == "layer" for r in results):
            lines.append("(on the GPU the remapper fuses stock Conv2D+BiasAdd+Relu into one cuDNN "
                         "call, which the layer's convolutions, without their ReLU, do not get: "
                         "its losses differ in the last bits; --remapper off --deterministic "
                         "makes them bitwise equal)")
    return "\n".join(lines)


def main(argv=None):
    args, parser = parse_args(argv)
    tf, dev = _setup_tensorflow(args, parser)
    print(f"training on {dev.label()}; peak step memory from its allocator"
          + (f"; memory limit {args.memory_limit} MiB" if args.memory_limit else ""), flush=True)
    results = []
    try:
        for mode in args.recompute:
            results.append(train_one(args, mode, tf, dev))
    except data_lib.DataError as e:
        parser.error(f"argument --data: {e}")
    except tf.errors.ResourceExhaustedError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"cifar10.py: out of memory on {dev.name} at batch {args.batch_size}"
              + (f" under memory limit {args.memory_limit} MiB" if args.memory_limit else "")
              + f": {first[:200]}", file=sys.stderr)
        return 1
    print()
    print(summary(results, dev))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
