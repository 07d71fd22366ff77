"""Launch-config sweep of the Triton folded decode on the present GPU: splits x warps x stages x tile x
prefetch depth x merge placement.

    python benchmarks/sweep_triton.py --shapes 8:128K 64:32K 1:128K --bits 2 4

Every config's output is first checked against the float64 slice reference (a wrong one is printed and
not timed). Prints one line per (shape, bits, config) with the median time (CUDA-graph replays, L2
flushed, CUDA events) and the fraction of the read ceiling, then the best config per shape. A working
tool for ``docs/triton-perf.md``; the tuned configs of the product come from ``foscar tune``.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sweep_common import add_common_args, sweep

from foscar.triton import launch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "8:128K")
    p.add_argument("--k-axis", default="token")
    p.add_argument("--v-axis", default="token")
    p.add_argument("--splits", type=float, nargs="+", default=[1, 2, 4, 8],
                   help="multiples of the default split count")
    p.add_argument("--num-splits", type=int, nargs="+", default=None, help="absolute split counts (replace --splits)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--block-n", type=int, nargs="+", default=[64])
    p.add_argument("--prefetch", type=int, nargs="+", default=[1], help="KV tiles in flight (1, 2)")
    p.add_argument("--fused", type=int, nargs="+", default=[1], help="split merge in stage 1's epilogue (1) or not (0)")
    p.add_argument("--lazy", type=int, nargs="+", default=[0], help="the lazy rescale (1) or not (0)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of Hq 32 (GQA 32 / kv_heads)")
    a = p.parse_args()

    def candidates(B, L, dev):
        base = launch.default_num_splits(B, a.kv_heads, L // 64, dev)
        counts = a.num_splits or sorted({max(1, round(base * m)) for m in a.splits})
        for splits, warps, stages, bn, pf, fused, lazy in itertools.product(counts, a.warps, a.stages, a.block_n,
                                                                            a.prefetch, a.fused, a.lazy):
            cfg = {"num_splits": splits, "num_warps": warps, "num_stages": stages, "block_n": bn, "prefetch": pf,
                   "fused_combine": bool(fused), "lazy_rescale": bool(lazy)}
            yield cfg, lambda q, cache, out, cfg=cfg: launch.decode(q, cache, out=out, **cfg)
    sweep(a, candidates, a.k_axis, a.v_axis, a.kv_heads)


if __name__ == "__main__":
    main()
