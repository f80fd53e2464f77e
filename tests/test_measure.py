"""python -m tf_relupool.measure on the CPU: its table, JSON and plot for a small conv -> ReLU ->
max-pool model saved as .keras (the switch's peak lower than stock's, pairs fused, the largest
batch under a limit), and each usage error as argparse's exit status 2 with a message naming the
problem."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20

from tf_relupool import measure  # noqa: E402


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """Two conv (ReLU) + 2x2 max-pool blocks and a 10-class head (logits), 32x32x3."""
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
    path = tmp_path_factory.mktemp("measure") / "small.keras"
    model.save(path)
    return str(path)


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    return env  # the installed tf_relupool (the source tree has no op library), as users run it


def _rows(table):
    """{first cell: [cells]} of the Markdown table's body rows."""
    rows = [l for l in table.splitlines() if l.startswith("| ") and not l.startswith("| variant")]
    return {cells[0]: cells for cells in ([c.strip() for c in r.strip("|").split("|")]
                                          for r in rows)}


def _floor_mib(model, tmp_path):
    """Stock's steady peak at batch 1 in MiB, rounded up: the part of a CPU step's peak that does
    not grow with the batch. Without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, the default on CPUs
    without AVX-512) it is about 32 MiB for this model, Eigen's Conv2DBackpropFilter im2col buffer,
    sized from a 30 MiB working-set target whatever the batch; with oneDNN, under 1 MiB
    (docs/memory.md)."""
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_relupool.measure", model, "--batch-size", "1", "--steps", "2",
         "--json", str(out), "--quiet"],
        capture_output=True, text=True, env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return -(-json.loads(out.read_text())["variants"]["stock"]["steady_peak_bytes"] // MIB)


@pytest.mark.slow
def test_table_json_and_plot_for_a_small_model(small_model, tmp_path):
    """One run of the command as a user types it: a progress line per trial, the table with
    stock and the switch (lower peaks, pairs fused by the Grappler pass: no XLA on the CPU), the
    largest batch under the limit (the switch's at least stock's), the JSON and the plot. The
    limit is 6 MiB above what the CPU's step holds at batch 1, which depends on the CPU's
    kernels (_floor_mib)."""
    limit, g = _floor_mib(small_model, tmp_path) + 6, 8
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_relupool.measure", small_model, "--batch-size", "16",
         "--steps", "3", "--memory-limit", str(limit), "--largest-batch", "--granularity",
         str(g), "--max-batch", "64", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [l for l in proc.stderr.splitlines() if l.startswith("measure [")]
    report = json.loads(out_json.read_text())
    v = report["variants"]
    searched = len(v["stock"]["search"]) + len(v["switch"]["search"])
    # The two measurements, then one line per search trial (a measured batch that fitted is
    # not tried again).
    reused = sum(1 for k in v if v[k]["status"] == "fits"
                 and any(t["batch"] == 16 for t in v[k]["search"]))
    assert len(progress) == 2 + searched - reused, proc.stderr[-3000:]
    assert f"stock, batch 16 under {limit} MiB" in progress[0]
    assert "enable_recompute(), batch 16" in progress[1]

    # The JSON's fields.
    for key in ("model", "source", "batch_size", "input_shape", "output_shape", "params", "loss",
                "device", "jit_compile", "jit_effective", "memory_limit_mib", "resident_bytes",
                "variants", "meta"):
        assert key in report, key
    assert report["input_shape"] == [32, 32, 3] and report["output_shape"] == [10]
    assert report["loss"] == "sparse_categorical_crossentropy"
    assert report["device"]["kind"] == "cpu" and report["jit_effective"] is False
    for k in ("stock", "switch"):
        for key in ("status", "steady_peak_bytes", "first_peak_bytes", "total_peak_bytes",
                    "step_seconds", "resident_bytes", "largest_batch", "search"):
            assert key in v[k], (k, key)
    stock, switch = v["stock"], v["switch"]
    assert switch["steady_peak_bytes"] < stock["steady_peak_bytes"]
    assert switch["first_peak_bytes"] < stock["first_peak_bytes"]
    assert switch["fused"] >= 2 and switch["fused_by"] == "Grappler"
    assert "fused" not in stock
    # The search: multiples of g; the answer fits, the next multiple tried does not.
    for r in (stock, switch):
        trials = {t["batch"]: t["status"] for t in r["search"]}
        best = r["largest_batch"]
        assert best % g == 0 and 0 <= best <= 64, r["search"]
        assert best == 0 or trials[best] == "fits", r["search"]
        assert all(s != "fits" for b, s in trials.items() if b > best), r["search"]
        assert best == 64 or trials.get(best + g) == "oom", r["search"]
    assert switch["largest_batch"] >= stock["largest_batch"] > 0

    # The table says the same.
    rows = _rows(proc.stdout)
    assert set(rows) == {"stock", "enable_recompute()"}, proc.stdout
    header = [l for l in proc.stdout.splitlines() if l.startswith("| variant")][0]
    assert "steady peak MiB" in header and "first-step peak MiB" in header
    assert "step ms (median)" in header and f"largest batch under {limit} MiB" in header
    assert "ReLU+pool pairs fused" in header
    s, f = rows["stock"], rows["enable_recompute()"]
    assert s[1] == f"{stock['steady_peak_bytes'] / MIB:.1f}"
    ratio = switch["steady_peak_bytes"] / stock["steady_peak_bytes"]
    assert f[1] == f"{switch['steady_peak_bytes'] / MIB:.1f} ({ratio:.2f}x)"
    assert f[2].startswith(f"{switch['first_peak_bytes'] / MIB:.1f} (")
    assert s[4] == str(stock["largest_batch"]) and f[4].startswith(str(switch["largest_batch"]))
    assert s[5] == "-" and f[5] == f"{switch['fused']} (Grappler)"
    assert "CPU:0" in proc.stdout and "jit_compile=auto (no XLA)" in proc.stdout
    assert out_png.stat().st_size > 1000


def _usage_error(capsys, argv):
    """The message of a usage error (exit status 2), run in this process."""
    with pytest.raises(SystemExit) as e:
        measure.main(argv + ["--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if "error:" in l]
    assert len(lines) == 1, err
    return lines[0]


def test_usage_errors_without_a_trial(capsys, tmp_path, small_model):
    assert "model file" in _usage_error(capsys, [str(tmp_path / "nope.keras")])
    assert "does not exist" in _usage_error(capsys, [str(tmp_path / "nope.keras")])
    msg = _usage_error(capsys, ["VGG17"])
    assert "unknown model 'VGG17'" in msg and "VGG16" in msg
    assert "--input-shape" in _usage_error(capsys, [small_model, "--input-shape", "0,3"])
    assert "--input-shape" in _usage_error(capsys, [small_model, "--input-shape", "a,b"])
    assert "--memory-limit" in _usage_error(capsys, [small_model, "--largest-batch"])
    assert "--batch-size" in _usage_error(capsys, [small_model, "--batch-size", "0"])
    assert "--jit-compile" in _usage_error(capsys, [small_model, "--jit-compile", "maybe"])
    assert "--repeat" in _usage_error(capsys, [small_model, "--repeat", "0"])


def test_usage_errors_found_by_the_first_trial(capsys, tmp_path, small_model):
    """A file that is no Keras model, an input shape the model cannot take, and a limit below
    what the model holds before its first step (its weights: the CPU compares the resident
    bytes with the limit)."""
    bad = tmp_path / "bad.keras"
    bad.write_text("not a model")
    msg = _usage_error(capsys, [str(bad), "--steps", "2"])
    assert msg.split("error: ", 1)[1].startswith(f"cannot load model {bad}")
    msg = _usage_error(capsys, [small_model, "--input-shape", "32,32", "--steps", "2"])
    assert "bad --input-shape 32,32" in msg
    import keras
    big = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                            keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                            keras.layers.Dense(1 << 14), keras.layers.Dense(1)])  # 4.6 MiB
    path = tmp_path / "big.keras"
    big.save(path)
    msg = _usage_error(capsys, [str(path), "--memory-limit", "1", "--steps", "2",
                                "--batch-size", "2"])
    assert "--memory-limit 1 MiB is below the model's resident memory" in msg


def test_what_the_first_trial_says_is_a_usage_error():
    """Out of memory before the first step under a limit is a limit below resident (a GPU that
    cannot even hold the weights fails while loading); a timeout, or an out-of-memory error in a
    step, is no usage error (the table's note and exit status 1 say it)."""
    import types
    args = types.SimpleNamespace(memory_limit=64, model="m.keras", source="file",
                                 input_shape=None)
    for r in ({"status": "oom", "stage": "load", "message": "OOM"},
              {"status": "oom", "stage": "start", "message": "exit status 1: OOM"},
              {"status": "oom", "stage": "step", "resident_bytes": 65 * MIB, "message": "x"}):
        with pytest.raises(measure.UsageError, match="--memory-limit 64 MiB is below"):
            measure._check_first(args, r)
    for r in ({"status": "timeout", "stage": "start", "message": "no answer within 9 s"},
              {"status": "oom", "stage": "step", "resident_bytes": MIB, "message": "OOM"},
              {"status": "fits", "stage": "done"}):
        measure._check_first(args, r)
    with pytest.raises(measure.UsageError, match="cannot load model m.keras"):
        measure._check_first(args, {"status": "error", "stage": "load", "message": "bad zip"})
    args.memory_limit = None
    measure._check_first(args, {"status": "oom", "stage": "start", "message": "x"})


def test_xla_counts_the_pairs_fused_where_keras_traces(small_model, tmp_path):
    """--jit-compile true on the CPU: the switch's pairs are counted by the trace-time fusion
    (tf_relupool.keras_fusion.stats()), and its peak is lower than stock's under XLA too."""
    out_json = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_relupool.measure", small_model, "--batch-size", "8",
         "--steps", "2", "--jit-compile", "true", "--quiet", "--json", str(out_json)],
        capture_output=True, text=True, env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    stock, switch = report["variants"]["stock"], report["variants"]["switch"]
    assert report["jit_effective"] is True and "jit_compile=true (XLA)" in proc.stdout
    assert switch["fused_by"] == "XLA" and switch["fused"] >= 2, switch
    assert switch["steady_peak_bytes"] < stock["steady_peak_bytes"]
    assert _rows(proc.stdout)["enable_recompute()"][-1] == f"{switch['fused']} (XLA)"
    assert not [l for l in proc.stderr.splitlines() if l.startswith("measure [")]  # --quiet


def test_a_switch_trial_that_does_not_fit_runs_once_more(monkeypatch):
    """Under a limit on a GPU, a switch trial that ran out of memory or time runs again (the
    user's second run, with the first one's autotuning results) and reports both; stock,
    unlimited and CPU trials run once."""
    gpu = {"kind": "gpu"}
    outcomes = iter([{"status": "oom", "message": "m1", "device": gpu}, {"status": "fits"},
                     {"status": "oom", "message": "m2", "device": gpu},
                     {"status": "timeout", "device": gpu}, {"status": "fits"},
                     {"status": "oom", "device": {"kind": "cpu"}}])
    calls = []

    def fake(self, variant, batch, steps, limit):
        calls.append((variant, batch, limit))
        return dict(next(outcomes))
    monkeypatch.setattr(measure.Run, "_trial", fake)
    run = measure.Run(measure.parse_args(["VGG16"])[1], "applications", "VGG16", quiet=True)
    r = run.trial("switch", 48, 2, 4096)
    assert r["status"] == "fits" and r["first_run"]["status"] == "oom"
    assert calls == [("switch", 48, 4096)] * 2
    assert run.trial("stock", 24, 2, 4096)["message"] == "m2"
    r = run.trial("switch", 64, 2, 0)  # no limit: nothing to retry for
    assert r["status"] == "timeout" and len(calls) == 4
    assert run.trial("switch", 8, 2, 4096) == {"status": "fits"}
    assert run.trial("switch", 16, 2, 4096)["status"] == "oom"  # the CPU: no autotuning
    assert len(calls) == 6


def test_repeat_alternates_the_processes_and_reports_medians(monkeypatch):
    """--repeat 3: stock, switch, then switch, stock, then stock, switch; each variant's step time
    and peaks are the medians over its processes, each process's step time is listed under the
    table, and the speed ratio is of the medians. One process on a GPU: a note says step times
    move between processes and names --repeat."""
    figures = {"stock": iter([(10.0, 100), (14.0, 300), (11.0, 200)]),
               "switch": iter([(20.0, 50), (12.0, 70), (13.0, 60)])}
    gpu = {"kind": "gpu", "name": "GPU:0", "description": "a GPU"}
    calls = []

    def fake(self, variant, batch, steps, limit):
        calls.append(variant)
        ms, mib = next(figures[variant])
        return {"status": "fits", "step_seconds": ms / 1e3, "steady_peak_bytes": mib * MIB,
                "first_peak_bytes": 2 * mib * MIB, "device": gpu}
    monkeypatch.setattr(measure.Run, "_trial", fake)
    report = measure.measure(measure.parse_args(["VGG16", "--repeat", "3"])[1], quiet=True)
    assert calls == ["stock", "switch", "switch", "stock", "stock", "switch"]
    stock, switch = report["variants"]["stock"], report["variants"]["switch"]
    assert stock["step_seconds"] == 11.0 / 1e3 and switch["step_seconds"] == 13.0 / 1e3
    assert stock["steady_peak_bytes"] == 200 * MIB and switch["first_peak_bytes"] == 120 * MIB
    assert [p["step_seconds"] * 1e3 for p in switch["processes"]] == [20.0, 12.0, 13.0]
    table = measure.render(report)
    assert "step ms (median, 3 processes)" in table
    row = _rows(table)["enable_recompute()"]
    assert row[1] == "60.0 (0.30x)" and row[3] == "13.0 (0.85x speed)", row
    assert "enable_recompute(), step ms in each process (in run order): 20.0, 12.0, 13.0" in table
    assert "--repeat 3 gives" not in table

    # A process that did not fit: its status and message stand, medians over the rest.
    r = measure.combine([{"status": "fits", "step_seconds": 1.0},
                         {"status": "oom", "message": "m"},
                         {"status": "fits", "step_seconds": 3.0}])
    assert (r["status"], r["message"], r["step_seconds"]) == ("oom", "m", 2.0)
    one = {"status": "fits", "step_seconds": 0.01}
    assert measure.combine([one]) is one

    # One process per variant: on a GPU the note, on the CPU none.
    figures.update(stock=iter([(10.0, 100)]), switch=iter([(12.0, 60)]))
    report = measure.measure(measure.parse_args(["VGG16"])[1], quiet=True)
    table = measure.render(report)
    assert "step ms (median) |" in table and "--repeat 3 gives" in table
    report["device"] = {"kind": "cpu", "name": "CPU:0"}
    assert "--repeat" not in measure.render(report)


def _conv_bn_relu6_file(tmp_path):
    """A seeded conv -> BN -> relu6 -> conv -> pool -> Dense model saved as tmp_path/bn.keras."""
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(6.0),
        keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    path = tmp_path / "bn.keras"
    model.save(path)
    return path


def test_activations_flag_recomputes_under_xla(tmp_path):
    """--activations: the switch's trials run enable_recompute(activations=True); under XLA
    (--jit-compile true on the CPU) the JSON counts the recomputed segments and the table names
    the variant."""
    path = _conv_bn_relu6_file(tmp_path)
    out_json = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_relupool.measure", str(path), "--batch-size", "4", "--steps",
         "2", "--jit-compile", "true", "--activations", "--json", str(out_json), "--quiet"],
        capture_output=True, text=True, env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(out_json.read_text())["variants"]
    switch = variants["switch"]
    assert switch["segments"]["recomputed"] >= 1, switch
    # XLA's temp buffer, from each trial's buffer assignment: smaller with the recomputation
    # (the allocator's CPU peak counts whole power-of-two regions and need not show it)
    assert 0 < switch["xla_temp_bytes"] < variants["stock"]["xla_temp_bytes"], variants
    assert "XLA temp buffer MiB" in proc.stdout
    assert switch["segments"]["by_activation"].get("relu6") == switch["segments"]["segments"]
    assert "enable_recompute(activations=True)" in proc.stdout


def test_memory_budget_lists_one_switch_variant_per_budget(tmp_path):
    """--memory-budget 1,0: one switch variant per budget after stock, in that order, each
    trial run under enable_recompute(memory_budget=b): at 0 the block's convolution is
    recomputed (the JSON counts a conv+bn block), each has XLA's temp buffer (the saving itself
    is test_conv_recompute's, on MobileNetV2), the table names each budget and --plot draws the
    trade; a budget outside [0, 1] is a usage error naming the option."""
    path = _conv_bn_relu6_file(tmp_path)
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tf_relupool.measure", str(path), "--batch-size", "4", "--steps",
         "2", "--jit-compile", "true", "--memory-budget", "1,0", "--json", str(out_json),
         "--plot", str(out_png), "--quiet"],
        capture_output=True, text=True, env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["order"] == ["stock", "switch@1", "switch@0"]
    v = report["variants"]
    assert v["switch@0"]["segments"]["by_activation"].get("conv+bn+relu6") == 1, v["switch@0"]
    assert "segments" not in v["switch@1"]  # budget 1 with no --activations: the switch alone
    assert all(v[k]["xla_temp_bytes"] > 0 for k in report["order"]), v
    assert "enable_recompute(memory_budget=0)" in proc.stdout
    assert "enable_recompute(memory_budget=1)" in proc.stdout
    assert out_png.stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "tf_relupool.measure", str(path),
                          "--memory-budget", "1,1.5"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and "--memory-budget" in bad.stderr, bad.stderr[-2000:]
