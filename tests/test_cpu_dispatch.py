"""The CPU kernels' instruction-set paths: chosen at run time, each bitwise equal to the others.

The build compiles the CPU kernels (cc/kernels/relu_max_pool_cpu_kernels.cc) for baseline x86-64
(SSE2), AVX2 and AVX-512; cc/kernels/relu_max_pool_cpu.cc picks the best path the CPU supports,
or the one TF_RELUPOOL_CPU_ISA names. Here:
- every path this machine can run gives the same bits as the baseline path (outputs, window
  codes, gradients of both kinds, second order) and as stock TensorFlow, over random shapes that
  reach the vector loops and their tails, all four dtypes, and data full of ties, NaN, +-Inf and
  -0 (property tests; the path is switched inside the process through the library's C entry
  points, which read no state that a switch could leave stale);
- TF_RELUPOOL_CPU_ISA forces a path; an unknown name, or a path the CPU cannot run, logs one line
  and falls back to the best supported path (checked under valgrind, whose virtual CPU has no
  AVX-512, with the framework-free kernel test: no illegal instruction);
- AVX instructions appear in the library only inside the per-ISA copies, so no shared function
  (a weak template instantiation, say) can reach a CPU without them.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

import tf_relupool
from conftest import assert_bitwise_equal, cpu_flags, make_dy, stock_forward_and_grad
from tf_relupool._loader import library_path, load_library

ISAS = ("baseline", "avx2", "avx512")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _c_library():
    load_library()  # TensorFlow loads it first; ctypes then gets the same (already loaded) copy
    c = ctypes.CDLL(library_path())
    c.tf_relupool_cpu_isa.restype = ctypes.c_char_p
    c.tf_relupool_set_cpu_isa.argtypes = [ctypes.c_char_p]
    c.tf_relupool_cpu_isa_supported.argtypes = [ctypes.c_char_p]
    return c


C = _c_library()
SUPPORTED = [isa for isa in ISAS if C.tf_relupool_cpu_isa_supported(isa.encode())]


def active_isa():
    return C.tf_relupool_cpu_isa().decode()


def set_isa(isa):
    rc = C.tf_relupool_set_cpu_isa(isa.encode())
    assert rc == 0, f"cannot select {isa}: {rc}"


# ---- Choosing the path ----

def test_supported_paths_match_the_cpu():
    assert "baseline" in SUPPORTED
    flags = cpu_flags()
    if flags is None or not re.match(r"x86_64|AMD64", os.uname().machine):
        pytest.skip("no /proc/cpuinfo flags of an x86-64 CPU")
    assert ("avx2" in SUPPORTED) == ("avx2" in flags)
    assert ("avx512" in SUPPORTED) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)


def test_switch_in_process():
    before = active_isa()
    try:
        for isa in SUPPORTED:
            set_isa(isa)
            assert active_isa() == isa
        assert C.tf_relupool_set_cpu_isa(b"sse9") == -1
        for isa in set(ISAS) - set(SUPPORTED):
            assert C.tf_relupool_set_cpu_isa(isa.encode()) == -2
            assert active_isa() == SUPPORTED[-1]
    finally:
        set_isa(before)


_PROBE = textwrap.dedent("""
    import ctypes, numpy as np, tensorflow as tf, tf_relupool
    from tf_relupool._loader import library_path
    c = ctypes.CDLL(library_path()); c.tf_relupool_cpu_isa.restype = ctypes.c_char_p
    y = tf_relupool.relu_max_pool2d(tf.constant(np.arange(-8, 56, dtype=np.float32).reshape(1, 8, 8, 1)), 2, 2, "VALID")
    assert float(tf.reduce_max(y)) == 55.0
    print("ISA", c.tf_relupool_cpu_isa().decode())
""")


def _probe(env_value):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TF_RELUPOOL_CPU_ISA", None)
    if env_value is not None:
        env["TF_RELUPOOL_CPU_ISA"] = env_value
    # cwd: `python -c` puts it first on sys.path; outside the source tree the installed package
    # (with its compiled library) is imported.
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    isa = re.search(r"^ISA (\w+)$", proc.stdout, re.M).group(1)
    logs = [line for line in proc.stderr.splitlines() if line.startswith("tf_relupool:")]
    return isa, logs


def test_default_is_the_best_supported_path():
    assert _probe(None) == (SUPPORTED[-1], [])
    assert _probe("auto") == (SUPPORTED[-1], [])


@pytest.mark.parametrize("isa", ISAS)
def test_environment_forces_a_path(isa):
    if isa not in SUPPORTED:
        got, logs = _probe(isa)
        assert got == SUPPORTED[-1] and len(logs) == 1 and "cannot run that path" in logs[0]
        return
    assert _probe(isa) == (isa, [])


def test_unknown_name_logs_and_falls_back():
    got, logs = _probe("avx1024")
    assert got == SUPPORTED[-1]
    assert len(logs) == 1 and "avx1024 is not one of auto, baseline, avx2, avx512" in logs[0], logs


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("valgrind") or not shutil.which("g++"),
                    reason="needs valgrind and g++")
def test_forced_path_the_cpu_lacks_falls_back_without_sigill(tmp_path):
    """Valgrind's virtual CPU reports AVX2 but no AVX-512: forcing avx512 there must log and fall
    back, and the kernel test must pass on the paths it does run (memcheck on, too)."""
    exe = tmp_path / "kernels_test"
    cxx = ["g++", "-std=c++17", "-O1", "-ffp-contract=off", f"-I{ROOT}"]
    # The kernel source once per instruction set, with setup.py's CPU_ISA_DEFINES.
    kernels = []
    for isa, defines in (("baseline", []), ("avx2", ["-DTFRP_CPU_ISA_AVX2"]),
                         ("avx512", ["-DTFRP_CPU_ISA_AVX512"])):
        kernels.append(str(tmp_path / f"kernels_{isa}.o"))
        subprocess.run([*cxx, *defines, "-c",
                        os.path.join(ROOT, "cc/kernels/relu_max_pool_cpu_kernels.cc"),
                        "-o", kernels[-1]], check=True, timeout=900)
    subprocess.run([*cxx, os.path.join(ROOT, "tests/cc/kernels_test.cc"),
                    os.path.join(ROOT, "cc/kernels/relu_max_pool_cpu.cc"),
                    os.path.join(ROOT, "cc/kernels/relu_max_pool_params.cc"), *kernels,
                    "-o", str(exe), "-pthread"], check=True, timeout=900)
    env = dict(os.environ, TF_RELUPOOL_CPU_ISA="avx512")
    proc = subprocess.run(["valgrind", "-q", "--error-exitcode=3", str(exe), "--iters", "40",
                           "--threads", "2"], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "TF_RELUPOOL_CPU_ISA=avx512, but this CPU or build cannot run that path; using avx2" \
        in proc.stderr
    assert "on each CPU path (baseline, avx2): OK" in proc.stdout


def test_avx_instructions_only_in_the_per_isa_copies():
    """Disassembles the library: every function of this project's C++ (its namespace, and the
    std:: instantiations it emits) that uses a VEX/EVEX instruction or a ymm/zmm register belongs
    to the cpu_avx2 or cpu_avx512 copy; AVX-512 registers appear only in cpu_avx512."""
    if not shutil.which("objdump"):
        pytest.skip("needs objdump")
    if not re.match(r"x86_64|AMD64", os.uname().machine):
        pytest.skip("x86-64 only")
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library_path()],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    bad, isa_functions, fn, avx512_outside = [], {"cpu_avx2": 0, "cpu_avx512": 0}, None, []
    seen_vex = False

    def close():
        if fn is None or not seen_vex:
            return
        if "cpu_avx512::" in fn:
            isa_functions["cpu_avx512"] += 1
        elif "cpu_avx2::" in fn:
            isa_functions["cpu_avx2"] += 1
        elif "tf_relupool" in fn or "std::" in fn:
            bad.append(fn)

    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            close()
            fn, seen_vex = m.group(1), False
            continue
        parts = line.split("\t")
        if len(parts) < 2 or fn is None:
            continue
        insn = parts[-1]
        if re.match(r"v[a-z]", insn) or "%ymm" in insn or "%zmm" in insn or re.match(r"k[a-z]", insn):
            seen_vex = True
            if ("%zmm" in insn or re.match(r"k[a-z]", insn)) and "cpu_avx512::" not in fn:
                avx512_outside.append(fn)
    close()
    assert not bad, f"AVX code outside the per-ISA copies: {sorted(set(bad))[:10]}"
    assert not avx512_outside, f"AVX-512 code outside cpu_avx512: {sorted(set(avx512_outside))[:10]}"
    assert isa_functions["cpu_avx2"] > 0 and isa_functions["cpu_avx512"] > 0, isa_functions


def test_kernels_select_rather_than_max():
    """No max/min instruction in the CPU kernels: under denormals-are-zero (TensorFlow's threads)
    a max returns a denormal flushed to zero where a select keeps its bits, and GCC's choice
    between them differs between vector widths (relu_max_pool_cpu_element.h, SelectValue)."""
    if not shutil.which("objdump") or not re.match(r"x86_64|AMD64", os.uname().machine):
        pytest.skip("needs objdump on x86-64")
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library_path()],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    fn, found = None, set()
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
        elif fn and re.search(r"cpu_(baseline|avx2|avx512)::", fn) and \
                re.search(r"\tv?(max|min)(ps|ss|pd|sd)\b", line):
            found.add(fn)
    assert not found, f"max/min instructions in: {sorted(found)[:5]}"


# ---- Every path, bitwise ----

DTYPES = [tf.float32, tf.bfloat16, tf.float16, tf.float64]
# Denormals too: TensorFlow runs ops with denormals-are-zero (stock and fused pool [0, 1e-39]
# to 0), so the paths must all compare with float instructions, never integer tricks.
SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-39, -1e-39, 3e-8, 1e-310]


@st.composite
def dispatch_cases(draw):
    """Mostly 2x2 stride 2 (the vector loops) at sizes that reach a vector's worth of channels
    (NHWC) or output columns (NCHW) with and without a tail, even and odd; else any window."""
    data_format = draw(st.sampled_from(["NHWC", "NCHW"]))
    padding = draw(st.sampled_from(["VALID", "SAME"]))
    dtype = draw(st.sampled_from(DTYPES[:2] * 3 + DTYPES[2:]))
    if draw(st.integers(0, 9)) < 7:
        kh = kw = sh = sw = 2
        n = draw(st.integers(1, 2))
        if data_format == "NHWC":
            h, w, c = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 40))
        else:
            h, w, c = draw(st.integers(1, 7)), draw(st.integers(1, 72)), draw(st.integers(1, 3))
    else:
        kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        n, h, w, c = (draw(st.integers(1, 2)), draw(st.integers(1, 10)), draw(st.integers(1, 10)),
                      draw(st.integers(1, 20)))
    argmax_type = draw(st.sampled_from([None, None, None, tf.uint16, tf.int32]))
    shape = [n, h, w, c] if data_format == "NHWC" else [n, c, h, w]
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    z = rng.integers(draw(st.sampled_from([-4, -2, -1])), 3, size=shape).astype(np.float64)
    if draw(st.booleans()):
        z = z + rng.normal(size=shape) * 0.5
    rate = draw(st.sampled_from([0.0, 0.05, 0.3]))
    mask = rng.random(shape) < rate
    z[mask] = rng.choice(SPECIALS, size=int(mask.sum()))
    four = (lambda a, b: [1, a, b, 1]) if data_format == "NHWC" else (lambda a, b: [1, 1, a, b])
    return dict(z=z, dtype=dtype, ksize=four(kh, kw), strides=four(sh, sw), padding=padding,
                data_format=data_format, rng_seed=seed, argmax_type=argmax_type)


def _raw_results(case, z, dy, ddz):
    """Every op's outputs on the active path, as numpy arrays (codes included)."""
    lib = load_library()
    attrs = dict(ksize=case["ksize"], strides=case["strides"], padding=case["padding"],
                 data_format=case["data_format"])
    targmax = case["argmax_type"] or tf_relupool.ops.argmax_dtype_for(
        z.shape, case["ksize"], case["data_format"])
    y_keep_input = lib.relu_max_pool(z, **attrs)
    y, codes = lib.relu_max_pool_with_window_argmax(z, Targmax=targmax, **attrs)
    dz_from_codes = lib.relu_max_pool_grad_from_window_argmax(tf.shape(z), dy, codes, **attrs)
    dz_from_input = lib.relu_max_pool_grad(z, dy, **attrs)
    ddy = lib.relu_max_pool_grad_grad_from_window_argmax(ddz, codes, **attrs)
    return dict(y_keep_input=y_keep_input.numpy(), y=y.numpy(), codes=codes.numpy(),
                dz_from_codes=dz_from_codes.numpy(), dz_from_input=dz_from_input.numpy(),
                ddy=ddy.numpy())


def _same_bits(a, b):
    """Equal bits; for floats every NaN counts as one value. (Which of two NaNs an add returns
    depends on the operand order the compiler picks, so NaN payloads may differ between paths,
    as they do between stock's kernels.)"""
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        a_nan, b_nan = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
        return (np.array_equal(a_nan, b_nan) and
                np.array_equal(a.view(u)[~a_nan], b.view(u)[~b_nan]))
    return np.array_equal(a, b)


def _results_on_every_path(case, z, dy, ddz):
    """Baseline's _raw_results, once every supported path has given the same bits (the same IEEE
    operations in the same order). Leaves the last path set: the caller restores its own."""
    results = {}
    for isa in SUPPORTED:
        set_isa(isa)
        results[isa] = _raw_results(case, z, dy, ddz)
    for isa in SUPPORTED[1:]:
        for name, want in results["baseline"].items():
            assert _same_bits(results[isa][name], want), f"{isa} vs baseline: {name} differs"
    return results["baseline"]


@given(case=dispatch_cases())
def test_every_path_bitwise_equal_to_baseline_and_stock(case):
    z = tf.constant(case["z"], dtype=case["dtype"])
    y_shape = load_library().relu_max_pool(
        z, ksize=case["ksize"], strides=case["strides"], padding=case["padding"],
        data_format=case["data_format"]).shape
    dy = make_dy(case, y_shape)
    ddz = make_dy(dict(case, rng_seed=case["rng_seed"] + 7), z.shape)
    before = active_isa()
    try:
        baseline = _results_on_every_path(case, z, dy, ddz)
        rows, cols = (1, 2) if case["data_format"] == "NHWC" else (2, 3)
        if case["padding"] == "VALID" and (case["ksize"][rows] > z.shape[rows] or
                                           case["ksize"][cols] > z.shape[cols]):
            # Stock refuses this or, with oneDNN, fails or returns garbage (test_ops.py): the
            # fused ops give an empty output and a zero gradient.
            assert baseline["y"].size == 0
            assert not baseline["dz_from_codes"].any()
            assert not baseline["dz_from_input"].any()
            return
        # Stock, where it is defined (docs/semantics.md): float32/float64 Relu's sign of
        # -0 depends on the element's address in stock, so stock sees -0 as +0 there. Denormals:
        # TensorFlow's threads compare them as zeros (denormals-are-zero), the fused ops then
        # return the selected value's bits, and stock returns them or flushes them to zero
        # depending on its kernel; stock sees them as zeros of their sign (+0 for 32/64-bit).
        z_stock = np.array(tf.cast(z, tf.float64))
        tiny = {tf.bfloat16: 2.0**-126, tf.float16: 2.0**-14, tf.float32: 2.0**-126,
                tf.float64: 2.0**-1022}[case["dtype"]]
        denormal = (np.abs(z_stock) < tiny) & (z_stock != 0)
        z_stock[denormal] = np.copysign(0.0, z_stock[denormal])
        if case["dtype"] in (tf.float32, tf.float64):
            z_stock[z_stock == 0] = 0.0
        z = tf.constant(z_stock, dtype=case["dtype"])
        set_isa("baseline")
        ours = _raw_results(case, z, dy, ddz)
        y_stock, dz_stock = stock_forward_and_grad(z, dy, case["ksize"], case["strides"],
                                                   case["padding"], case["data_format"])
        for isa in SUPPORTED:  # the other paths equal baseline; check them against stock too
            set_isa(isa)
            if isa != "baseline":
                ours = _raw_results(case, z, dy, ddz)
            assert_bitwise_equal(ours["y"], y_stock, f"{isa}: forward")
            assert_bitwise_equal(ours["y_keep_input"], y_stock, f"{isa}: forward (keep=input)")
            assert_bitwise_equal(ours["dz_from_codes"], dz_stock, f"{isa}: gradient from codes")
            assert_bitwise_equal(ours["dz_from_input"], dz_stock, f"{isa}: gradient from input")
    finally:
        set_isa(before)


@pytest.mark.parametrize("dtype, shape, data_format", [
    (tf.float32, (16, 128, 128, 64), "NHWC"),
    (tf.float32, (8, 64, 112, 112), "NCHW"),
    (tf.float32, (8, 64, 56, 56), "NCHW"),
    (tf.bfloat16, (32, 128, 128, 64), "NHWC"),
    (tf.bfloat16, (16, 64, 128, 128), "NCHW"),
    # Rows that are not a whole number of vectors: the last vector overlaps the one before, and
    # its streaming stores leave out what that one wrote (PutVec's skip).
    (tf.float32, (16, 128, 128, 24), "NHWC"),
    (tf.bfloat16, (12, 64, 112, 112), "NCHW"),
])
def test_large_outputs_on_every_path(dtype, shape, data_format):
    """Outputs of 16 MiB and more: the 2x2 loops write dz (and, NHWC, y and the codes) with
    streaming stores (relu_max_pool_cpu_kernels.cc StreamDz, StreamForward); every path still equals
    baseline and stock."""
    rng = np.random.default_rng(1)
    z_np = rng.integers(-3, 4, size=shape) + rng.normal(size=shape) * 0.5
    z_np[rng.random(shape) < 0.01] = np.nan
    z = tf.constant(z_np, dtype)
    four = [1, 2, 2, 1] if data_format == "NHWC" else [1, 1, 2, 2]
    case = dict(z=z_np, dtype=dtype, ksize=four, strides=four, padding="VALID",
                data_format=data_format, rng_seed=3, argmax_type=None)
    y_shape = load_library().relu_max_pool(z, ksize=four, strides=four, padding="VALID",
                                           data_format=data_format).shape
    dy = make_dy(case, y_shape)
    before = active_isa()
    try:
        baseline = _results_on_every_path(case, z, dy, z)
    finally:
        set_isa(before)
    y_stock, dz_stock = stock_forward_and_grad(z, dy, four, four, "VALID", data_format)
    assert_bitwise_equal(baseline["y"], y_stock, "forward")
    assert_bitwise_equal(baseline["dz_from_codes"], dz_stock, "gradient from codes")
    assert_bitwise_equal(baseline["dz_from_input"], dz_stock, "gradient from input")
