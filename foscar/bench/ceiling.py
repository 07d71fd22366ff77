"""The streaming-read ceiling the decode benchmark's rates are a fraction of: a Triton kernel that reads a
buffer in 16-byte loads (its result checked), and ``torch.sum`` alongside; the faster is the ceiling."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .common import time_call
from .grid import GIB
from .measure import short_error

CHUNK, BLOCK = 2 ** 18, 4096  # int32 per program (1 MiB), per load


def read_kernel():
    """A Triton kernel that reads ``chunk`` int32 per program in 16-byte vectors and writes their XOR."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_xor(x_ptr, out_ptr, chunk, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        base = x_ptr + pid * chunk
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, chunk, BLOCK):
            acc ^= tl.load(base + start + offs)
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))

    return read_xor


def xor_reduce(t: torch.Tensor) -> int:
    """XOR of all elements of a 1-D integer tensor whose length is a power of two."""
    while t.numel() > 1:
        t = t[0::2] ^ t[1::2]
    return int(t[0])


def checked_reader(x: torch.Tensor, chunk: int, block: int, kernel: Callable[[], object] = read_kernel):
    """A call of the reader ``kernel()`` over ``x`` (int32, whole chunks of ``chunk``), one chunk a program in loads
    of ``block``; called once first and its first and last programs' XOR checked (a reader that skips its loads
    would time as a fast one)."""
    reader, programs = kernel(), x.numel() // chunk
    partial = torch.empty(programs, dtype=torch.int32, device=x.device)
    fn = lambda: reader[(programs,)](x, partial, chunk, BLOCK=block, num_warps=8)  # noqa: E731
    fn()
    for p in (0, programs - 1):
        want = xor_reduce(x[p * chunk: (p + 1) * chunk])
        if int(partial[p]) != want:
            raise RuntimeError(f"read kernel: program {p} gave {int(partial[p])}, expected {want}")
    return fn


def read_rates(x: torch.Tensor, *, iters: int, warmup: int, flush: torch.Tensor,
               kernel: Callable[[], object] = read_kernel) -> dict:
    """Streaming-read rates over ``x`` (int32, whole 1 MiB chunks): the reader ``kernel()`` makes, checked,
    and torch.sum; the median of ``max(iters, 10)`` calls each."""
    n = x.numel()
    res: dict = {"bytes": n * 4}
    iters = max(iters, 10)
    try:
        fn = checked_reader(x, CHUNK, BLOCK, kernel)
        t = time_call(fn, iters=iters, warmup=warmup, flush=flush)
        res["triton"] = {**t, "tbps": n * 4 / (t["median_us"] * 1e-6) / 1e12}
    except Exception as e:
        res["triton_error"] = short_error(e)
    t = time_call(lambda: torch.sum(x), iters=iters, warmup=warmup, flush=flush)
    res["torch_sum"] = {**t, "tbps": n * 4 / (t["median_us"] * 1e-6) / 1e12}
    best = max((k for k in ("triton", "torch_sum") if k in res), key=lambda k: res[k]["tbps"])
    res["tbps"], res["source"] = res[best]["tbps"], f"{best}, {n * 4 / GIB:.3g} GiB"
    return res


def measure_read_ceiling(gib: float, *, iters: int, warmup: int, flush: torch.Tensor, device,
                         kernel: Callable[[], object] = read_kernel) -> dict:
    """The read ceiling: the best streaming-read rate over ``gib`` GiB of random int32 on ``device``
    (freed after)."""
    n = int(gib * GIB) // 4 // CHUNK * CHUNK
    x = torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int32, device=device)
    res = read_rates(x, iters=iters, warmup=warmup, flush=flush, kernel=kernel)
    del x
    torch.cuda.empty_cache()
    return res
