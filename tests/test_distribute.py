"""tf.distribute: MultiWorkerMirroredStrategy with two worker processes on localhost, MirroredStrategy
with Keras fit over logical CPUs, and a worker that dies mid-training.

Everything runs examples/distributed.py (the script users copy) in fresh processes: a strategy,
logical devices and op determinism are process-wide. Each run trains the stock model with the
switch off, the same model with `enable_recompute()`, and `rewrite_model`'s ReluMaxPool2D layers,
from the same initial weights on the same batches, in the same processes. What TensorFlow executed
is read from the partition graphs of the first step (`tf_relupool.run_metadata.executed_ops`).
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "distributed.py")
TIMEOUT = 420     # seconds for a whole run (about 30-60 s here)


def _script():
    spec = importlib.util.spec_from_file_location("distributed_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # no TensorFlow import at module level
    return module


def _env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_RELUPOOL_RECOMPUTE", None)
    return env


def _stock_pool_ops(ops):
    return {k: v for k, v in ops.items() if "MaxPool" in k and not k.startswith("ReluMaxPool")}


#: What each pooling backward reads from the forward pass (examples/distributed.py,
#: kept_for_pool_grads): stock's MaxPoolGrad the ReLU'd convolution output (z's size) and the
#: pooled output; the fused argmax gradient only the one-byte codes; keep="input" z itself.
_KEPT = {"argmax": ["ReluMaxPoolGradFromWindowArgmax <- ReluMaxPoolWithWindowArgmax:1"],
         "input": ["ReluMaxPoolGrad <- {conv}:0"]}


def _check_variants(variants, keep, local_replicas=1):
    """Bitwise equal training in every variant; the fused ops executed where expected, and their
    backward reads what the keep mode keeps: with keep="argmax" the codes alone (1 byte per
    pooled element, where stock's MaxPoolGrad reads the ReLU'd tensor, 4 bytes per input
    element); with keep="input" z, the size of what stock keeps. Every step's peak memory is
    measured, but not compared: on these CPU steps (batch 64 per worker) the saving at rest,
    about 27 MiB, is the size of what moves a step's measured peak with timing (2026-12-03,
    2-core Xeon, oneDNN off, 8 runs under load: stock 65-113 MiB, keep="argmax" 46-86 MiB for
    steps 2-8). The BFC allocator's bytes in use count whole chunks (a 16 MiB tensor in a
    free 25-32 MiB chunk counts all of it; which chunks are free depends on the order earlier
    steps ran in), and the inter-op threads and the collectives' timing decide whether the
    convolution backward's 12-17 MiB scratch buffers overlap the pool backward. With one
    inter-op thread the ranges still overlap (stock 74-92, argmax 50-81). Comparing the
    medians is how this test (then ..._bitwise_fused_and_leaner[argmax]) failed at random
    (docs/distribute.md has the figures). The saving measured in one process, with
    its spread, is docs/memory.md's."""
    fwd = {"argmax": "ReluMaxPoolWithWindowArgmax", "input": "ReluMaxPool"}[keep]
    bwd = {"argmax": "ReluMaxPoolGradFromWindowArgmax", "input": "ReluMaxPoolGrad"}[keep]
    off = variants["off"]
    pools = 4 * local_replicas   # the model's 4 pools in each replica's copy of the step
    assert len(set(off["losses"])) > 1                      # it does train
    assert _stock_pool_ops(off["executed_ops"])             # stock MaxPool / MaxPoolGrad ran
    assert fwd not in off["executed_ops"]
    # stock's pool backward reads the ReLU'd convolution output (the ReLU fused into the conv)
    stock_kept = [k for k in off["kept_for_pool_grads"] if "Conv2D:" in k.split(" <- ")[1]]
    assert len(stock_kept) == pools and all("MaxPoolGrad" in k for k in stock_kept), off
    for variant in variants.values():   # every step's peak measured, on every allocator
        assert variant["peak_step_bytes"], variant
        for device, steps in variant["step_peaks_bytes"].items():
            assert len(steps) == len(off["losses"]) and all(b > 0 for b in steps), (device, steps)
    conv = stock_kept[0].split(" <- ")[1].split(":")[0]   # the convolution's op type
    for name in ("switch", "layer"):
        got = variants[name]
        assert got["losses"] == off["losses"], name          # bit for bit
        assert got["weights_sha256"] == off["weights_sha256"], name
        ops = got["executed_ops"]
        assert ops.get(fwd) == pools and ops.get(bwd) == pools, (name, ops)
        assert not _stock_pool_ops(ops), (name, ops)
        assert set(got["peak_step_bytes"]) == set(off["peak_step_bytes"]), (name, got, off)
        kept = [k.format(conv=conv) for k in _KEPT[keep]] * pools
        assert got["kept_for_pool_grads"] == kept, (name, got["kept_for_pool_grads"])
    # the Grappler pass made the switch's fused ops; the layers brought their own
    assert variants["switch"]["pass_fusions"] == pools
    assert variants["layer"]["pass_fusions"] == 0


def test_worker_ports_lie_outside_the_ephemeral_range():
    """The local workers' ports (start_local_workers) are free when picked and outside the range
    where the OS picks ports by itself (any process's outgoing connection, any bind to port 0),
    so that nothing but a process naming them can take them in the seconds before the workers
    bind them. With ports from a bind to port 0 (the ephemeral range), another process's
    connection could take one first, and that worker would fail to start its server at random
    ("Could not start gRPC server")."""
    dist = _script()
    low, high = dist.ephemeral_port_range()
    ports = dist.free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports), ports
    room = max(0, low - dist._PORT_FLOOR) + max(0, 65535 - high)
    if room >= 300:   # else free_ports falls back to ports from a bind to port 0
        assert not any(low <= p <= high for p in ports), (ports, (low, high))
    assert all(dist._bindable(p) for p in ports), ports


@pytest.mark.parametrize("keep", ["argmax", pytest.param("input", marks=pytest.mark.slow)])
def test_multi_worker_two_processes_bitwise_and_fused(tmp_path, keep):
    dist = _script()
    out = tmp_path / "worker-{task}.json"
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    files = [open(p, "w") for p in logs]
    procs = dist.start_local_workers(
        2, ["--variants", "off,switch,layer", "--keep", keep, "--steps", "8",
            "--global-batch-size", "128", "--deterministic", "--device", "cpu",
            "--json", str(out)], env=_env(), cwd=tmp_path, outputs=files)
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            p.kill()
        for f in files:
            f.close()
    logs = [p.read_text(errors="replace") for p in logs]
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"worker {i}:\n" + logs[i][-4000:]
    results = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    assert [r["task"] for r in results] == [0, 1]
    assert all(r["replicas"] == 2 for r in results)
    for r in results:
        _check_variants(r["variants"], keep)
    # the workers agree: the reduced losses and the mirrored weights
    for name in ("off", "switch", "layer"):
        assert results[0]["variants"][name]["losses"] == results[1]["variants"][name]["losses"]
        assert (results[0]["variants"][name]["weights_sha256"] ==
                results[1]["variants"][name]["weights_sha256"])


@pytest.mark.parametrize("replicas", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_mirrored_fit_logical_cpus_bitwise_and_fused(tmp_path, replicas):
    # Logical CPUs share one allocator: one peak for all replicas (measured, not compared: see
    # _check_variants).
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--strategy", "mirrored", "--replicas", str(replicas),
         "--variants", "off,switch,layer", "--steps", "6", "--global-batch-size", "126"
         if replicas == 3 else "128", "--deterministic", "--device", "cpu",
         "--json", str(tmp_path / "mirrored.json")],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "mirrored.json").read_text())
    assert result["replicas"] == replicas
    assert all(not v["jit_compile"] for v in result["variants"].values())  # Keras: no XLA here
    _check_variants(result["variants"], "argmax", local_replicas=replicas)


def _wait_for(path, text, deadline):
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (0, signal.SIGKILL),
                                        (1, signal.SIGSTOP)],
                         ids=["worker-killed", "chief-killed", "worker-stopped"])
def test_worker_dying_mid_training_fails_the_other_in_bounded_time(tmp_path, victim, sig):
    """Both workers train; then one is killed or stopped. The survivor, alive and training until
    then, raises TensorFlow's error (the collective aborted, or the coordination service reports
    the peer unhealthy) within a bound, instead of waiting forever. The victim died of the
    signal (SIGKILL), or is still there, stopped, when the survivor has given up (SIGSTOP)."""
    dist = _script()
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    files = [open(p, "w") for p in logs]
    procs = dist.start_local_workers(
        2, ["--variants", "switch", "--steps", "100000", "--global-batch-size", "16",
            "--device", "cpu"], env=_env(), cwd=tmp_path, outputs=files)
    survivor = 1 - victim
    victim_rc = "not checked"
    try:
        deadline = time.monotonic() + TIMEOUT
        for i in (victim, survivor):   # both past their second step: training together
            assert _wait_for(logs[i], "switch step 2 ", deadline), logs[i].read_text()[-3000:]
        assert procs[survivor].poll() is None and procs[victim].poll() is None
        procs[victim].send_signal(sig)
        killed_at = time.monotonic()
        rc = procs[survivor].wait(timeout=120)
        waited = time.monotonic() - killed_at
        if sig == signal.SIGKILL:
            victim_rc = procs[victim].wait(timeout=10)
        else:
            victim_rc = procs[victim].poll()   # stopped: still there
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in files:
            f.close()
    text = logs[survivor].read_text(errors="replace")
    assert rc != 0, text[-3000:]
    assert waited < 60, waited    # ~1 s (port closed) or ~10 s (heartbeat timeout) here
    assert ("UnavailableError" in text or "DeadlineExceededError" in text), text[-3000:]
    assert "Traceback" in text and "Segmentation fault" not in text
    assert victim_rc == (-signal.SIGKILL if sig == signal.SIGKILL else None), victim_rc
    assert "Traceback" not in logs[victim].read_text(errors="replace")   # it raised nothing
