"""The CuTe kernel's arithmetic error on the stress input against the split count: the relative L2 error
of one decode against exact (float64) attention over the dequantized cache, for each ``--splits`` value,
next to BF16 attention's on the same cache: how the error depends on a split's length (the tiles each
consumer chains between two folds of the offset corrections).

    python3 benchmarks/split_error.py --length 16384 --splits 1 2 4 8 16 32 64 [--k-operand bf16]
"""
from __future__ import annotations

import argparse

import torch

from foscar.bench.accuracy import PAPER_CONFIGS, attention
from foscar.bench.common import rel_l2
from foscar.cache_io import quantize_kv
from foscar.cute.launch import decode as cute_decode
from foscar.reference import decode_exact
from foscar.synthetic import stress_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--k-operand", default="bf16")
    p.add_argument("--tiles-per-pass", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--v0", action="store_true", help="the v0 kernel (no warp specialization)")
    a = p.parse_args()
    q, k, v = stress_inputs(1, 32, 8, a.length, 128, seed=a.seed, dtype=torch.bfloat16, device="cuda")
    print("| config | L | splits | error vs dequantized | BF16 attention |")
    print("|---|---|---|---|---|")
    for c in PAPER_CONFIGS[:2]:
        cache = quantize_kv(k, v, c.fmt(128, 128), quantizer=c.quantizer)
        oracle = decode_exact(q, cache)
        kd, vd = cache.dequantize(torch.float64)
        ref = rel_l2(attention(q, kd, vd, bf16=True), oracle)
        for n in a.splits:
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
            cute_decode(q, cache, out=out, num_splits=n, warp_specialized=not a.v0, k_operand=a.k_operand,
                        tiles_per_pass=a.tiles_per_pass)
            print(f"| {c.name} | {a.length} | {n} | {rel_l2(out, oracle):.3g} | {ref:.3g} |", flush=True)


if __name__ == "__main__":
    main()
