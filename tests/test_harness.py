"""tf_relupool/_harness.py (what `python -m tf_relupool.measure` and the benchmarks share): the
largest-batch search, out-of-memory classification, trial processes, the worker protocol, the op
library's date and XLA's dump readers. benchmarks/harness.py's device probe, run as the benchmark
drivers run it; and benchmarks/distributed_memory.py's arguments and table."""
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tf_relupool import _harness as harness
from conftest import benchmark_cli, benchmarks_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
MIB = 2 ** 20


def test_largest_batch_search_finds_known_boundaries():
    """Doubling (or halving) from the start, then bisection to the granularity, with a fake
    trial function: the exact boundary, each batch tried once, few trials."""
    for boundary in (0, 63, 64, 100, 2752, 3264, 5248, 65536, 10 ** 6):
        for start, step in ((1024, None), (4096, None), (64, None), (2112, 256), (10 ** 6, None)):
            tried = []

            def fits(batch):
                tried.append(batch)
                return batch <= boundary

            best, seen = harness.largest_fitting(fits, start, 64, step, highest=65536)
            assert best == min(65536, boundary // 64 * 64), (boundary, start, step, tried)
            assert len(tried) == len(set(tried)) == len(seen), tried
            assert all(b % 64 == 0 and 64 <= b <= 65536 for b in tried), tried
            assert len(tried) <= 16, (boundary, start, step, tried)
    # Doubling from 1024 to the NOTES' stock simple-CNN boundary 2752: 1024, 2048, 4096 (OOM),
    # then bisection between 2048 and 4096 to 64.
    tried = []
    best, _ = harness.largest_fitting(lambda b: tried.append(b) or b <= 2752, 1024, 64)
    assert best == 2752 and tried[:3] == [1024, 2048, 4096] and len(tried) == 8, tried
    with pytest.raises(ValueError, match="granularity"):
        harness.largest_fitting(lambda b: True, 64, 0)


def test_bracket_and_bisect_follows_its_policy():
    """The search skeleton with another policy (memory_report's: up by a quarter, down by a
    fifth, halving to a relative width): the boundary to within the width, nothing fits: 0."""
    def search(boundary, start):
        tried = []
        best, seen = harness.bracket_and_bisect(
            lambda b: tried.append(b) or b <= boundary, start, up=lambda lo: int(lo * 1.25) + 1,
            down=lambda hi: int(hi * 0.8) or None, middle=lambda lo, hi: (lo + hi) // 2,
            narrow=lambda lo, hi: hi - lo <= max(1, int(lo * 0.1)))
        assert len(tried) == len(set(tried)) == len(seen), tried
        return best
    for boundary in (1, 37, 100, 1000):
        for start in (1, 50, 2000):
            best = search(boundary, start)
            assert best <= boundary and boundary - best <= max(1, int(best * 0.1)), best
    assert search(0, 50) == 0


def test_search_start_scales_the_measured_peak_to_the_limit():
    # 877 MiB at batch 1024 under a 2048 MiB limit: 90% of the limit at 2151 -> 2112, step 256.
    start, step = harness.search_start({1024: 877 * MIB}, 2048, 64, 1024)
    assert start == 2112 and step == 256, (start, step)
    assert harness.search_start({}, 2048, 64, 1024) == (1024, 1024)
    assert harness.search_start({64: 0}, 2048, 64, 512) == (512, 512)


def test_out_of_memory_in_disguise_is_oom():
    assert harness.classify_error("ResourceExhaustedError", "OOM when allocating tensor") == "oom"
    assert harness.classify_error("UnknownError", "Failed to get convolution algorithm. This is "
                                  "probably because cuDNN failed to initialize") == "oom"
    assert harness.classify_error("InvalidArgumentError", "input must be 4-dimensional") == "error"


def test_run_fresh_reads_status_from_the_exit(tmp_path):
    ok = harness.run_fresh([sys.executable, "-c", "print('hi')"], timeout=60)
    assert ok["status"] == "fits" and ok["stdout"].strip() == "hi"
    oom = harness.run_fresh([sys.executable, "-c", "import sys; sys.stderr.write("
                             "'ResourceExhaustedError: OOM when allocating\\n'); sys.exit(1)"],
                            timeout=60)
    assert oom["status"] == "oom" and "exit status 1" in oom["message"]
    crash = harness.run_fresh([sys.executable, "-c", "raise KeyError('x')"], timeout=60)
    assert crash["status"] == "crash" and "KeyError" in crash["message"]
    slow = harness.run_fresh([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    assert slow["status"] == "timeout"
    env = harness.trial_env({"TF_FORCE_GPU_ALLOW_GROWTH": "true", "A": "1"})
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in env and env["A"] == "1"


def test_worker_protocol(tmp_path):
    """A worker's answer is its last RESULT line; DEVICE_ERROR raises the device error; a worker
    that fails or prints no answer gives None, and its process for the caller's message."""
    assert harness.read_result('noise\nRESULT {"a": 1}\nRESULT [2]\nmore\n') == [2]
    assert harness.read_result("no answer\n") is None
    with pytest.raises(harness.DeviceError, match="no GPU"):
        harness.read_result('RESULT {}\nDEVICE_ERROR no GPU visible\n')
    # A worker that answers through the harness (loaded from its file, as the benchmarks load it).
    worker = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('h', "
              "sys.argv[1]); h = importlib.util.module_from_spec(spec); "
              "spec.loader.exec_module(h); h.print_result({'x': [1, 2]})")
    answer, proc = harness.run_worker([sys.executable, "-c", worker, harness.__file__], timeout=60)
    assert answer == {"x": [1, 2]} and proc.returncode == 0
    for code in ("import sys; print('RESULT {}'); sys.exit(1)", "print('nothing')"):
        answer, proc = harness.run_worker([sys.executable, "-c", code], timeout=60)
        assert answer is None, code


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a machine without a GPU")
def test_device_probe_without_a_gpu():
    """No NVIDIA device files: benchmarks/harness.py's detect_device says cpu without starting
    TensorFlow; the probe's subprocess (`python harness.py DEVICE`) names the CPU, and --device
    gpu is a DeviceError there."""
    code = "import sys, harness; print(harness.detect_device(), 'tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=BENCHMARKS)
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "False"], out.stderr[-2000:]
    cpu = benchmark_cli("harness", "cpu", timeout=300)
    dev = harness.read_result(cpu.stdout)
    assert cpu.returncode == 0 and dev["kind"] == "cpu" and dev["name"] == "CPU:0", cpu.stderr
    gpu = benchmark_cli("harness", "gpu", timeout=300)
    assert gpu.returncode == 3
    with pytest.raises(harness.DeviceError, match="no GPU visible"):
        harness.read_result(gpu.stdout)


def test_library_built_names_the_op_library(tmp_path, monkeypatch):
    """The tests run with the op library built: its date; a package without one: None."""
    built = harness.library_built()
    assert built is not None and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", built), built
    (tmp_path / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("tf_relupool", tmp_path / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert harness.library_built() is None


def test_conv_scratch_of_an_hlo_line(tmp_path):
    """The u8 scratch element of a cuDNN custom call's result tuple is its workspace."""
    hlo = tmp_path / "m.gpu_after_optimizations.txt"
    hlo.write_text(
        '  %cudnn-conv.1 = (f32[32,64,224,224]{3,2,1,0}, u8[19267584]{0}) custom-call(f32[32,3,'
        '224,224]{3,2,1,0} %p, f32[64,3,3,3]{3,2,1,0} %w), window={size=3x3 pad=1_1x1_1}, '
        'custom_call_target="__cudnn$convForward"\n'
        '  %fusion = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop\n')
    assert harness.conv_scratch(str(hlo)) == [("%cudnn-conv.1", "__cudnn$convForward", 19267584)]


def test_distributed_memory_arguments_are_checked():
    dm = benchmarks_module("distributed_memory")
    args = dm.parse_args([])
    assert args.models == list(dm.MODELS) and args.search_models == ["vgg16"]
    assert dm.parse_args(["--device", "cpu"]).search_models == []
    assert dm.parse_args(["--batch-sizes", "simple=64"]).batch_sizes == {"simple": 64}
    for bad in (["--replicas", "0"], ["--models", "alexnet"], ["--batch-sizes", "simple=x"],
                ["--replicas", "3"],                       # 512 is no multiple of 3
                ["--device", "cpu", "--search-models", "simple"],
                ["--search-variants", "on"]):
        p = benchmark_cli("distributed_memory", *bad)
        assert p.returncode == 2 and "error:" in p.stderr, (bad, p.returncode, p.stderr[-2000:])


def test_distributed_memory_table_flags_losses_that_differ():
    dm = benchmarks_module("distributed_memory")

    def variant(losses, peak):
        return {"losses": losses, "peak_step_bytes": {"GPU:0": peak, "GPU:1": peak // 2},
                "step_seconds": 0.01, "executed_ops": {"ReluMaxPoolWithWindowArgmax": 8,
                                                       "ReluMaxPoolGradFromWindowArgmax": 8}}
    report = {"meta": {"replicas": 2, "device": "2 logical GPUs", "date": "d", "commit": "c",
                       "host": "h", "memory_limit": 4096},
              "models": {"simple": {"batch": 64, "variants": {
                  "off": variant(["a", "b"], 200 * MIB), "switch": variant(["a", "b"], 100 * MIB),
                  "layer": variant(["a", "c"], 150 * MIB)}}},
              "largest": {"simple": {"switch": {"global_batch": 96}}}}
    rows = [l for l in dm.render(report).splitlines() if l.startswith("| simple")]
    assert len(rows) == 3
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[3] for c in cells] == ["yes", "yes", "NO"]
    assert [c[4] for c in cells] == ["200", "100", "150"]      # the larger replica's peak
    assert [c[5] for c in cells] == ["1.00x", "0.50x", "0.75x"]
    assert [c[8] for c in cells] == ["-", "96", "-"]
