"""What a rotated (Hadamard) and a centred cache cost at decode, against the same codes without either:

    python benchmarks/rotation_cost.py --shapes 1:8K,64:8K --bits 2

Each row times ``foscar.decode`` (backend ``auto``) as ``foscar.bench.decode --cuda-graph`` does (a CUDA-graph
replay, the L2 flushed before each, median of ``--iters``) over views of one random cache: as it is,
rotated, centred (a key mean), and both; then lists the kernels one decode of the rotated, centred view
launches (torch.profiler), each with its median duration.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fixed_cost import FLUSH_BYTES, decode_inputs, kernel_rows, shape_args, timed

import foscar
from foscar.bench.kernels import rotated_view


def main():
    a = shape_args(__doc__, "1:8K,64:8K", [2])
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print("| shape | plain µs | rotated µs | centred µs | rotated and centred µs |\n|---|---|---|---|---|")
    lists = []
    for (B, L) in a.shapes:
        for bits in a.bits:
            cache, q, out = decode_inputs(B, L, bits, dev)
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
