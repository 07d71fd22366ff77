"""Launch-config sweep of the Triton folded decode on the present GPU: splits x warps x stages x tile x
prefetch depth x merge placement.

    python benchmarks/sweep_triton.py --shapes 8:128K 64:32K 1:128K --bits 2 4

Prints one line per (shape, bits, config) with the median time (CUDA-graph replays, L2 flushed, CUDA
events) and the fraction of the read ceiling, then the best config per shape. A working tool for
``docs/triton-perf.md``; the tuned configs of the product come from ``foscar tune``.
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
from foscar.triton import launch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, nargs="+", default=[parse_shapes("8:128K")])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
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
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ceiling-tbps", type=float, default=4.6)
    p.add_argument("--json", help="write the records here")
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    records = []
    for (B, L), bits in itertools.product([s for group in a.shapes for s in group], a.bits):
        case = Case(B, L, bits, a.k_axis, a.v_axis)
        bt = make_block_table(B, L // 64, "shuffled", 0).to(dev)
        cache = make_random_cache(case, bt)
        q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
        base = launch.default_num_splits(B, 8, L // 64, dev)
        best = None
        counts = a.num_splits or sorted({max(1, round(base * m)) for m in a.splits})
        for splits, warps, stages, bn, pf, fused in itertools.product(counts, a.warps, a.stages, a.block_n,
                                                                      a.prefetch, a.fused):
            cfg = {"num_splits": splits, "num_warps": warps, "num_stages": stages, "block_n": bn, "prefetch": pf,
                   "fused_combine": bool(fused)}
            try:
                fn = as_graph(lambda q=q, cache=cache, cfg=cfg: launch.decode(q, cache, **cfg))  # replays only
                t = time_fn(fn, iters=a.iters, warmup=3, flush=flush)["median_us"]
            except Exception as e:  # noqa: BLE001 -- a config that does not compile is reported, not fatal
                print(f"B={B} L={L} INT{bits} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            frac = bytes_read(B, L, bits) / (t * 1e-6) / (a.ceiling_tbps * 1e12)
            rec = dict(batch=B, seq_len=L, bits=bits, k_axis=a.k_axis, v_axis=a.v_axis, **cfg, us=t, frac=frac)
            records.append(rec)
            print(f"B={B:3d} L={L:7d} INT{bits} splits={splits:4d} warps={warps} stages={stages} bn={bn} "
                  f"prefetch={pf} fused={fused}: "
                  f"{t:9.1f} us  {100 * frac:5.1f}%", flush=True)
            if best is None or t < best["us"]:
                best = rec
        print(f"BEST {best}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
