"""The split merge inside stage 1 (``foscar.cute.config.CLUSTER_MERGE``), one decode a process, the processes at
once under one deadline, so that a hang costs seconds, not a test run: INT2 and INT4, 1 to 16 splits, one and two
CTAs an SM, each output against the float64 oracle (NaN-poisoned first). Prints one line a case: done (finite, error) or TIMEOUT.

    python3 benchmarks/cluster_smoke.py [--timeout S]
"""
import argparse
import os
import subprocess
import sys
import time

CASES = [(2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 16, 2), (4, 2, 1), (4, 16, 2)]  # (bits, splits, CTAs an SM)


def one(bits: int, splits: int, ctas: int) -> None:
    import torch

    import foscar
    from foscar.bench.common import rel_l2
    from foscar.cute import config
    from foscar.cute.launch import decode
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from _cases import make
    config.CLUSTER_MERGE = True
    config.clear_switch_caches()
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    q, cache = make(fmt, [3000, 700], Hkv=2, G=4, page=64, seed=bits + splits)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    decode(q, cache, out=out, lse=lse, num_splits=splits, warp_specialized=True, ctas_per_sm=ctas,
           k_operand="e4m3", tiles_per_pass=2)
    torch.cuda.synchronize()
    print(f"done: finite {bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}, "
          f"error {rel_l2(out, foscar.decode_exact(q, cache)):.3e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds for all cases (compiles included)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return one(*(int(x) for x in args.case.split(",")))
    deadline = time.monotonic() + args.timeout
    procs = []  # every case at once: their compiles in parallel
    for case in CASES:
        procs.append((case, subprocess.Popen([sys.executable, __file__, "--case", ",".join(map(str, case))],
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for (bits, splits, ctas), proc in procs:
        name = f"INT{bits}, {splits} splits, {ctas} CTA(s) an SM"
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = out.strip().splitlines()
            print(f"{name}: rc {proc.returncode}, {lines[-1] if lines else ''}", flush=True)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            print(f"{name}: TIMEOUT (hang)", flush=True)


if __name__ == "__main__":
    main()
