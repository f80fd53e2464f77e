"""Where the activation recomputation's step time and peak go, for one keras.applications model
at Keras' default compile: stock and `enable_recompute(activations=True)` (and, with
`--variants`, memory budgets) trained side by side in one process, their steps interleaved, plus
what XLA compiled for each.

    python benchmarks/segments_step_time.py MobileNetV2 --batch 32 --rounds 15 --dump /tmp/d
    python benchmarks/segments_step_time.py --analyze /tmp/d     # no TensorFlow needed

Steady peak (on a GPU): one step of each variant after three warm ones, the allocator's peak
above what is in use before it (every variant's weights and optimizer state are resident).
Step time: `--rounds` rounds of `--steps` `train_on_batch` calls per variant, the variants
alternating within each round; the median of the per-round means, and the median of the
per-round ratios. With `--dump` XLA's optimized HLO and buffer assignments are written there
(`--xla_dump_to`), and `--analyze` reads them back:

- the kernels of each step (fusions, cuDNN convolutions, library calls, others) and the bytes
  they read and write (every operand and result of each top-level instruction: an estimate of
  the step's memory traffic, which bounds the elementwise kernels' time);
- the buffers live at the temp buffer's peak, grouped by the Keras layer whose op made them
  (the HLO metadata's op_name) and by what made them (a convolution's output, an elementwise
  fusion's, ...): what stays at the peak, per block.
"""
import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import time

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_LIVE = re.compile(r"^\s+([\w.\-]+)\{[\d,]*\}: (\d+) bytes")
#: opcodes that launch no kernel and move no bytes of their own
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "opt-barrier",
         "after-all", "partition-id", "replica-id", "add-dependency"}


def _shape_bytes(text):
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def _entry_lines(path):
    """The instruction lines of the ENTRY computation of an HLO text file."""
    lines, inside = [], False
    with open(path) as f:
        for line in f:
            if line.startswith("ENTRY "):
                inside = True
            elif inside and line.startswith("}"):
                break
            elif inside:
                lines.append(line)
    return lines


def _kind(opcode, rest):
    if opcode == "custom-call":
        target = (_TARGET.search(rest) or [None, ""])[1]
        return "cudnn conv" if "cudnn$conv" in target else "library call (" + target + ")"
    if opcode == "fusion":
        return "fusion"
    return opcode


def _instructions(path):
    """[(name, result shape text, opcode, rest of line, operand names)] of a module's ENTRY."""
    out = []
    for line in _entry_lines(path):
        m = _INSTR.match(line)
        if m:
            name, result, opcode, rest = m.groups()
            operands = rest.split(")")[0]
            out.append((name, result, opcode, rest, re.findall(r"%([\w.\-]+)", operands)))
    return out


def kernels(path):
    """{kind: [count, bytes read and written]} of the top-level instructions of a module (an
    operand's bytes are its maker's result's: CPU dumps print operands by name only)."""
    instrs = _instructions(path)
    size = {name: _shape_bytes(result) for name, result, *_ in instrs}
    out = collections.defaultdict(lambda: [0, 0])
    for name, result, opcode, rest, operands in instrs:
        if opcode in _FREE:
            continue
        row = out[_kind(opcode, rest)]
        row[0] += 1
        row[1] += size[name] + sum(size.get(o, 0) for o in operands)
    return dict(out)


def _layer(op_name):
    """The Keras layer of a traced op's name (".../block_3_expand_BN/FusedBatchNormV3" ->
    "block_3_expand_BN"), gradients included ("gradient_tape/.../block_3_expand/Conv2D")."""
    parts = [p for p in op_name.split("/") if p]
    if not parts:
        return "?"
    parts = parts[:-1] or parts
    for p in reversed(parts):
        if not p.startswith(("gradient_tape", "functional", "one_step_on_data", "while",
                             "StatefulPartitionedCall", "sequential", "model")):
            return p
    return parts[-1]


def peak_by_layer(hlo_path, buffers_path):
    """[(layer, what, buffer, bytes)] of the buffers live at the peak of a buffer assignment:
    the Keras layer of the instruction that made each (or of its first operand's maker, for an
    instruction without metadata) and what it is: "conv output", "elementwise (forward)" (any
    other forward-made buffer) or "backward" (made by a gradient, or an AddN summing
    gradients)."""
    instrs = _instructions(hlo_path)
    meta = {}
    for name, _, opcode, rest, operands in instrs:
        op = _OP_NAME.search(rest)
        meta[name] = (op.group(1) if op else None, opcode, rest, operands)

    def origin(name, depth=0):
        op_name, _, _, operands = meta.get(name, (None, None, None, ()))
        if op_name is None and operands and depth < 8:
            return origin(operands[0], depth + 1)
        return op_name or ""

    rows, inside = [], False
    with open(buffers_path) as f:
        for line in f:
            if "Live ranges at" in line and "(peak)" in line:
                inside = True
                continue
            if inside:
                m = _LIVE.match(line)
                if not m:
                    if line.strip():
                        break
                    continue
                name = m.group(1)
                op_name = origin(name)
                opcode, rest = meta.get(name, (None, "?", "", ()))[1:3]
                if "gradient_tape" in op_name or _layer(op_name).startswith("AddN"):
                    what = "backward"
                elif _kind(opcode, rest) in ("cudnn conv", "convolution"):
                    what = "conv output"
                elif opcode == "parameter" or not op_name:
                    what = "other"
                else:
                    what = "elementwise (forward)"
                rows.append((_layer(op_name) if op_name else "?", what, name, int(m.group(2))))
    return rows


def _block(layer):
    m = re.match(r"(block_?\d+[a-z]?|conv\d_block\d+|stem|top|Conv1?|expanded_conv)", layer)
    return m.group(1) if m else layer


def analyze(dump):
    """Prints the kernels and the peak of each variant's module in `dump`."""
    report = {}
    for variant in ("stock", "act"):
        hlos = sorted(glob.glob(os.path.join(dump, variant, "*one_step_on_data*"
                                             "after_optimizations.txt")))
        bufs = sorted(glob.glob(os.path.join(dump, variant, "*one_step_on_data*"
                                             "buffer-assignment.txt")))
        if not hlos:
            continue
        hlo, buf = max(hlos, key=os.path.getsize), max(bufs, key=os.path.getsize)
        report[variant] = dict(kernels=kernels(hlo), peak=peak_by_layer(hlo, buf))
    for variant, r in report.items():
        print(f"\n== {variant}: kernels of the step (count, GB read+written)")
        for kind, (n, b) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1]):
            print(f"  {kind:40s} {n:5d} {b / 1e9:8.2f}")
        total = sum(b for _, b in r["kernels"].values())
        print(f"  {'total':40s} {sum(n for n, _ in r['kernels'].values()):5d} {total / 1e9:8.2f}")
    whats = ("conv output", "elementwise (forward)", "backward", "other")
    for variant, r in report.items():
        print(f"\n== {variant}: live at the temp buffer's peak, MiB, by block and maker")
        table = collections.defaultdict(collections.Counter)
        for layer, what, _, b in r["peak"]:
            table[_block(layer)][what] += b
        print("  " + "block".ljust(20) + "".join(w.rjust(23) for w in whats) + "total".rjust(9))
        rows = sorted(table.items(), key=lambda kv: -sum(kv[1].values()))
        rows.append(("total", sum(table.values(), collections.Counter())))
        for block, c in rows:
            print("  " + block[:20].ljust(20) + "".join(f"{c[w] / 2**20:23.1f}" for w in whats)
                  + f"{sum(c.values()) / 2**20:9.1f}")
    return report


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--jit", action="store_true",
                   help="compile(jit_compile=True): XLA on the CPU too (Keras' default is XLA on "
                   "a GPU only)")
    p.add_argument("--variants", default="stock,act",
                   help="comma-separated: stock, act (activations=True), bNN "
                        "(memory_budget=NN/100); default stock,act")
    p.add_argument("--dump", help="write XLA's dumps here (one folder per variant)")
    p.add_argument("--analyze", metavar="DUMP", help="only read back a --dump folder")
    args = p.parse_args(argv)
    if args.analyze:
        analyze(args.analyze)
        return
    import keras
    import tensorflow as tf

    import tf_relupool
    from tf_relupool import segments

    x = tf.random.stateless_uniform((args.batch, args.size, args.size, 3), seed=[0, 1])
    y = tf.random.stateless_uniform((args.batch,), seed=[1, 1], minval=0, maxval=1000,
                                    dtype=tf.int32)
    models, first = {}, {}
    variants = args.variants.split(",")
    if variants[0] != "stock" or not all(v in ("stock", "act") or re.fullmatch(r"b\d+", v)
                                         for v in variants):
        p.error(f"argument --variants: stock first, then act or bNN; got {args.variants!r}")
    for variant in variants:
        if variant == "act":
            tf_relupool.enable_recompute(activations=True)
        elif variant.startswith("b"):
            tf_relupool.enable_recompute(memory_budget=int(variant[1:]) / 100)
        keras.utils.set_random_seed(0)
        model = getattr(keras.applications, args.model)(
            weights=None, input_shape=(args.size,) * 2 + (3,), classes=1000,
            classifier_activation=None)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **(dict(jit_compile=True) if args.jit else {}))
        t0 = time.time()
        model.train_on_batch(x, y)   # traced and compiled here, under this variant's switch
        first[variant] = round(time.time() - t0, 1)
        if args.dump:   # the modules dumped so far are this variant's: move them aside
            os.makedirs(os.path.join(args.dump, variant), exist_ok=True)
            for f in os.listdir(args.dump):
                if os.path.isfile(os.path.join(args.dump, f)):
                    os.replace(os.path.join(args.dump, f), os.path.join(args.dump, variant, f))
        models[variant] = model
    stats = segments.stats()
    gpu = bool(tf.config.list_logical_devices("GPU"))
    peaks = {}
    for variant, model in models.items():   # warm every variant before timing
        for _ in range(3):
            float(model.train_on_batch(x, y))
        if gpu:  # the steady step's peak above what is resident (every variant's weights)
            tf.config.experimental.reset_memory_stats("GPU:0")
            before = tf.config.experimental.get_memory_info("GPU:0")["current"]
            float(model.train_on_batch(x, y))
            peaks[variant] = round(
                (tf.config.experimental.get_memory_info("GPU:0")["peak"] - before) / 2**20, 1)
    means = collections.defaultdict(list)
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for variant in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = models[variant].train_on_batch(x, y)
            float(loss)
            means[variant].append((time.perf_counter() - t0) / args.steps * 1000)
    speed, quartiles = {}, {}
    for v in variants[1:]:
        ratios = [s / a for s, a in zip(means["stock"], means[v])]
        speed[v] = round(statistics.median(ratios), 3)
        quartiles[v] = [round(q, 3) for q in statistics.quantiles(ratios, n=4)]
    print("RESULT " + json.dumps(dict(
        model=args.model, batch=args.batch, size=args.size, rounds=args.rounds,
        steps=args.steps, first_s=first,
        step_ms={v: round(statistics.median(m), 2) for v, m in means.items()},
        speed_vs_stock=speed, speed_quartiles=quartiles, steady_peak_mib=peaks,
        stats=stats)))
    if args.dump:
        analyze(args.dump)


if __name__ == "__main__":
    sys.exit(main())
