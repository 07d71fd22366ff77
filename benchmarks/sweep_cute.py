"""Split-count sweep of the CuTe DSL Hopper kernels (v0, and v1 = warp-specialized) on the present GPU.

    python benchmarks/sweep_cute.py --shapes 8:8K 8:32K --bits 2 4 --splits 0.5 1 2 4
    python benchmarks/sweep_cute.py --shapes 1:8K 1:128K --variants tuned v1 v1x2 v1w --splits 1 1.5 2

Variants: ``v0``; ``v1`` and ``v1x2`` (one or two CTAs an SM, the format's default operands and passes); ``v1w``
(v1 at one CTA an SM with ``foscar.cute.config.WIDE_EIGHT_COLUMNS`` set for its launches: three consumer warpgroups);
``tuned`` (the launch ``foscar.decode`` takes: the tuned config, else the defaults; ``--splits`` do not apply).

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

from foscar.cute import config, launch

VARIANTS = {"v0": (False, 1), "v1": (True, 1), "v1x2": (True, 2), "v1w": (True, 1)}  # (warp_specialized, ctas_per_sm)


def with_wide_eight(run):
    """``run`` with :data:`foscar.cute.config.WIDE_EIGHT_COLUMNS` set for its call (the configs and default variants
    of either setting are cached apart: the caches are cleared on each change)."""
    def wide(*args, **kwargs):
        config.WIDE_EIGHT_COLUMNS = True
        config.clear_switch_caches()
        try:
            return run(*args, **kwargs)
        finally:
            config.WIDE_EIGHT_COLUMNS = False
            config.clear_switch_caches()
    return wide


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "8:8K")
    p.add_argument("--splits", type=float, nargs="+", default=[0.5, 1, 2, 4], help="multiples of the default")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS) + ["tuned"], default=["v0", "v1"],
                   help="v0, v1 (one CTA per SM), v1x2 (two), v1w (one, three consumers), tuned (foscar.decode's)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of Hq 32 (GQA 32 / kv_heads)")
    a = p.parse_args()

    def candidates(B, L, dev):
        if "tuned" in a.variants:
            yield {"variant": "tuned"}, lambda q, cache, out: launch.decode(q, cache, out=out)
        for variant, m in itertools.product([v for v in a.variants if v != "tuned"], a.splits):
            ws, ctas = VARIANTS[variant]
            base = launch.default_num_splits(B, a.kv_heads, L // 64, dev, ctas if ws else launch.V0_RESIDENT)
            splits = max(1, round(base * m))

            def run(q, cache, out, s=splits, ws=ws, c=ctas):
                return launch.decode(q, cache, out=out, num_splits=s, warp_specialized=ws, ctas_per_sm=c)
            yield {"variant": variant, "num_splits": splits, "default": base}, (
                with_wide_eight(run) if variant == "v1w" else run)
    sweep(a, candidates, kv_heads=a.kv_heads)


if __name__ == "__main__":
    main()
