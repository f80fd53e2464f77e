"""MirroredStrategy with Keras fit: per-replica peak memory, step time and the largest global batch,
stock (switch off) vs `enable_recompute()` (switch) vs `rewrite_model` (layer).

For each model, one process runs examples/distributed.py --strategy mirrored --replicas N over the
three variants (the same initial weights and batches, op determinism on): the losses Keras logs
(bitwise comparable), each replica's median step peak above resident on its own allocator, the
median step time (variants one after another in that process, 8 steps, the first left out), the
fused ops TensorFlow executed. Then, for --search-models, the largest global batch of each variant:
fresh processes train 2 steps with memory_limit=--memory-limit MiB on every replica (the
measured run: none on whole GPUs, 16 GiB per logical GPU); the global
batch is N times a multiple of --granularity (harness.largest_fitting, started from the measured
peak scaled to the limit).

Replicas: the first N GPUs (NCCL all-reduce), N logical GPUs on one GPU when there are fewer
(HierarchicalCopyAllReduce; each logical GPU has its own allocator and limit), N logical CPUs
without a GPU (one shared allocator: one peak for all replicas).

    python benchmarks/distributed_memory.py --replicas 2 --out /tmp/distributed.md
    python benchmarks/distributed_memory.py --device cpu --models simple --batch-sizes simple=64
        # the measured run on logical CPUs (no largest-batch search: no memory_limit there)

Writes a Markdown table (--out FILE.md) and the raw numbers beside it (.json), and prints it.
"""
import argparse
import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402

EXAMPLE = os.path.join(harness.ROOT, "examples", "distributed.py")
MODELS = ("simple", "vgg", "resnet", "vgg16")
BATCHES = {"simple": 512, "vgg": 512, "resnet": 256, "vgg16": 64}
VARIANTS = ("off", "switch", "layer")
LABELS = {"off": "stock", "switch": "stock + enable_recompute()", "layer": "rewrite_model"}


def example_cmd(args, model, variants, batch, steps, json_path=None, limit=None):
    cmd = [sys.executable, EXAMPLE, "--strategy", "mirrored", "--replicas", str(args.replicas),
           "--model", model, "--variants", ",".join(variants), "--steps", str(steps),
           "--global-batch-size", str(batch), "--device", args.device, "--deterministic"]
    if limit:
        cmd += ["--memory-limit", str(limit)]
    return cmd + (["--json", json_path] if json_path else [])


def measure(args, model, batch, json_path):
    r = harness.run_fresh(example_cmd(args, model, VARIANTS, batch, args.steps, json_path),
                          args.timeout)
    if r["status"] != "fits":
        raise RuntimeError(f"{model} at global batch {batch}: {r['status']} "
                           f"({r.get('message')})")
    with open(json_path) as f:
        return json.load(f)


def largest(args, model, variant, measured, log):
    """The largest global batch (replicas x a multiple of --granularity) of one variant, from
    `measured` (the model's measured run, with its "batch")."""
    n = args.replicas
    peak = max(measured["variants"][variant]["peak_step_bytes"].values(), default=0)
    per_replica = measured["batch"] // n
    start, step = harness.search_start({per_replica: peak} if peak else {}, args.memory_limit,
                                       args.granularity, args.granularity * 8)
    trials = []

    def fits(b):
        r = harness.run_fresh(example_cmd(args, model, [variant], b * n, 2,
                                          limit=args.memory_limit), args.timeout)
        trials.append({"global_batch": b * n, "status": r["status"], "seconds": r["seconds"],
                       "message": r.get("message")})
        log(f"{model} {variant}: global batch {b * n}: {r['status']}, {r['seconds']:.0f} s")
        if r["status"] not in ("fits", "oom"):
            raise RuntimeError(f"{model} {variant} at global batch {b * n}: {r['message']}")
        return r["status"] == "fits"

    best, _ = harness.largest_fitting(fits, start, args.granularity, step, args.highest)
    return {"global_batch": best * n, "trials": trials}


def batch_sizes(args):
    return dict(BATCHES, **args.batch_sizes)


def render(report):
    meta = report["meta"]
    lines = [f"MirroredStrategy, {meta['replicas']} replicas: {meta['device']}; TensorFlow "
             f"{meta.get('tensorflow', '?')}; {meta['date']}, commit {meta['commit'] or '?'}, "
             f"host {meta['host']}. Keras fit, SGD(momentum), synthetic data, op determinism; "
             "peak: median over steps 2-8 of each replica's allocator peak above resident "
             f"(largest replica shown); largest batch: 2 steps under {meta['memory_limit']} MiB "
             "per replica.", "",
             "| model | global batch | variant | losses = stock | peak per replica MiB | vs stock "
             "| step ms | fused pools | largest global batch |", "|" + "---|" * 9]
    for model, m in report["models"].items():
        off = m["variants"]["off"]
        for v in VARIANTS:
            r = m["variants"][v]
            peak, off_peak = (max(x["peak_step_bytes"].values(), default=0) for x in (r, off))
            fused = sum(c for k, c in r["executed_ops"].items()
                        if k.startswith("ReluMaxPool") and "Grad" not in k)
            big = report["largest"].get(model, {}).get(v)
            cells = [model, m["batch"], LABELS[v], "yes" if r["losses"] == off["losses"] else "NO",
                     f"{peak / harness.MIB:.0f}" if peak else "-",
                     f"{peak / off_peak:.2f}x" if peak and off_peak else "-",
                     f"{r['step_seconds'] * 1e3:.0f}", fused,
                     big["global_batch"] if big else "-"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def _batch_sizes(text):
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        model, _, value = item.partition("=")
        if model not in MODELS or not value.isdigit() or int(value) <= 0:
            raise argparse.ArgumentTypeError(f"expected MODEL=BATCH with MODEL in {MODELS}, "
                                             f"got {item!r}")
        out[model] = int(value)
    return out


def _models(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in MODELS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown models {bad}; choose from {MODELS}")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_models, default=list(MODELS))
    p.add_argument("--search-models", type=_models, default=None,
                   help="models whose largest global batch is searched (default vgg16 on a "
                        "GPU; the CPU has no memory_limit, so there is no search there)")
    p.add_argument("--search-variants", type=lambda t: [v for v in t.split(",") if v],
                   default=list(VARIANTS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-sizes", type=_batch_sizes, default={},
                   help="MODEL=GLOBAL_BATCH,... for the measured run (defaults: "
                        + ", ".join(f"{k}={v}" for k, v in BATCHES.items()) + ")")
    p.add_argument("--memory-limit", type=int, default=4096, help="MiB per replica")
    p.add_argument("--granularity", type=int, default=8,
                   help="the per-replica batch of a trial is a multiple of this (default 8)")
    p.add_argument("--highest", type=int, default=4096, help="largest per-replica batch tried")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument("--timeout", type=int, default=600, help="seconds per process")
    p.add_argument("--out", default=None, help="FILE.md (and FILE.json)")
    args = p.parse_args(argv)
    for name in ("replicas", "memory_limit", "granularity", "highest", "steps", "timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.search_models is None:
        args.search_models = [] if args.device == "cpu" else ["vgg16"]
    elif args.search_models and args.device == "cpu":
        p.error("--search-models: the CPU has no memory_limit to search under; use a GPU")
    bad = [v for v in args.search_variants if v not in VARIANTS]
    if bad:
        p.error(f"--search-variants: unknown {bad}; choose from {VARIANTS}")
    for model, b in batch_sizes(args).items():
        if model in args.models and b % args.replicas:
            p.error(f"--batch-sizes: {model}'s global batch {b} is not a multiple of "
                    f"--replicas {args.replicas}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = args.out or os.path.join(HERE, "results", "distributed_memory.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    base = out[:-3] if out.endswith(".md") else out
    report = {"models": {}, "largest": {},
              "meta": {"replicas": args.replicas, "memory_limit": args.memory_limit,
                       "date": datetime.date.today().isoformat(), "commit": harness.git_head(),
                       "host": platform.node()}}

    def log(text):
        print(f"distributed_memory.py: {text}", file=sys.stderr, flush=True)

    for model in args.models:
        batch = batch_sizes(args)[model]
        got = measure(args, model, batch, f"{base}.{model}.json")
        report["models"][model] = dict(got, batch=batch)
        report["meta"]["device"] = got["device"]
        report["meta"]["tensorflow"] = got.get("tensorflow")
        log(f"{model}: measured at global batch {batch}")
        if model in args.search_models and "CPU" in got["device"]:
            log(f"{model}: no largest-batch search on CPUs (no memory_limit there)")
        elif model in args.search_models:
            report["largest"][model] = {v: largest(args, model, v, report["models"][model], log)
                                        for v in args.search_variants}
    text = render(report)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
