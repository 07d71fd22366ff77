"""The decode benchmark's timing and recording: :func:`run` times every kernel of the table
(:mod:`foscar.bench.kernels`) on every shape of the grid through the one driver,
:func:`foscar.bench.measure.measure`, and writes the records after each shape.

A run's state is passed explicitly: the parsed arguments (their ``heads`` and ``head_dim`` included) and a
:class:`Target`, where everything lives and how the L2 is flushed.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache_io import quantize_kv
from ..format import KVFormat
from ..progress import Progress
from ..reference import attend, decode_exact
from ..synthetic import stress_inputs
from .ceiling import measure_read_ceiling, read_kernel
from .common import cache_to, l2_flush_mode, make_block_table, rel_l2
from .grid import (FLUSH_BYTES, HEAD_DIM, MIB, PAGE, Case, build_grid, fmt_len, group_by_shape, group_for,
                   plan_shapes, sm_scale)
from .inputs import QuantInputs, bf16_slice_reference, make_bf16_inputs, make_random_cache, quant_slice_reference
from .kernels import KERNELS, KernelMissing, flashinfer_version
from .measure import NotHeld, SliceCheck, measure, short_error
from .report import failures, render_markdown, time_cell, write_outputs

CHECK_LENS = (4096, 2500, 777)  # --check: ragged, not page multiples
CHECK_FACTOR = 1.5  # --check: foscar error <= this x BF16 attention's


@dataclass(frozen=True)
class Target:
    """Where a run's work lives: ``device`` (every timed tensor), ``flush_bytes`` (the buffer zeroed to flush
    the L2 before each timed call) and ``read_kernel`` (makes the read-ceiling kernel)."""

    device: str = "cuda"
    flush_bytes: int = FLUSH_BYTES
    read_kernel: Callable[[], object] = read_kernel


@dataclass
class Session:
    """One run: its arguments, its target and the L2 flush buffer every timed call shares."""

    args: argparse.Namespace
    target: Target
    flush: torch.Tensor


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cuda_alive(device) -> bool:
    """False when an earlier error left the CUDA context unusable (illegal address and the like)."""
    try:
        torch.cuda.synchronize()
        return int(torch.ones(1, device=device).sum()) == 1
    except Exception:
        return False


def new_record(shape, bits, axes, kernel, heads: tuple[int, int], head_dim: int = HEAD_DIM) -> dict:
    return {"B": shape[0], "L": shape[1], "Hq": heads[0], "Hkv": heads[1], "D": head_dim, "bits": bits,
            "k_axis": axes[0], "v_axis": axes[1], "kernel": kernel, "status": "not run"}


def time_kernel(name: str, inputs, check: SliceCheck, session: Session) -> dict:
    """Build kernel ``name`` on ``inputs`` and :func:`measure` it: the record's fields."""
    kernel, args = KERNELS[name], session.args
    try:
        runner = kernel.build(inputs, args)
    except KernelMissing as e:
        return {"status": f"missing: {e}"}
    except Exception as e:
        return {"status": f"error: building: {short_error(e)}"}
    return measure(runner.fn, NotHeld(runner.judged) if runner.judged is not None else check,
                   output=runner.output, unavailable=kernel.unavailable, iters=args.iters, warmup=args.warmup,
                   flush=session.flush, cuda_graph=args.cuda_graph, host_sync=True, kernel_time=args.kernel_time)


def stage_inputs(case: Case | None, q: torch.Tensor, block_table: torch.Tensor, args):
    """(inputs, slice check) of one stage: the BF16 kernels (case None) or one quantized case."""
    if case is None:
        inputs = make_bf16_inputs(q, block_table, block_table.shape[1] * PAGE, args.heads[1])
        return inputs, SliceCheck(bf16_slice_reference(inputs), args.shape_factor)
    inputs = QuantInputs(q, make_random_cache(case, block_table))
    return inputs, SliceCheck(quant_slice_reference(inputs), args.shape_factor)


def run_shape(shape, cases, session: Session, block_table, records: list[dict]) -> None:
    """All kernels of one shape, appended to ``records``: the BF16 stage, then each quantized case.

    Each stage's data is freed before the next. Raises (after recording) when the CUDA context is lost.
    """
    args, device = session.args, session.target.device
    kernels = args.kernels
    q = torch.randn(shape[0], args.heads[0], args.head_dim, dtype=torch.bfloat16, device=device)
    stages = [(None, [k for k in kernels if KERNELS[k].family == "bf16"])]
    stages += [(c, [k for k in kernels if KERNELS[k].family == "quant"]) for c in cases]
    for case, names in stages:
        if not names:
            continue
        bits, axes = (16, (None, None)) if case is None else (case.bits, (case.k_axis, case.v_axis))
        try:
            inputs, check = stage_inputs(case, q, block_table, args)
        except Exception as e:
            inputs = check = None
            failed = f"error: building inputs: {short_error(e)}"
        else:
            failed = None
        for name in names:
            rec = new_record(shape, bits, axes, name, args.heads, args.head_dim)
            rec.update({"status": failed} if failed else time_kernel(name, inputs, check, session))
            rec["timing"] = "cuda-graph" if args.cuda_graph else "eager"
            records.append(rec)
            if rec["status"].startswith("error") and not cuda_alive(device):
                raise RuntimeError(f"CUDA context lost after {name} at B={shape[0]} L={shape[1]}: {rec['status']}")
        del inputs, check
        torch.cuda.empty_cache()


def run_exact_check(bits: int, axes: tuple[str, str], kernels: list[str], args, device) -> list[dict]:
    """--check: foscar kernels vs decode_exact (float64, CPU) on a small ragged quantize_kv cache."""
    hq, hkv = args.heads
    gqa, D = hq // hkv, args.head_dim
    fmt = KVFormat(bits, D, group_for(D), *axes)
    lens = torch.tensor(CHECK_LENS, dtype=torch.int32)
    q, k, v = stress_inputs(len(CHECK_LENS), hq, hkv, max(CHECK_LENS), D, seed=args.seed + bits)
    q = q.to(torch.bfloat16)
    cache = quantize_kv(k, v, fmt, seq_lens=lens, page_size=PAGE)
    exact = decode_exact(q, cache)
    kd, vd = cache.dequantize(torch.float64)
    bf16 = torch.stack([attend(q[b].float().reshape(hkv, gqa, D), kd[b, :, :n], vd[b, :, :n],
                               sm_scale(D), operand_dtype=torch.bfloat16)[0].reshape(hq, D)
                        for b, n in enumerate(CHECK_LENS)])
    bf16_err = rel_l2(bf16, exact)
    inputs = QuantInputs(q.to(device), cache_to(cache, device))
    results = []
    for name in kernels:
        rec = {"bits": bits, "k_axis": axes[0], "v_axis": axes[1], "kernel": name, "lens": list(CHECK_LENS),
               "bf16_err": bf16_err}
        try:
            runner = KERNELS[name].build(inputs, args)
            returned = runner.fn()
            torch.cuda.synchronize()
            out = runner.output(returned).double().cpu()
        except KernelMissing as e:
            results.append({**rec, "status": f"missing: {e}"})
            continue
        except Exception as e:
            status = f"missing: {short_error(e)}" if KERNELS[name].unavailable(e) else f"FAIL: {short_error(e)}"
            results.append({**rec, "status": status})
            continue
        nonfinite = int((~torch.isfinite(out)).sum())
        err = rel_l2(out, exact)
        ratio = err / bf16_err
        ok = nonfinite == 0 and ratio <= CHECK_FACTOR
        why = f"{nonfinite} non-finite outputs" if nonfinite else f"error {ratio:.2f}x BF16 attention's"
        results.append({**rec, "err": err, "ratio": ratio, "nonfinite": nonfinite,
                        "status": "pass" if ok else f"FAIL: {why}"})
    return results


def device_meta(args, argv: list[str], prog: str, flush_bytes: int = FLUSH_BYTES) -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    hq, hkv = args.heads
    return {"gpu": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
            "memory_gb": props.total_memory / 1e9, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "triton": triton.__version__, "flashinfer": flashinfer_version(),
            "command": f"{prog} {shlex.join(argv)}".strip(), "argv": argv, "args": vars(args),
            "timing": ("CUDA-graph replay" if args.cuda_graph else "eager calls")
            + f", L2 flushed ({flush_bytes // MIB} MiB {'written' if l2_flush_mode() == 'write' else 'read'}), "
            f"median of {args.iters} after {args.warmup} warm-up",
            "page_order": args.page_order,
            "problem": {"Hq": hq, "Hkv": hkv, "D": args.head_dim, "g": group_for(args.head_dim), "page": PAGE},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run(args: argparse.Namespace, argv: list[str], prog: str, target: Target) -> int:
    """The whole benchmark on ``target``: --check, the read ceiling, then every shape; the exit status."""
    cases = build_grid(args.grid, args.bits, args.shapes, args.heads, args.head_dim)
    result = {"meta": device_meta(args, argv, prog, target.flush_bytes), "ceiling": None, "checks": [], "records": [],
              "skipped": [], "fatal": []}
    log(f"bench_decode: {result['meta']['gpu']}, torch {torch.__version__}, flashinfer {result['meta']['flashinfer']}")
    quant = [k for k in args.kernels if KERNELS[k].family == "quant"]
    if args.check and quant:
        for bits, axes in dict.fromkeys((c.bits, (c.k_axis, c.v_axis)) for c in cases):
            result["checks"] += run_exact_check(bits, axes, quant, args, target.device)
            log(f"check INT{bits} {axes}: "
                + ", ".join(f"{c['kernel']} {c['status']}" for c in result["checks"][-len(quant):]))
        if any(c["status"].startswith("FAIL") for c in result["checks"]):
            write_outputs(result, args.out)
            print(render_markdown(result))
            log("bench_decode: --check failed; not timing. " + "; ".join(failures(result)))
            return 1
    session = Session(args, target, torch.empty(target.flush_bytes, dtype=torch.uint8, device=target.device))
    result["ceiling"] = measure_read_ceiling(args.ceiling_gib, iters=args.iters, warmup=args.warmup,
                                             flush=session.flush, device=target.device, kernel=target.read_kernel)
    log(f"read ceiling {result['ceiling']['tbps']:.2f} TB/s ({result['ceiling']['source']})")
    budget = args.max_gb * 1e9 if args.max_gb is not None else torch.cuda.mem_get_info()[0] - 4e9
    groups = group_by_shape(cases)
    shapes, result["skipped"] = plan_shapes(list(groups), args.bits, budget, contiguous_copy="fa4" in args.kernels,
                                            kv_heads=args.heads[1], flush_bytes=target.flush_bytes,
                                            head_dim=args.head_dim)
    for s in result["skipped"]:
        log(f"skipping B={s['B']} L={s['L']}: {s['reason']}")
    bar = Progress(len(shapes))
    for i, shape in enumerate(shapes):
        t0, first = time.time(), len(result["records"])
        log(f"[{i + 1}/{len(shapes)}] B={shape[0]} L={fmt_len(shape[1])}: building and timing")
        torch.manual_seed(args.seed + i)
        table = make_block_table(shape[0], shape[1] // PAGE, args.page_order, args.seed + i).to(target.device)
        try:
            run_shape(shape, groups[shape], session, table, result["records"])
        except Exception as e:
            result["fatal"].append(short_error(e))
            result["skipped"] += [{"B": b, "L": n, "reason": "not run: the run ended (FATAL above)"}
                                  for b, n in shapes[i + 1:]]
            log(f"bench_decode: FATAL: {short_error(e)}")
            break
        finally:
            write_outputs(result, args.out)
        done = ", ".join(f"{r['kernel']}{'' if r['bits'] == 16 else ' INT%d' % r['bits']} {time_cell(r)}"
                         for r in result["records"][first:])
        log(f"[{i + 1}/{len(shapes)}] B={shape[0]} L={fmt_len(shape[1])} done in {time.time() - t0:.0f} s: {done}")
        bar.step(f"B={shape[0]} L={fmt_len(shape[1])}")
    write_outputs(result, args.out)
    log(f"wrote {args.out / 'bench_decode.md'} and {args.out / 'bench_decode.json'}")
    print(render_markdown(result))
    bad = result["failures"]
    if bad:
        log("bench_decode: FAILED: " + "; ".join(bad))
    return 1 if bad else 0
