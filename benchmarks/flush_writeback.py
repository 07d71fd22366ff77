"""What the benchmark's L2 flush costs the call it precedes: one ``torch.sum`` over N MB, timed after each way of
clearing the L2.

    python benchmarks/flush_writeback.py [--mb 5.2 37.7 151 302 604 2416] [--iters 30]

The benchmarks (``foscar.bench.decode``) flush the L2 by writing 512 MiB (``flush.zero_()``): the L2 then holds
dirty lines of the flush buffer, which the timed call's reads evict, writing them back to DRAM inside its own time.
Columns: ``zero_`` (that flush), ``zero_+read`` (the same, then a read of another 512 MiB, which takes the
write-back before the timed region), ``read`` (only that read: the L2 left clean, holding other data) and
``none``. Each a median of ``--iters`` calls (``foscar.bench.common.time_call``: CUDA events around the call alone),
after 5 warm-ups.
"""
import argparse

import torch

from foscar.bench.common import time_call


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[5.2, 37.7, 151, 302, 604, 2416])
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    other = torch.ones(512 << 20, dtype=torch.uint8, device=dev)
    ways = {"zero_": flush.zero_, "zero_+read": lambda: (flush.zero_(), other.sum(dtype=torch.int32)),
            "read": lambda: other.sum(dtype=torch.int32), "none": lambda: None}
    print("| MB read | " + " | ".join(f"after {w} µs (TB/s)" for w in ways) + " |")
    print("|---" * (1 + len(ways)) + "|")
    for mb in a.mb:
        x = torch.ones(int(mb * 1e6) // 4, dtype=torch.float32, device=dev)
        times = [time_call(lambda: torch.sum(x), iters=a.iters, warmup=5, before=before)["median_us"]
                 for before in ways.values()]
        print(f"| {mb} | " + " | ".join(f"{t:.1f} ({mb / t:.2f})" for t in times) + " |", flush=True)
        del x


if __name__ == "__main__":
    main()
