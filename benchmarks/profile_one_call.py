"""Two decode calls on a random paged cache, for Nsight Compute to profile the second one:

    ncu --clock-control none -k regex:"fold_decode|combine" --launch-skip 2 --launch-count 2 \\
        --metrics gpu__time_duration.sum python3 benchmarks/profile_one_call.py 8 32768 4
    ncu --clock-control none -k regex:fold_decode --launch-skip 1 --launch-count 1 --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python3 benchmarks/profile_one_call.py 8 32768 4 num_splits=20
    ncu --clock-control none -k regex:kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section InstructionStats python3 benchmarks/profile_one_call.py 64 131072 2 backend=cute

Arguments: batch, length, bits, then optional name=value arguments: ``k_axis=channel`` and
``v_axis=channel`` pick the cache's group axes, ``kv_heads=N`` its KV heads (8; the query heads stay 32);
``backend=cute`` runs ``foscar.decode(..., backend="cute")`` (and ``num_splits``; with any other argument,
the backend's launch with that config, as ``foscar.bench.kernels`` runs it: ``k_operand=bf16
warp_specialized=True tiles_per_pass=1``); without it the Triton kernel runs through ``foscar.triton.decode``,
which takes any of its integer launch arguments. ``q_len=N`` (N > 1): a step of N query tokens a sequence,
``q [B, N, Hq, D]`` through ``foscar.decode`` (no launch config then).
"""
import sys

import torch
from bench_decode import Case, make_block_table, make_random_cache

import foscar
from foscar.triton import launch

B, L, bits = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def value(text: str):
    """An argument's value: an integer, ``True``/``False``, else the text."""
    return int(text) if text.lstrip("-").isdigit() else {"True": True, "False": False}.get(text, text)


extra = {k: value(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
backend = extra.pop("backend", "triton")
q_len = extra.pop("q_len", 1)
axes = {"k_axis": extra.pop("k_axis", "token"), "v_axis": extra.pop("v_axis", "token"),
        "kv_heads": extra.pop("kv_heads", 8)}
if q_len > 1 and extra:  # the cache's axes and heads taken: what is left is a launch config
    sys.exit("profile_one_call.py: q_len takes no launch config (a step goes through foscar.decode)")
if q_len > 1:
    call = lambda q, cache, **kw: foscar.decode(q, cache, backend=backend, **kw)  # noqa: E731
elif backend == "triton":
    call = launch.decode
elif extra:  # a launch config: the backend's variant options (as foscar.bench.kernels' BackendKernel passes)
    from foscar import backends
    call = lambda q, cache, **kw: backends.get(backend).launch(q, cache, dict(kw))  # noqa: E731
else:
    call = lambda q, cache, **kw: foscar.decode(q, cache, backend=backend, **kw)  # noqa: E731
dev = torch.device("cuda")
cache = make_random_cache(Case(B, L, bits, **axes), make_block_table(B, L // 64, "shuffled", 0).to(dev))
q = torch.randn(B, *((q_len,) if q_len > 1 else ()), 32, 128, dtype=torch.bfloat16, device=dev)
for _ in range(2):
    call(q, cache, **extra)
torch.cuda.synchronize()
