"""The split merge inside stage 1 (``foscar.cute.config.CLUSTER_MERGE``), one decode a process under a timeout, so
that a hang costs seconds, not a test run: INT2 and INT4, 1 to 16 splits, one and two CTAs an SM, each output
against the float64 oracle (NaN-poisoned first). Prints one line a case: done (finite, error) or TIMEOUT.

    python3 benchmarks/cluster_smoke.py [--timeout S]
"""
import argparse
import os
import subprocess
import sys

CASES = [(2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 16, 2), (4, 2, 1), (4, 16, 2)]  # (bits, splits, CTAs an SM)


def one(bits: int, splits: int, ctas: int) -> None:
    import torch

    import foscar
    from foscar.bench.common import rel_l2
    from foscar.cute import config
    from foscar.cute.launch import decode
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_triton import make
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
    ap.add_argument("--timeout", type=float, default=40.0, help="seconds a case (compile included)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return one(*(int(x) for x in args.case.split(",")))
    for case in CASES:
        bits, splits, ctas = case
        name = f"INT{bits}, {splits} splits, {ctas} CTA(s) an SM"
        try:
            r = subprocess.run([sys.executable, __file__, "--case", ",".join(map(str, case))], capture_output=True,
                               text=True, timeout=args.timeout)
            lines = (r.stdout + r.stderr).strip().splitlines()
            print(f"{name}: rc {r.returncode}, {lines[-1] if lines else ''}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: TIMEOUT (hang)", flush=True)


if __name__ == "__main__":
    main()
