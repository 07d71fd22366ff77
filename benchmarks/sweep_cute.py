"""Split-count sweep of the CuTe DSL Hopper kernels (v0, and v1 = warp-specialized) on the present GPU.

    python benchmarks/sweep_cute.py --shapes 8:8K 8:32K --bits 2 4 --splits 0.5 1 2 4

Every candidate's output is first checked against the float64 slice reference (a wrong one is printed
and not timed). One line per (shape, bits, variant, splits): median time (CUDA-graph replays, L2
flushed, CUDA events) and the fraction of the read ceiling; then the best per shape. A working tool
for the CuTe kernels' split heuristic and tuned configs; the product's tuned configs come from
``foscar tune``.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sweep_common import add_common_args, sweep

from foscar.cute import launch

VARIANTS = {"v0": (False, 1), "v1": (True, 1), "v1x2": (True, 2)}  # (warp_specialized, ctas_per_sm)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "8:8K")
    p.add_argument("--splits", type=float, nargs="+", default=[0.5, 1, 2, 4], help="multiples of the default")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["v0", "v1"],
                   help="v0, v1 (one CTA per SM), v1x2 (two)")
    a = p.parse_args()

    def candidates(B, L, dev):
        for variant, m in itertools.product(a.variants, a.splits):
            ws, ctas = VARIANTS[variant]
            base = launch.default_num_splits(B, 8, L // 64, dev, ctas if ws else launch.V0_RESIDENT)
            splits = max(1, round(base * m))
            yield ({"variant": variant, "num_splits": splits, "default": base},
                   lambda q, cache, out, s=splits, ws=ws, c=ctas: launch.decode(q, cache, out=out, num_splits=s,
                                                                               warp_specialized=ws, ctas_per_sm=c))
    sweep(a, candidates)


if __name__ == "__main__":
    main()
