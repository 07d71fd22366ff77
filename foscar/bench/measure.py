"""The one driver every timing tool runs a candidate through: :func:`measure` calls it once, checks its
output against the float64 reference, and only then times it. ``foscar bench speed``
(:mod:`foscar.bench.speed`), ``foscar tune`` (:mod:`foscar.tune`) and the launch sweeps
(``benchmarks/sweep_common.py``) all call it; a candidate that fails the check is reported and never timed.

The check (:class:`SliceCheck`): every output value finite (the caller hands the candidate an output
buffer poisoned with NaN, so an unwritten output shows), and the output of one (sequence, KV head)
slice, the last of each, within :data:`SLICE_FACTOR` times BF16 attention's error against float64
attention on the same dequantized values (:class:`foscar.bench.inputs.SliceRef`). Loose: it catches
indexing, layout and drift bugs (errors of order 1), not rounding.

The timing: the L2 flushed before each call, CUDA events around the call alone, the median of
``iters`` calls after ``warmup`` (:func:`foscar.bench.common.time_call`), of eager calls or of a CUDA
graph's replays (:func:`foscar.bench.common.as_graph`).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .common import as_graph, flush_l2, rel_l2, time_call
from .inputs import QuantInputs, SliceRef, quant_slice_reference

SLICE_FACTOR = 3.0  # a candidate's slice error may be at most this times BF16 attention's
SLEEP_CYCLES = 100_000_000  # ~50-70 ms of GPU sleep at 1.4-2 GHz (host-sync detector)
SYNC_THRESHOLD_S = 0.02


def short_error(e: BaseException) -> str:
    """``Type: message``, its first line, at most 300 characters: an exception as a record's status."""
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def check_output(out: torch.Tensor, ref: SliceRef, factor: float) -> dict:
    """All of ``out [B, Hq, D]`` (a step's ``[B, q_len, Hq, D]``) finite (it was NaN-poisoned), and its slice within
    ``factor`` x BF16's error."""
    nonfinite = int((~torch.isfinite(out)).sum())
    err = rel_l2(out[ref.b, ..., ref.h * ref.gqa: (ref.h + 1) * ref.gqa, :], ref.exact)
    ratio = err / ref.bf16_err if ref.bf16_err > 0 else math.inf
    why = []
    if nonfinite:
        why.append(f"{nonfinite} non-finite outputs (unwritten or NaN)")
    if not ratio <= factor:
        why.append(f"slice error {err:.2e} is {ratio:.1f}x BF16 attention's {ref.bf16_err:.2e} (limit {factor}x)")
    return {"nonfinite": nonfinite, "err": err, "bf16_err": ref.bf16_err, "err_ratio": ratio,
            "status": "ok" if not why else "wrong: " + "; ".join(why)}


@dataclass(frozen=True)
class SliceCheck:
    """The check of :func:`check_output`: a callable from the candidate's output ``[B, Hq, D]`` to the
    record's fields, whose ``status`` is ``"ok"`` or ``"wrong: <why>"``."""

    ref: SliceRef
    factor: float = SLICE_FACTOR

    def __call__(self, out: torch.Tensor) -> dict:
        return check_output(out, self.ref, self.factor)


@dataclass(frozen=True)
class NotHeld:
    """For a peer whose output is not held to BF16 attention's error (lossy KV, random codes): timed, with
    ``why`` as the record's note and its non-finite outputs counted."""

    why: str

    def __call__(self, out: torch.Tensor) -> dict:
        return {"status": "ok", "note": self.why, "nonfinite": int((~torch.isfinite(out)).sum())}


def slice_check(q: torch.Tensor, cache, factor: float = SLICE_FACTOR) -> SliceCheck:
    """The check of decodes of ``q`` over the packed ``cache``."""
    return SliceCheck(quant_slice_reference(QuantInputs(q, cache)), factor)


def time_run(run: Callable[[], object], *, iters: int, warmup: int, flush: torch.Tensor,
             cuda_graph: bool = False) -> dict:
    """:func:`~foscar.bench.common.time_call` of ``run``, or of its CUDA-graph replay."""
    return time_call(as_graph(run) if cuda_graph else run, iters=iters, warmup=warmup, flush=flush)


def measure(run: Callable[[], object], check: Callable[[torch.Tensor], dict], *, iters: int, warmup: int,
            flush: torch.Tensor, cuda_graph: bool = False, output: Callable[[object], torch.Tensor] | None = None,
            unavailable: Callable[[BaseException], bool] | None = None, host_sync: bool = False,
            kernel_time: bool = False, timer: Callable[..., dict] = time_run) -> dict:
    """Call ``run`` once, check its output, then time it. Returns the record's fields, ``status`` first of all:

    1. one call, synchronized (``first_call_s``: it compiles on a configuration's first call). An exception
       is ``"missing: ..."`` where ``unavailable(e)`` says it means the candidate cannot run here, else
       ``"error: first call: ..."``;
    2. ``check(output(returned))`` (``output``: the candidate's output from what ``run`` returned; default
       that value itself), e.g. a :class:`SliceCheck`. Any status but ``"ok"`` is returned as it is: the
       candidate is never timed;
    3. with ``host_sync``, whether ``run`` waits for the GPU inside (:func:`syncs_with_host`);
    4. ``timer(run, iters=, warmup=, flush=, cuda_graph=)`` (default :func:`time_run`): ``median_us``,
       ``min_us``, ``all_us``; an exception is ``"error: timing: ..."``;
    5. with ``kernel_time``, the profiled GPU kernel time (:func:`kernel_time_fn`; its failure is noted
       as ``kernel_time_error``).
    """
    try:
        t0 = time.perf_counter()
        returned = run()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
    except Exception as e:
        missing = unavailable is not None and unavailable(e)
        return {"status": f"missing: {short_error(e)}" if missing else f"error: first call: {short_error(e)}"}
    try:
        fields = check(returned if output is None else output(returned))
    except Exception as e:  # an output the check cannot read (a wrong shape, not a tensor) is wrong
        fields = {"status": f"wrong: the check failed: {short_error(e)}"}
    fields["first_call_s"] = first_call_s
    if fields["status"] != "ok":
        return fields
    try:
        if host_sync:
            fields["host_sync"] = syncs_with_host(run)
        fields.update(timer(run, iters=iters, warmup=warmup, flush=flush, cuda_graph=cuda_graph))
    except Exception as e:
        fields["status"] = f"error: timing: {short_error(e)}"
        return fields
    if kernel_time:
        try:
            fields.update(kernel_time_fn(run, iters=iters, flush=flush))
        except Exception as e:
            fields["kernel_time_error"] = short_error(e)
    return fields


def kernel_time_fn(fn: Callable[[], object], *, iters: int, flush: torch.Tensor) -> dict:
    """GPU time of the kernels one call launches, summed (CUPTI through torch.profiler), L2 flushed before each.

    Unlike the event time it leaves out host gaps inside the call (a decode that synchronizes with the
    host). One profiler session per call, the flush outside it, so every kernel seen is the call's.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sums, spans, count = [], [], 0
    for _ in range(iters):
        flush_l2(flush)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events()  # GPU kernels, memcpys and memsets; not ranges that span them
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        if not kernels:
            raise RuntimeError("the profiler saw no GPU kernel in the call")
        sums.append(sum(e.time_range.elapsed_us() for e in kernels))
        spans.append(max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels))
        count = len(kernels)
    return {"kernel_us": statistics.median(sums), "kernel_all_us": sums, "kernel_span_us": statistics.median(spans),
            "kernels_per_call": count}


def syncs_with_host(fn: Callable[[], object]) -> bool | None:
    """Does ``fn`` wait for the GPU? Called behind ~50 ms of GPU sleep, an asynchronous call returns at once.

    A call that synchronizes (e.g. validates inputs with ``.item()``) starts its kernel only after the
    L2 flush ends, so its eager time includes a launch gap: reported, and ``--cuda-graph`` avoids it.
    """
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    torch.cuda.synchronize()
    sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    fn()
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    return waited > SYNC_THRESHOLD_S
