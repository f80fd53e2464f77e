"""Measure your own model: stock Keras against `tf_relupool.enable_recompute()`.

    python -m tf_relupool.measure my_model.keras --batch-size 64
    python -m tf_relupool.measure VGG16 --batch-size 32 --memory-limit 4096 --largest-batch
    python -m tf_relupool.measure ResNet50 --input-shape 160,160,3 --json out.json --plot out.png

MODEL is a `.keras` file (its own input shape unless --input-shape is given) or the name of a
`keras.applications` model (built with weights=None; its default input shape unless given).
Each trial is a fresh process (a GPU memory_limit must be set before TensorFlow starts): the
model is trained with SGD on synthetic data of its input shape, sparse categorical crossentropy
from logits for a class-vector output (batch, classes), mean squared error otherwise, compiled as
--jit-compile says (default: Keras' default, XLA whenever a GPU is visible), stock or with
`tf_relupool.enable_recompute()` called before the model is built.

It runs on the GPU when TensorFlow sees one (GPU:0, BFC allocator, `memory_limit` set to
--memory-limit), otherwise on the CPU with TF_CPU_ALLOCATOR_USE_BFC=true. The CPU enforces no
limit: there a trial fits when the allocator's peak, resident bytes included, stays under it.

The table: the steady step's peak above resident (median of the steps after the first), the
first step's (it traces, compiles and, on a GPU, autotunes), the steady step time (median;
--repeat N: the medians over N fresh processes per variant, run in alternating order), the
largest batch that trains --trial-steps steps under --memory-limit (--largest-batch: a multiple of
--granularity, found by bracketing and bisection, one process per batch tried) and the ReLU +
max-pool pairs the switch fused (under XLA: counted where Keras traces the model; without XLA:
the Grappler pass's fusions). Under XLA also XLA's temp buffer of the step, read from its buffer
assignment (each trial dumps the step's modules into a temporary folder): on the CPU the
allocator's peak counts the whole power-of-two region it gives that buffer, so only this figure
follows the batch and shows what the switch saves there. A switch trial that does not train
under the limit runs once more, as a user's second run would: the first one left XLA's autotuning results in the switch's
autotune cache (docs/memory.md, "The largest batch at Keras' default compile").
"""
import argparse
import datetime
import difflib
import json
import os
import shutil
import sys
import tempfile
import time

from tf_relupool import _harness as h

MIB = h.MIB
VARIANTS = ("stock", "switch")
LABELS = {"stock": "stock", "switch": "enable_recompute()"}


def budget_variant(budget):
    """The switch's variant under memory_budget=`budget`: "switch@0.5"."""
    return f"switch@{budget:g}"


def variant_budget(variant):
    """The memory_budget of a switch variant ("switch" 1, "switch@0.5" 0.5)."""
    return float(variant.split("@", 1)[1]) if "@" in variant else 1.0


def _order(report):
    """The report's variants in their run order (a report before --memory-budget: VARIANTS)."""
    return report.get("order", list(VARIANTS))


def _labels(report):
    return report.get("labels", LABELS)
JIT = {"auto": "auto", "true": True, "false": False}
FILE_SUFFIXES = (".keras", ".h5", ".hdf5")


class UsageError(Exception):
    """A problem with what was asked (exit status 2, argparse's form)."""


# ---------------------------------------------------------------------------------------------
# Worker: one fresh process, one variant, one batch (TensorFlow imported here only).
# ---------------------------------------------------------------------------------------------
def _first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:400] if text else ''}"


def _build(keras, spec):
    """The model `spec` names: a .keras file loaded without compiling, or a keras.applications
    model built with weights=None (and the input shape asked for)."""
    if spec["source"] == "file":
        model = keras.saving.load_model(spec["model"], compile=False)
    else:
        kwargs = {"weights": None}
        if spec["input_shape"]:
            kwargs["input_shape"] = tuple(spec["input_shape"])
        model = getattr(keras.applications, spec["model"])(**kwargs)
    return model


def _reshape(keras, model, shape):
    """`model` with input shape `shape` (a fresh clone when it differs; its weights are not kept:
    memory does not depend on their values)."""
    if tuple(model.input_shape[1:]) == tuple(shape):
        return model
    return keras.models.clone_model(model, input_tensors=keras.Input(tuple(shape)))


def _stage(result, stage):
    result["stage"] = stage
    h.print_result(result)  # a process that dies later still says how far it got


#: The XLA modules of Keras' training step (its `one_step_on_data` tf.function).
TRAIN_STEP_MODULES = ".*one_step_on_data.*"


def worker(spec):
    tf, dev = h.start_tensorflow(spec["device"], memory_limit_mib=spec["limit"] or None,
                                 inter_op_threads=spec.get("inter_op_threads"))
    import keras
    import tf_relupool
    from tf_relupool import grappler, keras_fusion

    meter = h.StepMemory(tf, dev)
    result = {"variant": spec["variant"], "batch": spec["batch"], "status": "fits",
              "device": dev.as_dict()}
    _stage(result, "load")
    try:
        if spec["variant"].startswith("switch"):  # the one line, before the model is built
            tf_relupool.enable_recompute(activations=spec.get("activations", False),
                                         memory_budget=variant_budget(spec["variant"]))
        model = _build(keras, spec)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        result.update(status=h.classify_error(type(e).__name__, str(e)), message=_first_line(e))
        return result
    _stage(result, "input")
    try:
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            raise ValueError(f"the model has {len(model.inputs)} inputs and "
                             f"{len(model.outputs)} outputs; one of each is supported")
        if spec["source"] == "file" and spec["input_shape"]:
            model = _reshape(keras, model, spec["input_shape"])
        shape = tuple(model.input_shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"the model's input shape {shape} has unknown dimensions: give "
                             "--input-shape")
        out = tuple(model.output_shape[1:])
        if any(d is None for d in out):
            raise ValueError(f"the model's output shape {out} has unknown dimensions")
    except Exception as e:  # noqa: BLE001
        result.update(status=h.classify_error(type(e).__name__, str(e)), message=_first_line(e))
        return result
    classes = out[0] if len(out) == 1 and out[0] > 1 else None
    result.update(input_shape=list(shape), output_shape=list(out), params=model.count_params(),
                  model_name=model.name,
                  loss="sparse_categorical_crossentropy" if classes else "mse")
    _stage(result, "build")
    try:
        loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True) if classes
                else keras.losses.MeanSquaredError())
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                      jit_compile=JIT[spec["jit_compile"]])
        result["jit_compile"] = bool(model.jit_compile)
        b = spec["batch"]
        x = tf.random.stateless_uniform((b,) + shape, seed=[0, b])
        if classes:
            y = tf.random.stateless_uniform((b,), seed=[1, b], minval=0, maxval=classes,
                                            dtype=tf.int32)
        else:
            y = tf.random.stateless_normal((b,) + out, seed=[1, b])
        if meter.available:
            result["resident_bytes"] = tf.config.experimental.get_memory_info(dev.name)["current"]
    except Exception as e:  # noqa: BLE001
        result.update(status=h.classify_error(type(e).__name__, str(e)), message=_first_line(e))
        return result
    limit = spec["limit"]
    if dev.kind == "cpu" and limit and (result.get("resident_bytes") or 0) > limit * MIB:
        result.update(status="oom", message=f"resident {result['resident_bytes'] / MIB:.1f} MiB "
                      f"> {limit} MiB (CPU)")
        return result
    _stage(result, "step")
    # Exceptions: tf.errors.OpError, or a model that cannot train.
    steps, error = h.measure_steps(meter, lambda: model.train_on_batch(x, y), spec["steps"],
                                   Exception)
    if error is not None:
        result.update(status=h.classify_error(type(error).__name__, str(error)),
                      message=_first_line(error), failed_step=len(steps) + 1)
    result.update(h.step_figures(steps, meter.available))
    temp = h.xla_temp_bytes(spec.get("xla_dump"))
    if temp is not None:
        result["xla_temp_bytes"] = temp
    if dev.kind == "cpu" and limit and result["status"] == "fits":
        peak = result.get("total_peak_bytes") or 0
        if peak > limit * MIB:  # the CPU has no memory_limit: compared, not enforced
            result.update(status="oom", message=f"allocator peak {peak / MIB:.1f} MiB > "
                          f"{limit} MiB (CPU)")
    if spec["variant"].startswith("switch"):
        g = grappler.stats()
        result["grappler"] = {k: g[k] for k in ("fused_with_grad", "fused_forward_only",
                                                "not_fused", "errors")}
        result["xla_trace"] = keras_fusion.stats()
        if spec.get("activations") or variant_budget(spec["variant"]) < 1:
            from tf_relupool import segments
            result["segments"] = segments.stats()
        if result.get("jit_compile"):
            result["fused"], result["fused_by"] = result["xla_trace"]["fused"], "XLA"
        else:
            result["fused"] = g["fused_with_grad"] + g["fused_forward_only"]
            result["fused_by"] = "Grappler"
    result["stage"] = "done"
    return result


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------
def _mib(v):
    return f"{v / MIB:.1f}" if isinstance(v, (int, float)) else "n/a"


class Run:
    """The trials of one measurement: fresh processes, one line of progress each."""

    def __init__(self, args, source, model, quiet=False, labels=None):
        self.args, self.source, self.model = args, source, model
        self.labels = labels or LABELS
        self.t0 = time.time()
        self.quiet = quiet

    def log(self, text):
        if not self.quiet:
            print(f"measure [{time.time() - self.t0:5.0f} s] {text}", file=sys.stderr, flush=True)

    def trial(self, variant, batch, steps, limit):
        """One trial process; under a limit, a switch trial that did not train runs once more:
        the first wrote XLA's autotuning results to the switch's cache, and a user's second run
        at that batch finds them (docs/memory.md)."""
        result = self._trial(variant, batch, steps, limit)
        on_gpu = (result.get("device") or {}).get("kind") == "gpu" or self.args.device == "gpu"
        if (variant.startswith("switch") and limit and on_gpu
                and result["status"] in ("oom", "timeout")):
            self.log(f"{variant} batch {batch}: {result['status']} in the first run; running "
                     "again with its autotuning results")
            first = {k: result.get(k) for k in ("status", "message", "seconds")}
            result = self._trial(variant, batch, steps, limit)
            result["first_run"] = first
        return result

    def _trial(self, variant, batch, steps, limit):
        a = self.args
        spec = {"model": self.model, "source": self.source, "input_shape": a.input_shape,
                "variant": variant, "batch": batch, "steps": steps, "limit": limit,
                "jit_compile": a.jit_compile, "device": a.device,
                "inter_op_threads": a.inter_op_threads,
                "activations": bool(getattr(a, "activations", False))}
        env = h.trial_env() if limit else dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # statistics on the CPU
        # XLA's buffer assignment of the step: its temp buffer, which the CPU's allocator
        # figure does not show (module docstring)
        dump = tempfile.mkdtemp(prefix="tf_relupool_measure_xla_")
        spec["xla_dump"] = dump
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                            f" --xla_dump_hlo_module_re={TRAIN_STEP_MODULES}").strip()
        # The worker imports this very package, wherever it was started from (`-m` would put
        # the working directory first on sys.path, where a source tree may shadow it).
        parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from tf_relupool.measure import main; sys.exit(main())", parent, "--worker",
               json.dumps(spec)]
        try:
            out = h.run_fresh(cmd, a.trial_timeout, env=env)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        try:
            result = h.read_result(out["stdout"])
        except h.DeviceError as e:
            raise UsageError(f"--device {a.device}: {e}")
        if result is None:
            result = {"variant": variant, "batch": batch, "stage": "start"}
        if out["status"] != "fits":  # the process died: its last stage, its stderr's last line
            result.update(status=out["status"], message=out.get("message", ""))
        result["seconds"] = out["seconds"]
        return result

    def describe(self, r):
        if r["status"] != "fits" and r.get("first_peak_bytes") is None:
            where = f" at step {r['failed_step']}" if r.get("failed_step") else \
                f" (stage {r.get('stage')})"
            return f"{r['status']}{where}: {r.get('message', '')[:200]}"
        status = "fits" if r["status"] == "fits" else f"{r['status']} ({r.get('message', '')})"
        text = (f"{status}; steady peak {_mib(r.get('steady_peak_bytes'))} MiB, first step "
                f"{_mib(r.get('first_peak_bytes'))} MiB")
        if r.get("step_seconds"):
            text += f", {1e3 * r['step_seconds']:.1f} ms/step"
        if r.get("fused") is not None:
            text += f", {r['fused']} pairs fused ({r['fused_by']})"
        return text


def _check_first(args, r):
    """UsageError for what the stock trial shows is wrong with what was asked."""
    stage, msg = r.get("stage"), r.get("message", "")
    if r["status"] == "fits":
        return
    before_first_step = stage not in ("step", "done")
    if args.memory_limit and r["status"] == "oom" and (
            before_first_step or (r.get("resident_bytes") or 0) > args.memory_limit * MIB):
        resident = (f" (resident {_mib(r['resident_bytes'])} MiB)"
                    if r.get("resident_bytes") else "")
        raise UsageError(f"--memory-limit {args.memory_limit} MiB is below the model's resident "
                         f"memory{resident}: the trial failed before its first step: {msg}")
    if stage == "load" and not (args.source == "application" and args.input_shape):
        raise UsageError(f"cannot load model {args.model}: {msg}")
    if stage in ("load", "input"):
        what = (f"bad --input-shape {','.join(map(str, args.input_shape))} for {args.model}"
                if args.input_shape else f"cannot use model {args.model}")
        raise UsageError(f"{what}: {msg}")
    if stage == "build" and args.source == "application" and args.input_shape:
        raise UsageError(f"bad --input-shape {','.join(map(str, args.input_shape))} for "
                         f"{args.model}: {msg}")


def search(run, variant, measured, args):
    """The largest multiple of --granularity that trains under --memory-limit, and the trials."""
    g, limit = args.granularity, args.memory_limit
    trials = {}
    if measured.get("status") == "fits" and measured["batch"] % g == 0:
        trials[measured["batch"]] = measured
    peak = max(measured.get("first_peak_bytes") or 0, measured.get("steady_peak_bytes") or 0)
    resident = measured.get("resident_bytes") or 0
    if peak > 0:  # measured (on the CPU also when over the limit): scaled to the limit
        start, step = h.search_start({measured["batch"]: peak}, (limit * MIB - resident) / MIB,
                                     g, measured["batch"])
    else:
        start, step = max(g, measured["batch"] // 2), None

    def fits(b):
        if b not in trials:
            r = run.trial(variant, b, args.trial_steps, limit)
            run.log(f"{run.labels[variant]}, batch {b} under {limit} MiB: {run.describe(r)}")
            trials[b] = r
        return trials[b]["status"] == "fits"

    best, _ = h.largest_fitting(fits, start, g, step, highest=args.max_batch)
    return best, [{k: trials[b].get(k) for k in ("batch", "status", "total_peak_bytes",
                                                 "message", "seconds")} for b in sorted(trials)]


MEDIAN_KEYS = ("step_seconds", "steady_peak_bytes", "first_peak_bytes")


def combine(results):
    """One variant's figures from its processes (--repeat): the first process's result, or the
    first that did not fit, with the medians of MEDIAN_KEYS over the processes that fit and each
    process's figures under "processes". One process: its result unchanged."""
    if len(results) == 1:
        return results[0]
    failed = [r for r in results if r.get("status") != "fits"]
    out = dict(failed[0] if failed else results[0])
    for key in MEDIAN_KEYS:
        value = h.median_of(results, key)
        if value is not None:
            out[key] = value
    out["processes"] = [{k: r.get(k) for k in ("status",) + MEDIAN_KEYS} for r in results]
    return out


def render(report):
    """The table, in Markdown."""
    v, m = report["variants"], report
    order, labels = _order(m), _labels(m)
    dev = m.get("device") or {}
    shape = "x".join(map(str, m.get("input_shape") or [])) or "?"
    limit = m.get("memory_limit_mib")
    jit = {True: "XLA", False: "no XLA"}.get(m.get("jit_effective"), "?")
    lines = [f"{m['model']}: batch {m['batch_size']}, input {shape}, "
             f"{(m.get('params') or 0) / 1e6:.2f} M parameters, {m.get('loss', '?')} loss, SGD",
             f"{dev.get('name', '?')} ({dev.get('description', '?')}); jit_compile="
             f"{m['jit_compile']} ({jit}); resident {_mib(m.get('resident_bytes'))} MiB"
             + (f"; memory limit {limit} MiB" + (" (compared with the allocator's peak: the CPU "
                                                 "enforces none)" if dev.get("kind") == "cpu"
                                                 else "") if limit else ""), ""]
    repeat = max(len(v[k].get("processes") or [None]) for k in v) if v else 1
    header = ["variant", "steady peak MiB", "first-step peak MiB",
              "step ms (median)" if repeat == 1 else f"step ms (median, {repeat} processes)"]
    xla_temp = any(v[k].get("xla_temp_bytes") for k in v)
    if xla_temp:
        header.append("XLA temp buffer MiB")
    search = any(v[k].get("largest_batch") is not None for k in v)
    if search:
        header.append(f"largest batch under {limit} MiB")
    header.append("ReLU+pool pairs fused")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ref = v.get("stock", {})

    def ratio(r, key, fmt):
        a, b = r.get(key), ref.get(key)
        return f" ({fmt(a, b)})" if r is not ref and a and b else ""

    for k in order:
        r = v.get(k)
        if not r:
            continue
        if r.get("first_peak_bytes") is None:  # nothing measured (a GPU out of memory)
            cells = [labels[k], r.get("status", "?"), "", ""]
        else:
            t = r.get("step_seconds")
            cells = [labels[k],
                     _mib(r.get("steady_peak_bytes"))
                     + ratio(r, "steady_peak_bytes", lambda a, b: f"{a / b:.2f}x"),
                     _mib(r.get("first_peak_bytes"))
                     + ratio(r, "first_peak_bytes", lambda a, b: f"{a / b:.2f}x"),
                     (f"{t * 1e3:.1f}" if t else "n/a")
                     + ratio(r, "step_seconds", lambda a, b: f"{b / a:.2f}x speed")]
        if xla_temp:
            cells.append(_mib(r.get("xla_temp_bytes"))
                         + ratio(r, "xla_temp_bytes", lambda a, b: f"{a / b:.2f}x"))
        if search:
            big = r.get("largest_batch")
            cells.append("n/a" if big is None else str(big) + ratio(
                r, "largest_batch", lambda a, b: f"{a / b:.2f}x"))
        cells.append("-" if k == "stock" else (
            f"{r['fused']} ({r['fused_by']})" if r.get("fused") is not None else "n/a"))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {labels[k]}, batch {m['batch_size']}: {v[k].get('status')}: {v[k].get('message')}"
             for k in order
             if v.get(k, {}).get("status") not in (None, "fits")]
    if repeat > 1:
        notes += [f"- {labels[k]}, step ms in each process (in run order): " + ", ".join(
            f"{p['step_seconds'] * 1e3:.1f}" if p.get("step_seconds") else p.get("status", "?")
            for p in v[k]["processes"]) for k in order if v.get(k, {}).get("processes")]
    elif dev.get("kind") == "gpu":
        notes.append("- Step times: one fresh process per variant; on a GPU one variant's step "
                     "time moves by several percent from process to process (docs/memory.md): "
                     "--repeat 3 gives medians over alternating processes.")
    if xla_temp and dev.get("kind") == "cpu":
        notes.append("- XLA temp buffer: what XLA's buffer assignment allocates for the step. On "
                     "the CPU the allocator gives that one buffer a region of a power of two "
                     "MiB, not split, and its peak counts the whole region, so the peak moves "
                     "in steps of the region size and hides a smaller buffer.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    v = report["variants"]
    names, labels = [k for k in _order(report) if k in v], _labels(report)
    search = any(v[k].get("largest_batch") is not None for k in names)
    budgets = [k for k in names if "@" in k and v[k].get("step_seconds")]
    panels = 1 + bool(search) + bool(budgets)
    fig, axes = plt.subplots(1, panels, figsize=(3.5 + 4 * panels, 4), squeeze=False)
    ax = axes[0][0]
    width = 0.38
    for i, (key, label) in enumerate((("steady_peak_bytes", "steady step"),
                                      ("first_peak_bytes", "first step"))):
        ax.bar([j + (i - 0.5) * width for j in range(len(names))],
               [(v[k].get(key) or 0) / MIB for k in names], width, label=label)
    ax.set_xticks(range(len(names)), [labels[k] for k in names])
    ax.set_ylabel("peak above resident (MiB)")
    ax.legend()
    ax.set_title(f"{report['model']}, batch {report['batch_size']}")
    if search:
        ax = axes[0][1]
        ax.bar(range(len(names)), [v[k].get("largest_batch") or 0 for k in names])
        ax.set_xticks(range(len(names)), [labels[k] for k in names])
        ax.set_ylabel("largest batch")
        ax.set_title(f"under {report['memory_limit_mib']} MiB")
    if budgets:  # the trade: one point per budget, stock beside them
        ax = axes[0][panels - 1]
        for k in ["stock"] + budgets:
            r = v.get(k) or {}
            if r.get("step_seconds") and r.get("steady_peak_bytes"):
                x, y = r["step_seconds"] * 1e3, r["steady_peak_bytes"] / MIB
                ax.plot([x], [y], "o" if k != "stock" else "s")
                ax.annotate("stock" if k == "stock" else f"budget {variant_budget(k):g}", (x, y))
        ax.set_xlabel("step ms (median)")
        ax.set_ylabel("steady peak above resident (MiB)")
        ax.set_title("memory_budget: peak against step time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _budgets(text):
    from tf_relupool import config
    try:
        values = [config.check_memory_budget(float(t)) for t in text.split(",")]
    except ValueError:  # not a number, or outside [0, 1] (config's check)
        values = None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected distinct numbers in [0, 1], comma-separated (1,0.5,0), got {text!r}")
    return values


def _input_shape(text):
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive integers such as 224,224,3, got "
                                         f"{text!r}")
    return list(dims)


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _applications():
    """{lower-case name: name} of the keras.applications models."""
    import keras
    return {n.lower(): n for n in dir(keras.applications)
            if n[:1].isupper() and callable(getattr(keras.applications, n))}


def resolve_model(text):
    """("file", path) or ("application", name); UsageError naming what is wrong."""
    if os.path.isfile(text):
        return "file", os.path.abspath(text)
    if os.path.exists(text):
        raise UsageError(f"model {text!r} is not a file")
    if text.lower().endswith(FILE_SUFFIXES) or os.sep in text:
        raise UsageError(f"model file {text!r} does not exist")
    apps = _applications()
    if text.lower() in apps:
        return "application", apps[text.lower()]
    close = difflib.get_close_matches(text.lower(), list(apps), n=3)
    hint = f"; did you mean {', '.join(apps[c] for c in close)}?" if close else \
        f" ({len(apps)} names, such as VGG16, ResNet50, MobileNetV2)"
    raise UsageError(f"unknown model {text!r}: neither a file nor a keras.applications name"
                     + hint)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tf_relupool.measure",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", help="a .keras file, or a keras.applications name (VGG16, ...)")
    p.add_argument("--batch-size", type=_positive, default=32, help="(default 32)")
    p.add_argument("--input-shape", type=_input_shape, default=None, metavar="H,W,C",
                   help="the input shape without the batch (default: the model's own)")
    p.add_argument("--memory-limit", type=_positive, default=None, metavar="MiB",
                   help="GPU memory_limit of each trial (on the CPU: the allocator's peak is "
                        "compared with it)")
    p.add_argument("--largest-batch", action="store_true",
                   help="search the largest batch that trains under --memory-limit")
    p.add_argument("--granularity", type=_positive, default=None,
                   help="the largest batch is a multiple of this (default: 8, or the batch "
                        "size when it is smaller)")
    p.add_argument("--max-batch", type=_positive, default=1 << 16,
                   help="the largest batch tried (default 65536)")
    p.add_argument("--jit-compile", choices=tuple(JIT), default="auto",
                   help="Model.compile's jit_compile (default auto: Keras' default, XLA "
                        "whenever a GPU is visible)")
    p.add_argument("--steps", type=_positive, default=10,
                   help="training steps of each measurement, the first included (default 10)")
    p.add_argument("--repeat", type=_positive, default=1,
                   help="fresh processes per variant, in alternating order; the table gives the "
                        "medians (default 1)")
    p.add_argument("--trial-steps", type=_positive, default=2,
                   help="steps a batch must train in the largest-batch search (default 2)")
    p.add_argument("--trial-timeout", type=_positive, default=1800, metavar="SECONDS")
    p.add_argument("--device", choices=h.DEVICE_CHOICES, default="auto",
                   help="auto (default): the GPU when TensorFlow sees one, else the CPU")
    p.add_argument("--inter-op-threads", type=int, default=1,
                   help="TensorFlow's inter-op parallelism in each trial (default 1: repeatable "
                        "peaks, as the benchmarks measure; 0: TensorFlow's default)")
    p.add_argument("--json", default=None, metavar="FILE", help="the raw figures as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="a bar chart (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--activations", action="store_true",
                   help="the switch also recomputes activations under XLA: "
                        "enable_recompute(activations=True)")
    p.add_argument("--memory-budget", type=_budgets, default=None, metavar="B[,B...]",
                   help="one switch variant per budget, enable_recompute(memory_budget=B), B in "
                        "[0, 1] (e.g. 1,0.5,0): each budget's peak, step time and (with "
                        "--largest-batch) largest batch; --plot adds peak against step time")
    args = p.parse_args(argv)
    try:
        if args.largest_batch and not args.memory_limit:
            raise UsageError("--largest-batch needs --memory-limit")
        if args.steps < 2:
            raise UsageError("--steps must be >= 2 (the first step, then steady ones)")
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise UsageError("--plot needs matplotlib (pip install matplotlib)")
        args.source, args.model_ref = resolve_model(args.model)
    except UsageError as e:
        p.error(str(e))
    if args.granularity is None:
        args.granularity = min(8, args.batch_size)
    return p, args


def measure(args, quiet=False):
    """Runs the trials: the report (dict). UsageError for what the first trial shows is wrong."""
    activations = getattr(args, "activations", False)
    budgets = getattr(args, "memory_budget", None)
    order = ["stock"] + ([budget_variant(b) for b in budgets] if budgets else ["switch"])
    labels = {"stock": "stock",
              "switch": ("enable_recompute(activations=True)" if activations
                         else "enable_recompute()")}
    labels.update((budget_variant(b), f"enable_recompute(memory_budget={b:g})")
                  for b in budgets or ())
    run = Run(args, args.source, args.model_ref, quiet=quiet, labels=labels)
    report = {"model": args.model, "source": args.source, "batch_size": args.batch_size,
              "jit_compile": args.jit_compile, "memory_limit_mib": args.memory_limit,
              "order": order, "labels": labels, "variants": {}}
    processes = {variant: [] for variant in order}
    for rep in range(getattr(args, "repeat", 1)):
        # Alternating order: stock first, then the switch first, and so on.
        for variant in (order if rep % 2 == 0 else order[::-1]):
            r = run.trial(variant, args.batch_size, args.steps, args.memory_limit)
            run.log(f"{labels[variant]}, batch {args.batch_size}"
                    + (f" under {args.memory_limit} MiB" if args.memory_limit else "")
                    + f": {run.describe(r)}")
            if variant == "stock" and not processes["stock"]:
                _check_first(args, r)
                for key in ("device", "input_shape", "output_shape", "params", "loss",
                            "resident_bytes", "model_name"):
                    report[key] = r.get(key)
                report["jit_effective"] = r.get("jit_compile")
            processes[variant].append(r)
    for variant in order:
        report["variants"][variant] = combine(processes[variant])
    if args.largest_batch:
        for variant in order:
            best, trials = search(run, variant, report["variants"][variant], args)
            report["variants"][variant]["largest_batch"] = best
            report["variants"][variant]["search"] = trials
    import keras
    import tensorflow as tf
    import tf_relupool
    report["meta"] = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                      "tensorflow": tf.__version__, "keras": keras.__version__,
                      "tf_relupool": tf_relupool.__version__,
                      "library_built": h.library_built(),
                      "seconds": round(time.time() - run.t0)}
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        h.print_result(worker(json.loads(argv[1])))
        h.leave()
    p, args = parse_args(argv)
    try:
        report = measure(args, quiet=args.quiet)
    except UsageError as e:
        p.error(str(e))
    failed = [k for k in _order(report)
              if report["variants"][k].get("status") not in ("fits", "oom")]
    print(render(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    if failed:
        print(f"measure: error: the {', '.join(_labels(report)[k] for k in failed)} trial failed "
              "(the note under the table says why)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
