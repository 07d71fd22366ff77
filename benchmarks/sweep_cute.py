"""Split-count sweep of the CuTe DSL Hopper kernels (v0, and v1 = warp-specialized) on the present GPU.

    python benchmarks/sweep_cute.py --shapes 8:8K 8:32K --bits 2 4 --splits 0.5 1 2 4

One line per (shape, bits, variant, splits): median time (CUDA-graph replays, L2 flushed, CUDA events)
and the fraction of the read ceiling; then the best per shape. A working tool for the CuTe kernels'
split heuristic and tuned configs; the product's tuned configs come from ``foscar tune``.
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import Case, bytes_read, make_random_cache, parse_shapes

from foscar.bench import as_graph, make_block_table
from foscar.bench import time_call as time_fn
from foscar.cute import launch
from foscar.cute.launch import decode


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, nargs="+", default=[parse_shapes("8:8K")])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--splits", type=float, nargs="+", default=[0.5, 1, 2, 4], help="multiples of the default")
    p.add_argument("--variants", nargs="+", default=["v0", "v1"], help="v0, v1 (one CTA per SM), v1x2 (two)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ceiling-tbps", type=float, default=4.6)
    p.add_argument("--json", help="write the records here")
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    records = []
    for (B, L), bits in itertools.product([s for group in a.shapes for s in group], a.bits):
        case = Case(B, L, bits, "token", "token")
        cache = make_random_cache(case, make_block_table(B, L // 64, "shuffled", 0).to(dev))
        q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
        best = None
        for variant, m in itertools.product(a.variants, a.splits):
            base = launch.default_num_splits(B, 8, L // 64, dev, {"v0": 4, "v1": 1, "v1x2": 2}[variant])
            splits = max(1, round(base * m))
            fn = as_graph(lambda q=q, cache=cache, s=splits, ws=variant != "v0", c=2 if variant == "v1x2" else 1:
                          decode(q, cache, num_splits=s, warp_specialized=ws, ctas_per_sm=c))
            t = time_fn(fn, iters=a.iters, warmup=3, flush=flush)["median_us"]
            frac = bytes_read(B, L, bits) / (t * 1e-6) / (a.ceiling_tbps * 1e12)
            rec = dict(batch=B, seq_len=L, bits=bits, variant=variant, num_splits=splits, default=base, us=t,
                       frac=frac)
            records.append(rec)
            print(f"B={B:3d} L={L:7d} INT{bits} {variant} splits={splits:4d} (default {base}): {t:9.1f} us "
                  f"{100 * frac:5.1f}%", flush=True)
            if best is None or t < best["us"]:
                best = rec
        print(f"BEST {best}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
