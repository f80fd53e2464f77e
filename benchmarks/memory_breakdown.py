"""What is live at a training step's memory peak: TensorFlow's memory profile, per variant.

gpu_memory.py says how high a step peaks; this says what the peak is made of. For one model of
tf_relupool/_example_models.py and one Grappler configuration (gpu_memory.py's names: default,
layout-off, workspace-0, ...), each variant (stock, argmax, input, switch, as in gpu_memory.py) trains
--warmup steps (2; 0 profiles the first step, which traces, optimizes and autotunes cuDNN), then
one step under TensorFlow's profiler (tf.profiler.experimental). The
profile's memory view (the allocator's own records: op, region, shape, chunk size and requested
size of every block live at the peak) is converted with TensorFlow's converter
(`xspace_to_tools_data`, as TensorBoard's memory profile does) and printed as a table of the
largest live blocks.

Where the converter is missing (the trimmed TensorFlow on the GPU machine has no profiler
plugin), --keep DIR keeps the raw profiles (.xplane.pb) and `--convert DIR` reads them on a
machine that has it.

    python benchmarks/memory_breakdown.py --device gpu --model simple --batch 1024 \\
        --variants stock,argmax,switch --config default --keep build/xplanes
    python benchmarks/memory_breakdown.py --convert build/xplanes --out breakdown.md
"""
import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gpu_memory  # noqa: E402  (its Grappler configurations and worker start)
from harness import (MIB, MODELS, VARIANT_LABELS, VARIANTS, build_model,  # noqa: E402
                     synthetic_batch, train_step)
from harness import devices  # noqa: E402  (tf_relupool/_harness.py; no TensorFlow import)


def memory_profile(xplane_path):
    """TensorFlow's memory profile (a dict, TensorBoard's JSON) of one .xplane.pb, or None
    when this TensorFlow has no converter."""
    try:
        from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin
        to_tools_data = plugin.xspace_to_tools_data
    except (ImportError, AttributeError):  # AttributeError: a TensorFlow trimmed of the plugin
        return None
    data, ok = to_tools_data([xplane_path], "memory_profile", {})
    if not ok:
        raise RuntimeError(f"TensorFlow could not convert {xplane_path}")
    return json.loads(data)


def live_at_peak(profile):
    """(allocator, peak bytes in use, [(bytes, requested bytes, op, region, dtype, shape)] live at
    the peak, largest first) for the allocator with the highest peak (the GPU's, on a GPU run).

    bytes is the chunk the allocator holds for the block, requested what the op asked for: the
    BFC allocator does not split a free chunk smaller than twice the request, so a block can hold
    up to twice its tensor (internal fragmentation, counted in the peak)."""
    per = profile["memoryProfilePerAllocator"]
    name = max(per, key=lambda n: int(per[n]["profileSummary"].get("peakBytesUsageLifetime", 0)))
    p = per[name]
    snapshots, special = p.get("memoryProfileSnapshots", []), p.get("specialAllocations", [])
    blocks = []
    for a in p.get("activeAllocations", []):
        si, sp = int(a.get("snapshotIndex", -1)), int(a.get("specialIndex", -1))
        meta = snapshots[si]["activityMetadata"] if si >= 0 else special[sp]
        for _ in range(int(a.get("numOccurrences", 1))):
            blocks.append((int(meta.get("allocationBytes", 0)),
                           int(meta.get("requestedBytes", 0)), meta.get("tfOpName", "?"),
                           meta.get("regionType", "?"), meta.get("dataType", "?"),
                           meta.get("tensorShape", "?")))
    blocks.sort(key=lambda b: -b[0])
    peak = int(p["profileSummary"]["peakStats"].get("peakBytesInUse", 0))
    return name, peak, blocks


def render(title, name, peak, blocks, min_mib):
    lines = [f"### {title}", "",
             f"allocator `{name}`: {peak / MIB:.1f} MiB in use at the peak, "
             f"{len(blocks)} live blocks; those of at least {min_mib} MiB:", "",
             "| MiB | requested MiB | op | region | dtype | shape |", "|---|---|---|---|---|---|"]
    small = small_requested = 0
    for size, requested, op, region, dtype, shape in blocks:
        if size >= min_mib * MIB:
            lines.append(f"| {size / MIB:.1f} | {requested / MIB:.1f} | `{op}` | {region} | "
                         f"{dtype} | {shape} |")
        else:
            small += size
            small_requested += requested
    lines += [f"| {small / MIB:.1f} | {small_requested / MIB:.1f} | (smaller blocks) | | | |", ""]
    return "\n".join(lines)


def profile_steps(args):
    """Profiles one step per variant; returns {variant: xplane path}."""
    args.inter_op_threads = 1
    tf, dev = gpu_memory._start(args)
    x, y = synthetic_batch(tf, args.batch)
    paths = {}
    for v in args.variants:
        model = build_model(tf, args.model, v)
        for _ in range(args.warmup):
            train_step(model, x, y, v)
        # "+" of joined configurations becomes "_": plain file names travel everywhere.
        name = (f"{args.model}-{args.config.replace('+', '_')}-{v}" +
                ("-first-step" if args.warmup == 0 else ""))
        logdir = tempfile.mkdtemp(prefix=f"{name}-")
        # Host tracing records the allocator's blocks; device (CUPTI) tracing is not needed.
        tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0, device_tracer_level=0))
        train_step(model, x, y, v)
        tf.profiler.experimental.stop()
        found = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
        if not found:
            raise RuntimeError(f"the profiler wrote no .xplane.pb under {logdir}")
        paths[v] = os.path.join(args.keep, name + ".xplane.pb")  # flat: easy to carry away
        shutil.move(found[-1], paths[v])
        shutil.rmtree(logdir, ignore_errors=True)
        del model
    return dev, paths


def convert(paths, min_mib):
    """Markdown for {title: xplane path}; None when no converter is available here."""
    parts = []
    for title, path in paths.items():
        profile = memory_profile(path)
        if profile is None:
            return None
        parts.append(render(title, *live_at_peak(profile), min_mib))
    return "\n".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=devices.DEVICE_CHOICES)
    p.add_argument("--model", default="simple", choices=MODELS)
    p.add_argument("--config", default="default", help="Grappler configuration (gpu_memory.py)")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--variants", default="stock,argmax,switch",
                   type=lambda s: [v for v in s.split(",") if v])
    p.add_argument("--warmup", type=int, default=2,
                   help="steps before the profiled one (0: profile the first step, which traces, "
                        "optimizes and autotunes)")
    p.add_argument("--keep", default=None, help="folder for the raw profiles (kept)")
    p.add_argument("--convert", default=None, help="only convert the profiles under this folder")
    p.add_argument("--min-mib", type=float, default=4.0, help="list blocks of at least this size")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    args = p.parse_args(argv)
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    if args.batch < 1:
        p.error("--batch must be positive")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.convert:
        paths = {os.path.basename(path)[:-len(".xplane.pb")]: path
                 for path in sorted(glob.glob(os.path.join(args.convert, "*.xplane.pb")))}
        if not paths:
            sys.exit(f"--convert: no .xplane.pb under {args.convert}")
        text = convert(paths, args.min_mib)
        if text is None:
            sys.exit("this TensorFlow has no profile converter (_pywrap_profiler_plugin)")
    else:
        temporary = args.keep is None
        args.keep = args.keep or tempfile.mkdtemp(prefix="memory_breakdown-")
        os.makedirs(args.keep, exist_ok=True)
        dev, paths = profile_steps(args)
        step = "first step" if args.warmup == 0 else f"step {args.warmup + 1}"
        titles = {f"{args.model}, {args.config}, {VARIANT_LABELS[v]}, batch "
                  f"{args.batch}, {step}, {dev.name}": path for v, path in paths.items()}
        text = convert(titles, args.min_mib)
        if text is None:
            text = (f"no profile converter in this TensorFlow; raw profiles kept under "
                    f"{args.keep}: convert them with --convert elsewhere")
        elif temporary:
            shutil.rmtree(args.keep, ignore_errors=True)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
