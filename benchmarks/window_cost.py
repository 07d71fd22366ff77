"""What a cache's BF16 windows (a sink and a recent ring, the accuracy recipe's) cost at decode, against the same
codes without them, the windows attended by the CuTe combine (``foscar.cute.config.COMBINE_WINDOWS``) or by the
Triton window kernel, one launch each:

    python benchmarks/window_cost.py --shapes 1:8K,8:32K,64:8K --bits 2 4

Each row times ``foscar.decode`` (backend ``auto``) as ``foscar.bench.decode --cuda-graph`` does (a CUDA-graph
replay, the L2 flushed before each, median of ``--iters``) over views of one random cache: as it is; with a
4-token sink and a 64-token recent ring (``foscar.bench.kernels.windowed_view``) through the Triton window
kernel, through the combine launched after stage 1, and through the combine as it ships (a programmatic
dependent launch of stage 1 where v1 runs two CTAs an SM, ``COMBINE_PDL_WINDOWS``: the windows attended before
its wait for stage 1); the same rotated and centred (the recipe's cache). Then the kernels one decode of the
windowed, rotated and centred view launches (torch.profiler), with their durations.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fixed_cost import FLUSH_BYTES, decode_inputs, kernel_rows, shape_args, timed

import foscar
from foscar.bench.kernels import rotated_view, windowed_view
from foscar.cute import config

VARIANTS = (("plain", False, {}), ("windows, Triton", True, {"COMBINE_WINDOWS": False}),
            ("windows, combine after stage 1", True, {"COMBINE_PDL_WINDOWS": False}),
            ("windows, combine", True, {}), ("windows, combine, rotated and centred", "recipe", {}))


def main():
    a = shape_args(__doc__, "1:8K,8:32K,64:8K", [2, 4])
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print("| shape | " + " | ".join(f"{name} µs" for name, _, _ in VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    lists = []
    for (B, L) in a.shapes:
        for bits in a.bits:
            cache, q, out = decode_inputs(B, L, bits, dev)
            times = []
            for _, windows, switches in VARIANTS:
                c = cache if not windows else windowed_view(cache)
                if windows == "recipe":
                    c = rotated_view(c)
                saved = {k: getattr(config, k) for k in switches}
                for k, v in switches.items():
                    setattr(config, k, v)
                config.clear_switch_caches()  # the stage-1 configs read the switches
                try:
                    times.append(timed(lambda c=c: foscar.decode(q, c, out=out), flush, a.iters))
                finally:
                    for k, v in saved.items():
                        setattr(config, k, v)
                    config.clear_switch_caches()
            print(f"| B {B}, L {L}, INT{bits} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
            c = rotated_view(windowed_view(cache))
            rows = kernel_rows(lambda: foscar.decode(q, c, out=out), flush, a.iters)
            lists.append((f"B {B}, L {L}, INT{bits}", rows))
    for name, rows in lists:
        print(f"\n{name}, windowed, rotated and centred: " + "; ".join(f"`{k}` {d:.1f} µs" for k, d, _ in rows))


if __name__ == "__main__":
    main()
