"""Two decode calls on a random paged cache, for Nsight Compute to profile the second one:

    ncu --clock-control none -k regex:"fold_decode|combine" --launch-skip 2 --launch-count 2 \\
        --metrics gpu__time_duration.sum python3 benchmarks/profile_one_call.py 8 32768 4
    ncu --clock-control none -k regex:fold_decode --launch-skip 1 --launch-count 1 --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python3 benchmarks/profile_one_call.py 8 32768 4 num_splits=20

Arguments: batch, length, bits, then optional integer launch arguments of foscar.triton.decode as
name=value.
"""
import sys

import torch
from bench_decode import Case, make_block_table, make_random_cache

from foscar.triton import launch

B, L, bits = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
extra = {k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
dev = torch.device("cuda")
cache = make_random_cache(Case(B, L, bits), make_block_table(B, L // 64, "shuffled", 0).to(dev))
q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
for _ in range(2):
    launch.decode(q, cache, **extra)
torch.cuda.synchronize()
