"""benchmarks/largest_batch.py (the largest batch at Keras' default compile): the k-ary search,
the variants and levers, out-of-memory sizes and the report; benchmarks/xla_buffers.py (what an
XLA executable allocates) run on a real XLA dump."""
import glob
import os
import subprocess
import sys

import pytest

from tf_relupool import _harness
from conftest import benchmark_cli, benchmarks_module

lb = benchmarks_module("largest_batch")


@pytest.mark.parametrize("boundary", [0, 7, 8, 24, 31, 40, 95, 96, 200])
@pytest.mark.parametrize("width", [1, 3, 6])
def test_kary_search_finds_the_boundary(boundary, width):
    """Rounds of `width` parallel trials narrow [lowest, highest] to the largest multiple of the
    granularity that fits (0 when none does, highest when all do), each batch tried once."""
    s = lb.Search("vgg16", "default", 4096, 8, 8, 96)
    tried, rounds = [], 0
    for _ in range(20):
        batches = s.candidates(width)
        if not batches:
            break
        rounds += 1
        assert len(batches) <= width and all(b % 8 == 0 and 8 <= b <= 96 for b in batches)
        assert not set(batches) & set(tried)
        tried += batches
        s.record([{"batch": b, "status": "fits" if b <= boundary else "oom"} for b in batches])
    assert s.answer() == min(96, boundary // 8 * 8)
    # 12 candidate batches: bisection (width 1) needs at most 4 rounds, wider rounds 2.
    assert rounds <= {1: 4, 3: 2, 6: 2}[width]


def test_bracket_takes_the_failure_over_a_fit_above_it():
    """A fit above a failure (not monotone, e.g. a flaky trial) does not raise the answer."""
    assert lb.update_bracket(0, 104, {24: True, 48: False, 72: True}) == (24, 48)
    assert lb.update_bracket(24, 48, {32: False, 40: True}) == (24, 32)


def test_variants_and_levers():
    assert lb.parse_variant("default-switch+autotune1+slop3") == ("default-switch",
                                                                 ["autotune1", "slop3"])
    for bad in ("nope", "default+nolever"):
        with pytest.raises(ValueError, match="unknown"):
            lb.parse_variant(bad)
    env = lb.lever_env(["autotune1", "slop3", "determinism"], base={"XLA_FLAGS": "--a=1"})
    assert env["XLA_FLAGS"] == ("--a=1 --xla_gpu_autotune_level=1 "
                                "--xla_gpu_memory_limit_slop_factor=3")
    assert env["TF_DETERMINISTIC_OPS"] == "1"
    assert "XLA_FLAGS" not in lb.lever_env([], base={})
    assert "autotune_level=0" in lb.variant_label("default+autotune0")


def test_oom_sizes_from_messages():
    assert lb.oom_bytes("Out of memory while trying to allocate 2.07GiB.") == int(2.07 * 2 ** 30)
    assert lb.oom_bytes("OOM when allocating tensor ... allocating 272.00MiB") == 272 * 2 ** 20
    assert lb.oom_bytes("allocate 3221225472 bytes") == 3221225472
    assert lb.oom_bytes("something else") is None


def test_report_of_trials_and_measurements():
    """The Markdown report names every trial with its status and the size that failed, and
    gives ratios against the first variant."""
    args = vars(lb.parse_args(["--models", "vgg16", "--variants", "default,default-switch"]))
    gib = 2 ** 30
    report = {
        "args": args, "meta": {"date": "2026-12-03 16:00", "seconds": 1,
                               "device": {"name": "GPU:0", "description": "test"}},
        "measured": {"vgg16": {
            "default": [{"status": "fits", "first_peak_bytes": 5 * gib, "steady_peak_bytes": 4 * gib,
                         "step_seconds": 0.02, "first_step_seconds": 25}],
            "default-switch": [{"status": "fits", "first_peak_bytes": 5 * gib,
                                "steady_peak_bytes": 2 * gib, "step_seconds": 0.016,
                                "first_step_seconds": 26}]}},
        "largest": {"vgg16": {
            "default": {"batch": 16, "limit_mib": 4096, "open": False,
                        "trials": [{"batch": 16, "status": "fits", "first_step_seconds": 60},
                                   {"batch": 24, "status": "oom", "failed_step": 1,
                                    "failed_bytes": 3256 * 2 ** 20}]},
            "default-switch": {"batch": 24, "limit_mib": 4096, "open": False,
                               "trials": [{"batch": 24, "status": "fits"}]}}},
        "trials": [{"model": "vgg16", "variant": "default-switch", "batch": 32, "limit_mib": 4096,
                    "status": "oom", "failed_step": 1, "failed_bytes": 2120 * 2 ** 20}]}
    md = lb.render(report)
    assert "| vgg16 | default-switch | 32 | 4096 | oom |" in md and "step 1: 2120 MiB" in md
    assert "1.25x" in md  # speed: 20 ms / 16 ms
    assert "| 24 | 1.50x |" in md  # largest batch against the default's 16
    assert "24 oom (step 1: 3256 MiB)" in md


def test_a_switched_trial_runs_again_with_the_cache_of_its_first_run(monkeypatch):
    """--runs: a switched variant's trial runs that many processes in turn, all given one fresh
    autotune cache directory (removed afterwards); the last run decides and every run is
    reported. A stock variant runs once, without a cache."""
    calls = []
    outcomes = iter([{"batch": 48, "status": "timeout"},
                     {"batch": 48, "status": "fits", "first_step_seconds": 18.0}])

    def fake(args, model, token, batch, limit, steps, timeout, log_name, cache):
        calls.append((token, cache, os.path.isdir(cache) if cache else None))
        return dict(next(outcomes)) if cache else {"batch": batch, "status": "oom",
                                                    "failed_bytes": 3256 * 2 ** 20}
    monkeypatch.setattr(lb, "_run_process", fake)
    args = lb.parse_args(["--runs", "2"])
    r = lb.run_one(args, "vgg16", "default-switch+free4g", 48, 4096, 2, 100)
    assert [c[0] for c in calls] == ["default-switch+free4g"] * 2
    assert calls[0][1] == calls[1][1] and calls[0][2] and calls[1][2]
    assert not os.path.exists(calls[0][1])  # removed after the trial
    assert r["status"] == "fits" and [h["status"] for h in r["runs"]] == ["timeout", "fits"]
    row = lb._status_cell(r)
    assert row.startswith("fits (run 1: timeout") and "run 2" not in row
    calls.clear()
    r = lb.run_one(args, "vgg16", "default", 24, 4096, 2, 100)
    assert calls == [("default", None, None)] and "runs" not in r
    assert lb._status_cell(r) == "oom"
    calls.clear()
    outcomes = iter([{"batch": 32, "status": "fits"}])
    r = lb.run_one(args, "vgg16", "default-switch", 32, 0, 5, 100, runs=1)  # a measurement
    assert len(calls) == 1 and calls[0][1] and "runs" not in r
    assert lb._status_cell({"status": "fits", "runs": [
        {"status": "oom", "failed_bytes": 3154 * 2 ** 20, "first_step_seconds": None},
        {"status": "fits"}]}) == "fits (run 1: oom 3154 MiB)"


def test_levers_for_a_smaller_gpu_and_the_allocator():
    env = lb.lever_env(["free4g", "async", "atcache"], base={})
    assert env["TFRP_GPU_FREE_MIB"] == "4400" and env["TF_GPU_ALLOCATOR"] == "cuda_malloc_async"
    assert "--xla_gpu_per_fusion_autotune_cache_dir=" in env["XLA_FLAGS"]


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--variants", "default+x"],
                                  ["--memory-limit", "vgg16"], ["--jobs", "0"]])
def test_bad_arguments_are_errors(argv):
    p = benchmark_cli("largest_batch", *argv)
    assert p.returncode == 2 and "error:" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_xla_buffers_reads_a_real_dump(tmp_path):
    """A jit-compiled function's dump (XLA on the CPU): its allocations by kind, the temporary
    buffer among them, and XLA's own memory report; an empty directory is an error."""
    code = ("import tensorflow as tf\n"
            "f = tf.function(lambda x: tf.reduce_sum(tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, 'VALID')"
            " * 3.0), jit_compile=True)\n"
            "print(float(f(tf.ones([4, 16, 16, 8]))))\n")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
               TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("6144.0")
    report = benchmark_cli("xla_buffers", str(tmp_path))
    assert report.returncode == 0, report.stderr[-2000:]
    lines = report.stdout.splitlines()
    assert lines and "allocations; temp" in lines[0] and "parameter 0.0 MiB" in lines[0]
    assert any("Total bytes used" in l for l in lines)
    empty = benchmark_cli("xla_buffers", str(tmp_path / "empty"))
    assert empty.returncode == 1 and "no *buffer-assignment.txt" in empty.stderr, empty.stderr
    # The reader beneath it, the package's (the tests read XLA's temp buffer with it).
    allocs = [a for f in glob.glob(str(tmp_path / "*buffer-assignment.txt"))
              for a in _harness.xla_allocations(f)]
    assert any("parameter" in kind for _, _, kind in allocs), allocs[:10]


def test_the_noretry_lever_turns_off_the_allocators_retry(monkeypatch):
    from tensorflow.python.eager import context
    monkeypatch.setattr(context.Context, "_compute_gpu_options",
                        context.Context._compute_gpu_options)
    before = context.context()._compute_gpu_options()
    assert not before.experimental.disallow_retry_on_allocation_failure
    assert lb.lever_env(["noretry"], base={})["TFRP_NO_ALLOC_RETRY"] == "1"
    lb._disallow_allocation_retry()
    after = context.context()._compute_gpu_options()
    assert after.experimental.disallow_retry_on_allocation_failure
    assert "multiheap_size_constraint_per_heap=536870912" in lb.variant_label("default+heap512")
