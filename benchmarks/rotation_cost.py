"""What a rotated (Hadamard) and a centred cache cost at decode, against the same codes without either:

    python benchmarks/rotation_cost.py --shapes 1:8K,64:8K --bits 2

Each row times ``foscar.decode`` (backend ``auto``) as ``foscar.bench.decode --cuda-graph`` does (a CUDA-graph
replay, the L2 flushed before each, median of ``--iters``) over views of one random cache: as it is,
rotated, centred (a key mean), and both; then lists the kernels one decode of the rotated, centred view
launches (torch.profiler), each with its median duration.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import Case, make_random_cache, parse_shapes
from fixed_cost import FLUSH_BYTES, kernel_rows, timed

import foscar
from foscar.bench import make_block_table
from foscar.bench.kernels import rotated_view


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1:8K,64:8K"))
    p.add_argument("--bits", type=int, nargs="+", default=[2])
    p.add_argument("--iters", type=int, default=9)
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print("| shape | plain µs | rotated µs | centred µs | rotated and centred µs |\n|---|---|---|---|---|")
    lists = []
    for (B, L) in a.shapes:
        for bits in a.bits:
            cache = make_random_cache(Case(B, L, bits), make_block_table(B, L // 64, "shuffled", 0).to(dev))
            q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
            out = torch.empty_like(q)
            times = []
            for rot, cen in ((False, False), (True, False), (False, True), (True, True)):
                c = rotated_view(cache, rot, cen)
                times.append(timed(lambda c=c: foscar.decode(q, c, out=out), flush, a.iters))
            print(f"| B {B}, L {L}, INT{bits} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
            c = rotated_view(cache)
            lists.append((f"B {B}, L {L}, INT{bits}", kernel_rows(lambda: foscar.decode(q, c, out=out), flush, a.iters)))
    for name, rows in lists:
        print(f"\n{name}, rotated and centred: " + "; ".join(f"`{k}` {d:.1f} µs" for k, d, _ in rows))


if __name__ == "__main__":
    main()
