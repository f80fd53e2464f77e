"""What an XLA executable allocates: read from an `--xla_dump_to` directory.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python train.py
    python benchmarks/xla_buffers.py /tmp/dump [--module one_step_on_data]

For each dumped module whose name contains --module (default: every module with a buffer
assignment), prints the allocations of its buffer assignment by kind (parameters, outputs,
the preallocated temp buffer: one contiguous allocation per run), and the scratch (workspace)
buffers of its cuDNN convolutions (the u8[N] element of a `__cudnn$conv...` custom call's result
tuple, which the autotuner sized and which lives inside the temp buffer). No TensorFlow import;
the files are read by tf_relupool/_harness.py's xla_allocations and conv_scratch.
"""
import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# The dump's readers are tf_relupool/_harness.py's (the tests read the temp buffer with them).
from harness import MIB, conv_scratch, xla_allocations as allocations  # noqa: E402


def summarize(dump_dir, module_filter="", args_report_lines=12):
    lines = []
    for ba in sorted(glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt"))):
        name = os.path.basename(ba)[:-len(".buffer-assignment.txt")]
        if module_filter not in name:
            continue
        allocs = allocations(ba)
        kinds = {"parameter": 0, "output": 0, "temp": 0, "constant": 0, "other": 0}
        for _, size, kind in allocs:
            key = ("temp" if "preallocated-temp" in kind else "parameter" if "parameter" in kind
                   else "output" if ("output" in kind or "live-out" in kind) else
                   "constant" if "constant" in kind else "other")
            kinds[key] += size
        temp = max((s for _, s, k in allocs if "preallocated-temp" in k), default=0)
        lines.append(f"{name}: {len(allocs)} allocations; temp {temp / MIB:.1f} MiB; "
                     + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in kinds.items() if v))
        stem = ba[:-len("-buffer-assignment.txt")]
        hlo = stem + ".txt"
        report = stem + "-memory-usage-report.txt"
        if os.path.exists(report):
            with open(report) as f:
                head = [l.rstrip() for l in f.readlines()[:args_report_lines]]
            lines += ["  " + l for l in head if l.strip()]
        if os.path.exists(hlo):
            convs = conv_scratch(hlo)
            if convs:
                convs.sort(key=lambda c: -c[2])
                total = sum(c[2] for c in convs)
                lines.append(f"  {len(convs)} cuDNN convolutions, scratch largest "
                             f"{convs[0][2] / MIB:.1f} MiB, sum {total / MIB:.1f} MiB; largest: "
                             + "; ".join(f"{c[0]} {c[1].split('$')[-1]} {c[2] / MIB:.1f} MiB"
                                         for c in convs[:6]))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dump_dir")
    p.add_argument("--module", default="", help="only modules whose file name contains this")
    p.add_argument("--report-lines", type=int, default=12,
                   help="lines of XLA's memory-usage report shown per module (default 12)")
    args = p.parse_args(argv)
    lines = summarize(args.dump_dir, args.module, args.report_lines)
    if not lines:
        print(f"xla_buffers.py: no *buffer-assignment.txt in {args.dump_dir}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
