"""Decode benchmark: foscar Triton kernels against FlashInfer BF16 and cuDNN SDPA, in one run.

Times, per shape (Hq=32, Hkv=8, D=128, g=128, page 64), with the L2 flushed (512 MiB written) before
each call and CUDA events around the call alone (median of ``--iters`` after ``--warmup``):

- ``foscar_folded``       foscar.triton.decode(q, cache, out=out)                       (quantized cache)
- ``foscar_reconstruct``  foscar.triton.decode(q, cache, out=out, kernel="reconstruct") (quantized cache)
- ``foscar_bf16``         foscar.triton.decode_bf16(q, k, v, block_table, seq_lens, out=out) (k, v: HND views)
- ``flashinfer_tc``       FlashInfer BatchDecodeWithPagedKVCacheWrapper, NHD, use_tensor_cores=True (baseline)
- ``flashinfer``          the same, use_tensor_cores=False
- ``cudnn_sdpa``          torch SDPA under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
- ``flashinfer_fp8``      FlashInfer FP8 (e4m3) KV, tensor cores (a low-bit peer; opt-in with --kernels)
- ``flashinfer_nvfp4``    FlashInfer NVFP4 KV, fa2 backend: INT4's bytes (a low-bit peer; opt-in, timing only)
- ``foscar_cute``         the CuTe DSL sm_90a kernel v0 (opt-in; its tuned split count where one is tuned for v0)
- ``foscar_cute_ws``      its v1: TMA producer and two consumer warpgroups (opt-in; likewise)
- ``foscar_auto``         foscar.decode(q, cache, out=out): the backend, variant and launch the library picks
                          (``backend="auto"``, the autotune cache; opt-in)
- ``fa4``                 FlashAttention-4 (flash_attn.cute) over an unpaged copy of the BF16 cache (opt-in;
                          needs cutlass-dsl, flash-attn-4 and quack: with the cutlass-dsl bundle they
                          exceed one command's carry next to FlashInfer, so they run in a command of
                          their own, with foscar_folded and cudnn_sdpa to tie the runs together)

and the streaming-read ceiling (a Triton kernel that reads ``--ceiling-gib`` GiB in 16-byte loads;
``torch.sum`` alongside). Every kernel's output is poisoned with NaN before its first call and
checked against a float64 reference on one (sequence, KV head) slice of the timed shape; ``--check``
first holds the foscar kernels to ``foscar.decode_exact`` on small ragged caches (error at most 1.5x
that of BF16 attention on the same dequantized cache). A kernel that is not there is reported as
``missing: <reason>``, never dropped; a wrong output, a failed check or a kernel error exits 1.
A call that waits for the GPU inside (host sync) is noted: its event time then includes a launch gap;
``--kernel-time`` adds each call's profiled GPU kernel time, which leaves such gaps out.

Outputs: a compact Markdown table on stdout (printed last), ``<out>/bench_decode.md`` (with a
per-kernel table) and ``<out>/bench_decode.json`` (rewritten after every shape).

On the CPU machine (once), fetch the baseline wheels into the git-ignored ``.gpu/`` and put the two
the baselines need, FlashInfer and apache-tvm-ffi, in a folder of their own (flash-attn-4 and quack
are for FA4 only; torch-c-dlpack-ext is optional for tvm-ffi). With this checkout that is about
62.6 MiB, under the 64 MiB one device command carries::

    bash ../shared/device/fetch-baseline-wheels.sh .gpu/wheels
    mkdir -p .gpu/fi && ln -f .gpu/wheels/flashinfer_python-*.whl .gpu/wheels/apache_tvm_ffi-*.whl .gpu/fi/

On the GPU machine, one command, sending ``.gpu/fi`` along (carry)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile .gpu/fi/*.whl && \\
    FLASHINFER_WORKSPACE_BASE=/tmp/fi PYTHONUNBUFFERED=1 \\
    python3 benchmarks/bench_decode.py --grid paper --check --kernel-time --out $OUT 2>&1 | tee $OUT/bench_decode.log

Other runs: ``--grid axes`` (the four K/V axis combinations), ``--grid quick`` (a smoke run),
``--shapes 8:128K,64:32K``, ``--bits 2``, ``--kernels foscar_folded flashinfer_tc``,
``--cuda-graph`` (time graph replays; fails for a call that synchronizes with the host).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from foscar import KVFormat, QuantKVCache, decode_exact, quantize_kv
from foscar.bench import as_graph, cache_to, make_block_table, one_head_cache, random_cache, rel_l2
from foscar.bench.common import int_in, parse_heads, parse_tokens, positive_float, to_csv, writable_dir
from foscar.bench import time_call as time_fn
from foscar.errors import UnsupportedError
from foscar.progress import Progress
from foscar.reference import attend
from foscar.synthetic import stress_inputs

# ---------------------------------------------------------------------------------------------
# The problem and the grids
# ---------------------------------------------------------------------------------------------
HQ, HKV, HEAD_DIM, GROUP, PAGE = 32, 8, 128, 128, 64
GQA = HQ // HKV
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
KI = 1024
MIB, GIB = 2 ** 20, 2 ** 30
DEVICE = "cuda"  # where everything timed lives (the CPU test of the driver swaps it)

TOKEN, CHANNEL = "token", "channel"
TOKEN_AXES = ((TOKEN, TOKEN),)
AXIS_COMBOS = ((TOKEN, TOKEN), (TOKEN, CHANNEL), (CHANNEL, TOKEN), (CHANNEL, CHANNEL))
PAPER_SHAPES = tuple([(b, n * KI) for b in (1, 8) for n in (8, 32, 128, 512)]
                     + [(64, n * KI) for n in (8, 16, 32, 64, 128)])
AXES_SHAPES = tuple((b, n * KI) for b in (1, 8) for n in (32, 128))
QUICK_SHAPES = ((1, 8 * KI), (4, 16 * KI))
GRIDS = {"paper": (PAPER_SHAPES, TOKEN_AXES), "axes": (AXES_SHAPES, AXIS_COMBOS), "quick": (QUICK_SHAPES, TOKEN_AXES)}
#: Every length is a multiple of this: whole pages, and whole channel-wise groups (no BF16 tail).
LENGTH_QUANTUM = max(PAGE, GROUP)

BF16_BYTES_PER_TOKEN = 2 * HEAD_DIM * 2  # K and V, per KV head
FLUSH_BYTES = 512 * MIB
FI_WORKSPACE_BYTES = 256 * MIB
BASELINE = "flashinfer_tc"
SLEEP_CYCLES = 100_000_000  # ~50-70 ms of GPU sleep at 1.4-2 GHz (host-sync detector)
SYNC_THRESHOLD_S = 0.02
CHECK_LENS = (4096, 2500, 777)  # --check: ragged, not page multiples
CHECK_FACTOR = 1.5  # --check: foscar error <= this x BF16 attention's
SHAPE_FACTOR = 3.0  # per-shape slice check: loose, it catches indexing/layout bugs (errors of order 1)

# Bars of the issue
READ_BARS = {4: 0.40, 2: 0.25}  # fraction of the read ceiling, B in {8, 64}, L >= 32K
GEOMEAN_BARS = {4: 1.4, 2: 1.6}  # geomean speedup over FlashInfer BF16 (tensor cores), paper grid
FOLD_VS_RECON_BAR = (8, 128 * KI, 2, 1.1)  # B, L, bits, min reconstruct_us / folded_us


@dataclass(frozen=True)
class Case:
    """One timed configuration of the quantized kernels (the BF16 kernels depend on B and L only)."""

    batch: int
    seq_len: int
    bits: int
    k_axis: str = TOKEN
    v_axis: str = TOKEN

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch, self.seq_len

    def fmt(self) -> KVFormat:
        return KVFormat(self.bits, HEAD_DIM, GROUP, self.k_axis, self.v_axis)


def parse_length(text: str) -> int:
    """``"128K"`` -> 131072, ``"1M"`` -> 1048576, ``"4096"`` -> 4096."""
    value = parse_tokens(text)
    if value <= 0 or value % LENGTH_QUANTUM:
        raise argparse.ArgumentTypeError(f"length {text!r}: expected a positive multiple of {LENGTH_QUANTUM}")
    return value


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:8K,64:128K"`` -> ((1, 8192), (64, 131072))."""
    shapes = []
    for item in text.split(","):
        b, sep, n = item.partition(":")
        if not sep or not b.strip().isdigit() or int(b) <= 0:
            raise argparse.ArgumentTypeError(f"shape {item!r}: expected B:L, e.g. 8:128K")
        shapes.append((int(b), parse_length(n)))
    return tuple(shapes)


def build_grid(grid: str, bits: tuple[int, ...], shapes: tuple[tuple[int, int], ...] | None = None) -> list[Case]:
    """The cases of a grid, shape-major (so each shape's BF16 data is built once)."""
    grid_shapes, axes = GRIDS[grid]
    return [Case(b, n, nb, ka, va) for b, n in (shapes or grid_shapes) for nb in bits for ka, va in axes]


def group_by_shape(cases: list[Case]) -> dict[tuple[int, int], list[Case]]:
    groups: dict[tuple[int, int], list[Case]] = {}
    for c in cases:
        groups.setdefault(c.shape, []).append(c)
    return groups


def fmt_len(n: int) -> str:
    return f"{n // KI}K" if n % KI == 0 else str(n)


# ---------------------------------------------------------------------------------------------
# Bytes, memory, statistics (pure)
# ---------------------------------------------------------------------------------------------
def kv_bytes_per_token(bits: int) -> float:
    """HBM bytes per token and KV head, K and V together: 512 for BF16 (bits=16), else foscar's format."""
    if bits == 16:
        return float(BF16_BYTES_PER_TOKEN)
    return KVFormat(bits, HEAD_DIM, GROUP).bytes_per_token()  # the same for every axis combination


def bytes_read(batch: int, seq_len: int, bits: int) -> int:
    """Bytes a decode must move: the KV cache once, plus q read and out written (BF16)."""
    q_and_out = 2 * batch * HQ * HEAD_DIM * 2
    return int(batch * seq_len * HKV * kv_bytes_per_token(bits)) + q_and_out


def peak_bytes(batch: int, seq_len: int, bits: tuple[int, ...], contiguous_copy: bool = False) -> int:
    """Device memory a shape needs at its peak (BF16 stage or quantized stage, never both at once);
    ``contiguous_copy``: a kernel of the BF16 stage also holds an unpaged copy of the cache (FA4)."""
    tokens = batch * seq_len * HKV
    one_head = seq_len * HEAD_DIM  # slice references: float64 copies of one (sequence, head)
    bf16_stage = (tokens * BF16_BYTES_PER_TOKEN * (2 if contiguous_copy else 1) + 2 * FI_WORKSPACE_BYTES
                  + 32 * one_head)
    params_tmp = 48 * tokens * (HEAD_DIM // GROUP)  # random (s', z') drawn in FP32, folded in FP64
    quant_stage = max(int(tokens * kv_bytes_per_token(b)) for b in bits) + params_tmp + 96 * one_head
    return max(bf16_stage, quant_stage) + FLUSH_BYTES


def plan_shapes(shapes: list[tuple[int, int]], bits: tuple[int, ...], budget_bytes: float,
                contiguous_copy: bool = False):
    """Split shapes into those that fit the memory budget and skipped ones (with the reason)."""
    run, skipped = [], []
    for b, n in shapes:
        need = peak_bytes(b, n, bits, contiguous_copy)
        if need > budget_bytes:
            reason = f"needs {need / 1e9:.1f} GB > budget {budget_bytes / 1e9:.1f} GB (--max-gb)"
            skipped.append({"B": b, "L": n, "reason": reason})
        else:
            run.append((b, n))
    return run, skipped


def geomean(values: list[float]) -> float | None:
    if not values:
        return None
    if any(v <= 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"geomean of non-positive or non-finite values: {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------
# Derived metrics, bars, Markdown (pure: they read records, lists of dicts)
# ---------------------------------------------------------------------------------------------
def annotate(records: list[dict], ceiling_tbps: float | None) -> None:
    """Add bytes, TB/s, fraction of the read ceiling and speedup over the baseline to timed records."""
    base = {(r["B"], r["L"]): r["median_us"] for r in records if r["kernel"] == BASELINE and r["status"] == "ok"}
    kbase = {(r["B"], r["L"]): r.get("kernel_us") for r in records if r["kernel"] == BASELINE and r["status"] == "ok"}
    for r in records:
        kb, kus = kbase.get((r["B"], r["L"])), r.get("kernel_us")
        r["kernel_speedup_vs_baseline"] = kb / kus if kb and kus else None
        r["bytes"] = bytes_read(r["B"], r["L"], r["bits"])
        us = r.get("median_us")
        timed = us is not None
        r["tbps"] = r["bytes"] / (us * 1e-6) / 1e12 if timed else None
        r["ceiling_frac"] = r["tbps"] / ceiling_tbps if timed and ceiling_tbps else None
        b = base.get((r["B"], r["L"]))
        r["speedup_vs_baseline"] = b / us if timed and b else None


def _select(records, kernel, bits=None, shapes=None, axes=(TOKEN, TOKEN)):
    return [r for r in records if r["kernel"] == kernel and r["status"] == "ok"
            and (bits is None or r["bits"] == bits)
            and (r["bits"] == 16 or (r["k_axis"], r["v_axis"]) == axes)
            and (shapes is None or (r["B"], r["L"]) in shapes)]


def geomean_speedup(records: list[dict], kernel: str, bits: int | None,
                    key: str = "speedup_vs_baseline") -> tuple[float | None, int]:
    """Geomean speedup over the baseline across the paper shapes measured; (value, shapes counted).
    ``key="kernel_speedup_vs_baseline"``: by profiled kernel time instead of event time."""
    rows = [r for r in _select(records, kernel, bits, PAPER_SHAPES) if r.get(key)]
    return geomean([r[key] for r in rows]), len(rows)


def _bar(name, target, value, ok, have, expected, worst=""):
    verdict = "n/a" if have == 0 else ("PASS" if ok else "FAIL")
    return {"bar": name, "target": target, "value": value, "verdict": verdict,
            "shapes": f"{have}/{expected}", "complete": have == expected, "detail": worst}


def evaluate_bars(records: list[dict]) -> list[dict]:
    """The issue's bars, over foscar_folded with token-wise K and V (partial grids say k/n shapes)."""
    bars = []
    for bits, target in sorted(READ_BARS.items(), reverse=True):
        shapes = [(b, n) for b, n in PAPER_SHAPES if b in (8, 64) and n >= 32 * KI]
        rows = [r for r in _select(records, "foscar_folded", bits, shapes) if r.get("ceiling_frac") is not None]
        worst = min(rows, key=lambda r: r["ceiling_frac"], default=None)
        value = worst["ceiling_frac"] if worst else None
        bars.append(_bar(f"INT{bits} read fraction, B in {{8, 64}}, L >= 32K (min)", f">= {target:.0%}", value,
                         worst is not None and value >= target, len(rows), len(shapes),
                         f"worst B={worst['B']} L={fmt_len(worst['L'])}" if worst else ""))
    for bits, target in sorted(GEOMEAN_BARS.items(), reverse=True):
        g, n = geomean_speedup(records, "foscar_folded", bits)
        bars.append(_bar(f"INT{bits} geomean speedup over FlashInfer BF16 (paper grid)", f">= {target}x", g,
                         g is not None and g >= target, n, len(PAPER_SHAPES)))
    b, n, bits, target = FOLD_VS_RECON_BAR
    fold = _select(records, "foscar_folded", bits, [(b, n)])
    recon = _select(records, "foscar_reconstruct", bits, [(b, n)])
    ratio = recon[0]["median_us"] / fold[0]["median_us"] if fold and recon else None
    bars.append(_bar(f"INT{bits} folded vs reconstruct, B={b} L={fmt_len(n)}", f">= {target}x", ratio,
                     ratio is not None and ratio >= target, int(ratio is not None), 1))
    return bars


def _num(x, spec=".1f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _cell(rec: dict | None) -> str:
    """A time cell: µs, then the profiled kernel time in parentheses if measured, '!' when the output
    failed its check; else the status word."""
    if rec is None:
        return "-"
    if rec.get("median_us") is None:
        return rec["status"].split(":")[0]
    kernel = f" ({rec['kernel_us']:.1f})" if rec.get("kernel_us") is not None else ""
    return f"{rec['median_us']:.1f}{kernel}" + ("" if rec["status"] == "ok" else "!")


PIVOT_BF16 = (("flashinfer_tc", "FI-tc µs"), ("flashinfer", "FI µs"), ("cudnn_sdpa", "cuDNN µs"),
              ("foscar_bf16", "fo-bf16 µs"), ("flashinfer_fp8", "FI-fp8 µs"), ("flashinfer_nvfp4", "FI-nvfp4 µs"))


def render_pivot(records: list[dict], skipped: list[dict]) -> str:
    """One row per (B, L, bits, axes): folded and reconstruct, then the BF16 kernels of that shape."""
    index = {(r["B"], r["L"], r["bits"], r["k_axis"], r["v_axis"], r["kernel"]): r for r in records}
    rows = sorted({(r["B"], r["L"], r["bits"], r["k_axis"], r["v_axis"]) for r in records if r["bits"] != 16},
                  key=lambda k: (k[0], k[1], k[2], AXIS_COMBOS.index((k[3], k[4]))))
    head = ["B", "L", "bits", "K/V", "folded µs", "% ceil", "× FI-tc", "recon µs", "recon/folded"]
    head += [label for _, label in PIVOT_BF16]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, n, bits, ka, va in rows:
        fold = index.get((b, n, bits, ka, va, "foscar_folded"))
        recon = index.get((b, n, bits, ka, va, "foscar_reconstruct"))
        ratio = (recon["median_us"] / fold["median_us"] if fold and recon and fold.get("median_us")
                 and recon.get("median_us") else None)
        cells = [str(b), fmt_len(n), f"INT{bits}", f"{ka[:3]}/{va[:3]}", _cell(fold),
                 _num(fold and fold.get("ceiling_frac"), ".0%"),
                 _num(fold and fold.get("speedup_vs_baseline"), ".2f", "x"),
                 _cell(recon), _num(ratio, ".2f", "x")]
        cells += [_cell(index.get((b, n, 16, None, None, k))) for k, _ in PIVOT_BF16]
        lines.append("| " + " | ".join(cells) + " |")
    for s in skipped:
        lines.append(f"| {s['B']} | {fmt_len(s['L'])} | skipped: {s['reason']} |")
    return "\n".join(lines)


def render_records(records: list[dict]) -> str:
    head = ["B", "L", "bits", "K/V", "kernel", "status", "median µs", "min µs", "kernel µs", "TB/s", "% ceil",
            "× FI-tc", "slice err", "err / BF16-attn err", "host sync"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        axes = "-" if r["bits"] == 16 else f"{r['k_axis'][:3]}/{r['v_axis'][:3]}"
        cells = [str(r["B"]), fmt_len(r["L"]), "BF16" if r["bits"] == 16 else f"INT{r['bits']}", axes, r["kernel"],
                 r["status"], _num(r.get("median_us")), _num(r.get("min_us")), _num(r.get("kernel_us")),
                 _num(r.get("tbps"), ".2f"), _num(r.get("ceiling_frac"), ".0%"),
                 _num(r.get("speedup_vs_baseline"), ".2f", "x"), _num(r.get("err"), ".2e"),
                 _num(r.get("err_ratio"), ".2f"), {True: "yes", False: "no"}.get(r.get("host_sync"), "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_checks(checks: list[dict]) -> str:
    head = ["bits", "K/V", "kernel", "status", "err vs exact", "BF16-attn err", "ratio (<= 1.5)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in checks:
        lines.append("| " + " | ".join([f"INT{c['bits']}", f"{c['k_axis'][:3]}/{c['v_axis'][:3]}", c["kernel"],
                                        c["status"], _num(c.get("err"), ".2e"), _num(c.get("bf16_err"), ".2e"),
                                        _num(c.get("ratio"), ".2f")]) + " |")
    return "\n".join(lines)


def render_summary(result: dict) -> str:
    records = result["records"]
    lines = []
    cl = result.get("ceiling") or {}
    lines.append(f"Read ceiling: {_num(cl.get('tbps'), '.2f', ' TB/s')} ({cl.get('source', 'not measured')}); "
                 f"GPU {result['meta'].get('gpu', '?')}; timing: {result['meta'].get('timing', '?')}.")
    geo = []
    for kernel in ("foscar_folded", "foscar_reconstruct"):
        for bits in sorted({r["bits"] for r in records if r["bits"] != 16}):
            g, n = geomean_speedup(records, kernel, bits)
            geo.append(f"{kernel} INT{bits} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
    for kernel, _ in PIVOT_BF16[1:]:
        g, n = geomean_speedup(records, kernel, None)
        geo.append(f"{kernel} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
    lines.append("Geomean speedup over FlashInfer BF16 (tensor cores), paper shapes: " + "; ".join(geo) + ".")
    if any(r.get("kernel_us") is not None for r in records):
        kgeo = []
        for bits in sorted({r["bits"] for r in records if r["bits"] != 16}):
            g, n = geomean_speedup(records, "foscar_folded", bits, "kernel_speedup_vs_baseline")
            kgeo.append(f"foscar_folded INT{bits} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
        lines.append("The same by profiled kernel time (no host gaps; not what the bars use): "
                     + "; ".join(kgeo) + ".")
    lines.append("")
    lines.append("| bar | target | value | verdict | shapes | note |")
    lines.append("|---|---|---|---|---|---|")
    for b in result["bars"]:
        v = b["value"]
        value = "-" if v is None else (f"{v:.0%}" if "fraction" in b["bar"] else f"{v:.2f}x")
        lines.append(f"| {b['bar']} | {b['target']} | {value} | {b['verdict']} | {b['shapes']} | {b['detail']} |")
    problems = problem_lines(result)
    if problems:
        lines.append("")
        lines += problems
    return "\n".join(lines)


def problem_lines(result: dict) -> list[str]:
    """Everything that was not measured or not right, one line each (missing kernels once per reason)."""
    out, seen = [], set()
    for r in result["records"] + result.get("checks", []):
        status = r["status"]
        if status in ("ok", "pass"):
            continue
        where = f"B={r['B']} L={fmt_len(r['L'])} " if "B" in r else "check "
        where += "" if r["bits"] == 16 else f"INT{r['bits']} {r['k_axis'][:3]}/{r['v_axis'][:3]} "
        if status.startswith("missing"):
            if (r["kernel"], status) in seen:
                continue
            seen.add((r["kernel"], status))
            where = ""
        out.append(f"- {r['kernel']}: {where}{status}")
    for kernel in sorted({r["kernel"] for r in result["records"] if r.get("host_sync")}):
        out.append(f"- note: {kernel} waits for the GPU inside the call (host sync): its event times include a "
                   "launch gap, its profiled kernel times (--kernel-time) do not")
    for kernel, why in dict.fromkeys((r["kernel"], r["kernel_time_error"]) for r in result["records"]
                                     if r.get("kernel_time_error")):
        out.append(f"- note: {kernel}: no profiled kernel time: {why}")
    for s in result.get("skipped", []):
        out.append(f"- skipped B={s['B']} L={fmt_len(s['L'])}: {s['reason']}")
    for f in result.get("fatal", []):
        out.append(f"- FATAL: {f}")
    return out


def render_markdown(result: dict, detailed: bool = False) -> str:
    parts = ["## foscar decode benchmark", ""]
    if result.get("checks"):
        parts += ["### --check (small ragged caches vs decode_exact)", "", render_checks(result["checks"]), ""]
    parts += ["### Times (µs, median; (x) = profiled GPU kernel time; ! = output failed its check)", "",
              render_pivot(result["records"], result["skipped"]), "", render_summary(result)]
    if detailed:
        parts += ["", "### Every record", "", render_records(result["records"]), "",
                  f"Command: `{result['meta'].get('command', '')}`"]
    return "\n".join(parts) + "\n"


def failures(result: dict) -> list[str]:
    """What makes the run exit 1: wrong outputs, kernel errors, failed checks, a lost CUDA context."""
    bad = [f"{r['kernel']}: {r['status']}" for r in result["records"] + result.get("checks", [])
           if r["status"].startswith(("wrong", "error", "FAIL", "not run"))]
    return bad + list(result.get("fatal", []))


# ---------------------------------------------------------------------------------------------
# Kernels: one builder per name; a builder returns a Runner or raises KernelMissing
# ---------------------------------------------------------------------------------------------
class KernelMissing(Exception):
    """The kernel is not there (not installed, not written, not supported): reported, never skipped."""


@dataclass
class Runner:
    fn: Callable[[], object]  # the timed call
    out: torch.Tensor | None = None  # the NaN-poisoned buffer it writes; None: check what fn returns
    to_bhd: Callable[[torch.Tensor], torch.Tensor] = lambda o: o  # its output as [B, Hq, D]
    keep: tuple = ()  # objects that must outlive the runner (workspaces, wrappers)
    judged: str | None = None  # why the output is not held to the slice check (a lossy or random-code peer)

    def output(self, returned) -> torch.Tensor:
        return self.to_bhd(self.out if self.out is not None else returned)


@dataclass
class Bf16Inputs:
    q: torch.Tensor  # [B, Hq, D] bf16
    k_cache: torch.Tensor  # [pages, PAGE, Hkv, D] bf16 (FlashInfer NHD)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, pages per sequence]
    seq_lens: torch.Tensor  # int32 [B]


@dataclass
class QuantInputs:
    q: torch.Tensor
    cache: QuantKVCache


def _foscar_triton(name: str):
    try:
        import foscar.triton as ft
    except Exception as e:
        raise KernelMissing(f"import foscar.triton failed: {type(e).__name__}: {e}") from e
    fn = getattr(ft, name, None)
    if fn is None:
        raise KernelMissing(f"foscar.triton has no {name}()")
    return fn


def _flashinfer():
    try:
        import flashinfer
    except Exception as e:
        raise KernelMissing(f"import flashinfer failed: {type(e).__name__}: {e}") from e
    return flashinfer


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _quant_runner(decode: Callable, inp: QuantInputs, args, **kw) -> Runner:
    """A foscar decode over the quantized cache into a NaN-poisoned ``out`` (``--num-splits`` passed on)."""
    out = _nan_like(inp.q)
    kw["out"] = out
    if args.num_splits is not None:
        kw["num_splits"] = args.num_splits
    return Runner(lambda: decode(inp.q, inp.cache, **kw), out)


def build_foscar_quant(kernel: str):
    def build(inp: QuantInputs, args) -> Runner:
        return _quant_runner(_foscar_triton("decode"), inp, args, kernel=kernel)
    return build


def build_foscar_cute(warp_specialized: bool):
    def build(inp: QuantInputs, args) -> Runner:
        """The CuTe DSL sm_90a kernel (issue 4), v0 or v1; missing where cutlass-dsl is not installed."""
        try:
            from foscar.cute.launch import decode
        except ImportError as e:
            raise KernelMissing(f"import foscar.cute.launch failed: {type(e).__name__}: {e}") from e
        return _quant_runner(decode, inp, args, warp_specialized=warp_specialized)
    return build


def build_foscar_auto(inp: QuantInputs, args) -> Runner:
    """What a user's call runs: ``foscar.decode`` with the backend, variant and launch config it picks."""
    import foscar
    return _quant_runner(foscar.decode, inp, args)


def build_foscar_bf16(inp: Bf16Inputs, args) -> Runner:
    """decode_bf16 takes ``[pages, Hkv, page, D]`` and reads strides: the NHD pages FlashInfer reads, as a view."""
    decode_bf16 = _foscar_triton("decode_bf16")
    out = _nan_like(inp.q)
    k, v = (c.permute(0, 2, 1, 3) for c in (inp.k_cache, inp.v_cache))
    return Runner(lambda: decode_bf16(inp.q, k, v, inp.block_table, inp.seq_lens, out=out), out)


def build_flashinfer(tensor_cores: bool):
    def build(inp: Bf16Inputs, args) -> Runner:
        fi = _flashinfer()
        B, pages = inp.block_table.shape
        dev = inp.q.device
        ws = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
        last_page_len = torch.full((B,), PAGE, dtype=torch.int32, device=dev)  # lengths are page multiples
        wrapper.plan(indptr, inp.block_table.reshape(-1).contiguous(), last_page_len, HQ, HKV, HEAD_DIM, PAGE,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = _nan_like(inp.q)
        kv = (inp.k_cache, inp.v_cache)
        return Runner(lambda: wrapper.run(inp.q, kv, out=out), out, keep=(ws, wrapper, indptr, last_page_len))
    return build


def build_flashinfer_lowbit(kind: str):
    """FlashInfer's low-bit KV decode, the peers of the paper's comparison: FP8 (e4m3) KV on tensor cores,
    and NVFP4 KV (the fa2 backend; 72 bytes per token and KV head per tensor, exactly what foscar INT4
    with g = 128 and FP32 scale and offset stores). FP8 holds the benchmark's BF16 values rounded to
    e4m3; NVFP4 random codes and scales (timing only). Their outputs are not held to BF16 attention's error."""
    def build(inp: Bf16Inputs, args) -> Runner:
        fi = _flashinfer()
        B, pages = inp.block_table.shape
        dev = inp.q.device
        ws = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
        last_page_len = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
        indices = inp.block_table.reshape(-1).contiguous()
        out = _nan_like(inp.q)
        if kind == "fp8":
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            wrapper.plan(indptr, indices, last_page_len, HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.float8_e4m3fn)
            kv = (inp.k_cache.to(torch.float8_e4m3fn), inp.v_cache.to(torch.float8_e4m3fn))
            return Runner(lambda: wrapper.run(inp.q, kv, out=out), out, keep=(ws, wrapper, kv),
                          judged="FP8 e4m3 KV: lossy, not held to BF16 attention's error")
        n = inp.k_cache.shape[0]
        codes = [torch.randint(0, 256, (n, PAGE, HKV, HEAD_DIM // 2), dtype=torch.uint8, device=dev) for _ in range(2)]
        sfs = [(torch.rand(n, PAGE, HKV, HEAD_DIM // 16, device=dev) + 0.5).to(torch.float8_e4m3fn) for _ in range(2)]
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa2")
        wrapper.plan(indptr, indices, last_page_len, HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                     kv_data_type=torch.uint8)
        return Runner(lambda: wrapper.run(inp.q, tuple(codes), kv_cache_sf=tuple(sfs), out=out), out,
                      keep=(ws, wrapper, codes, sfs), judged="NVFP4 KV with random codes: timing only")
    return build


def build_cudnn_sdpa(inp: Bf16Inputs, args) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if backend is None:
        raise KernelMissing("this torch has no SDPBackend.CUDNN_ATTENTION")
    B = inp.q.shape[0]
    q4 = inp.q.unsqueeze(2)  # [B, Hq, 1, D]
    k4, v4 = (c.view(B, -1, HKV, HEAD_DIM).transpose(1, 2) for c in (inp.k_cache, inp.v_cache))  # [B, Hkv, L, D]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
    return Runner(run, None, to_bhd=lambda o: o.squeeze(2))


def build_fa4(inp: Bf16Inputs, args) -> Runner:
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``, needs cutlass-dsl) over an unpaged copy of
    the BF16 cache (``[B, L, Hkv, D]``, gathered through the block table once, not timed): it takes no
    page table and does not split the KV sequence on sm_90."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        raise KernelMissing(f"import flash_attn.cute failed: {type(e).__name__}: {e}") from e
    B = inp.q.shape[0]
    k, v = (c[inp.block_table.long()].reshape(B, -1, HKV, HEAD_DIM) for c in (inp.k_cache, inp.v_cache))
    q = inp.q.unsqueeze(1)  # [B, 1, Hq, D]
    return Runner(lambda: flash_attn_func(q, k, v), None,
                  to_bhd=lambda o: (o[0] if isinstance(o, tuple) else o).squeeze(1), keep=(k, v))


def _foscar_unavailable(e: BaseException) -> bool:
    return isinstance(e, (NotImplementedError, UnsupportedError))


def _cudnn_unavailable(e: BaseException) -> bool:
    """torch's "no kernel can run this" (CUDA: "No available kernel", CPU: "No viable backend")."""
    return isinstance(e, RuntimeError) and ("No available kernel" in str(e) or "No viable backend" in str(e))


@dataclass(frozen=True)
class KernelSpec:
    name: str
    family: str  # "quant" (reads the foscar cache) or "bf16" (reads the BF16 paged cache)
    build: Callable
    unavailable: Callable[[BaseException], bool] = lambda e: False  # first-call errors that mean "missing"
    default: bool = True  # timed unless --kernels says otherwise


KERNELS = {s.name: s for s in (
    KernelSpec("foscar_folded", "quant", build_foscar_quant("folded"), _foscar_unavailable),
    KernelSpec("foscar_reconstruct", "quant", build_foscar_quant("reconstruct"), _foscar_unavailable),
    KernelSpec("foscar_cute", "quant", build_foscar_cute(False), _foscar_unavailable, default=False),  # v0: opt-in
    KernelSpec("foscar_cute_ws", "quant", build_foscar_cute(True), _foscar_unavailable, default=False),  # v1
    KernelSpec("foscar_auto", "quant", build_foscar_auto, _foscar_unavailable, default=False),
    KernelSpec("foscar_bf16", "bf16", build_foscar_bf16, _foscar_unavailable),
    KernelSpec("flashinfer_tc", "bf16", build_flashinfer(True)),
    KernelSpec("flashinfer", "bf16", build_flashinfer(False)),
    KernelSpec("cudnn_sdpa", "bf16", build_cudnn_sdpa, _cudnn_unavailable),
    KernelSpec("flashinfer_fp8", "bf16", build_flashinfer_lowbit("fp8"), default=False),
    KernelSpec("flashinfer_nvfp4", "bf16", build_flashinfer_lowbit("nvfp4"), default=False),
    KernelSpec("fa4", "bf16", build_fa4, default=False),
)}


# ---------------------------------------------------------------------------------------------
# Inputs: random BF16 paged KV, random packed foscar caches, moving and slicing caches
# ---------------------------------------------------------------------------------------------
def make_bf16_inputs(q: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> Bf16Inputs:
    B, pages = block_table.shape
    shape = (B * pages, PAGE, HKV, HEAD_DIM)
    k = torch.randn(shape, dtype=torch.bfloat16, device=q.device)
    v = torch.randn(shape, dtype=torch.bfloat16, device=q.device)
    return Bf16Inputs(q, k, v, block_table, torch.full((B,), seq_len, dtype=torch.int32, device=q.device))


def make_random_cache(case: Case, block_table: torch.Tensor) -> QuantKVCache:
    """A full foscar cache of the benchmark's shape, random packed codes and ``(s', z')``
    (:func:`foscar.bench.random_cache`)."""
    return random_cache(case.fmt(), block_table, case.seq_len, kv_heads=HKV, page=PAGE)


# ---------------------------------------------------------------------------------------------
# References and output checks
# ---------------------------------------------------------------------------------------------
@dataclass
class SliceRef:
    """Float64 attention of query heads ``h*G..(h+1)*G`` of sequence ``b`` (one KV head), and the
    error BF16 attention makes on it: the scale a kernel's error is judged on."""

    b: int
    h: int
    exact: torch.Tensor  # [G, D] float64
    bf16_err: float


def slice_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, h: int) -> SliceRef:
    """``k, v [n, D]``: the tokens of sequence ``b``, KV head ``h`` (any order, any float dtype)."""
    rows = q[b, h * GQA: (h + 1) * GQA][None]
    exact = attend(rows.double(), k[None].double(), v[None].double(), SM_SCALE)[0][0]
    bf16 = attend(rows.float(), k[None], v[None], SM_SCALE, operand_dtype=torch.bfloat16)[0][0]
    return SliceRef(b, h, exact, rel_l2(bf16, exact))


def bf16_slice_reference(inp: Bf16Inputs) -> SliceRef:
    b, h = inp.q.shape[0] - 1, HKV - 1  # the last sequence and head: offset bugs show there
    pages = inp.block_table[b].long()
    k, v = (c[pages, :, h].reshape(-1, HEAD_DIM) for c in (inp.k_cache, inp.v_cache))
    return slice_reference(inp.q, k, v, b, h)


def quant_slice_reference(inp: QuantInputs) -> SliceRef:
    b, h = inp.q.shape[0] - 1, HKV - 1
    k, v = one_head_cache(inp.cache, b, h).dequantize(torch.float64)
    n = int(inp.cache.seq_lens[b])
    return slice_reference(inp.q, k[0, 0, :n], v[0, 0, :n], b, h)


def check_output(out: torch.Tensor, ref: SliceRef, factor: float) -> dict:
    """All of ``out [B, Hq, D]`` finite (it was NaN-poisoned), and its slice within ``factor`` x BF16's error."""
    nonfinite = int((~torch.isfinite(out)).sum())
    err = rel_l2(out[ref.b, ref.h * GQA: (ref.h + 1) * GQA], ref.exact)
    ratio = err / ref.bf16_err if ref.bf16_err > 0 else math.inf
    why = []
    if nonfinite:
        why.append(f"{nonfinite} non-finite outputs (unwritten or NaN)")
    if not ratio <= factor:
        why.append(f"slice error {err:.2e} is {ratio:.1f}x BF16 attention's {ref.bf16_err:.2e} (limit {factor}x)")
    return {"nonfinite": nonfinite, "err": err, "bf16_err": ref.bf16_err, "err_ratio": ratio,
            "status": "ok" if not why else "wrong: " + "; ".join(why)}


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def kernel_time_fn(fn: Callable[[], object], *, iters: int, flush: torch.Tensor) -> dict:
    """GPU time of the kernels one call launches, summed (CUPTI through torch.profiler), L2 flushed before each.

    Unlike the event time it leaves out host gaps inside the call (a decode that synchronizes with the
    host). One profiler session per call, the flush outside it, so every kernel seen is the call's.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sums, spans, count = [], [], 0
    for _ in range(iters):
        flush.zero_()
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


_READ_KERNEL = None


def read_kernel():
    """A Triton kernel that reads ``chunk`` int32 per program in 16-byte vectors and writes their XOR."""
    global _READ_KERNEL
    if _READ_KERNEL is None:
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

        _READ_KERNEL = read_xor
    return _READ_KERNEL


def xor_reduce(t: torch.Tensor) -> int:
    """XOR of all elements of a 1-D integer tensor whose length is a power of two."""
    while t.numel() > 1:
        t = t[0::2] ^ t[1::2]
    return int(t[0])


def read_rates(x: torch.Tensor, args, flush: torch.Tensor) -> dict:
    """Streaming-read rates over ``x`` (int32, whole 1 MiB chunks): the Triton reader, checked, and torch.sum."""
    chunk, block = 2 ** 18, 4096
    n = x.numel()
    res: dict = {"bytes": n * 4}
    try:
        kernel, programs = read_kernel(), n // chunk
        partial = torch.empty(programs, dtype=torch.int32, device=x.device)
        fn = lambda: kernel[(programs,)](x, partial, chunk, BLOCK=block, num_warps=8)
        fn()
        for p in (0, programs - 1):
            want = xor_reduce(x[p * chunk: (p + 1) * chunk])
            if int(partial[p]) != want:
                raise RuntimeError(f"read kernel: program {p} gave {int(partial[p])}, expected {want}")
        t = time_fn(fn, iters=max(args.iters, 10), warmup=args.warmup, flush=flush)
        res["triton"] = {**t, "tbps": n * 4 / (t["median_us"] * 1e-6) / 1e12}
    except Exception as e:
        res["triton_error"] = _short(e)
    t = time_fn(lambda: torch.sum(x), iters=max(args.iters, 10), warmup=args.warmup, flush=flush)
    res["torch_sum"] = {**t, "tbps": n * 4 / (t["median_us"] * 1e-6) / 1e12}
    best = max((k for k in ("triton", "torch_sum") if k in res), key=lambda k: res[k]["tbps"])
    res["tbps"], res["source"] = res[best]["tbps"], f"{best}, {n * 4 / GIB:.3g} GiB"
    return res


def measure_read_ceiling(gib: float, args, flush: torch.Tensor) -> dict:
    """The read ceiling: the best streaming-read rate over ``gib`` GiB of random int32 (freed after)."""
    n = int(gib * GIB) // 4 // 2 ** 18 * 2 ** 18
    x = torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int32, device=DEVICE)
    res = read_rates(x, args, flush)
    del x
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# Running kernels
# ---------------------------------------------------------------------------------------------
def cuda_alive() -> bool:
    """False when an earlier error left the CUDA context unusable (illegal address and the like)."""
    try:
        torch.cuda.synchronize()
        return int(torch.ones(1, device=DEVICE).sum()) == 1
    except Exception:
        return False


def measure(spec: KernelSpec, inputs, ref: SliceRef | None, args, flush: torch.Tensor) -> dict:
    """Build, call once (poisoned output), check, then time one kernel. Returns the record's fields."""
    try:
        runner = spec.build(inputs, args)
    except KernelMissing as e:
        return {"status": f"missing: {e}"}
    except Exception as e:
        return {"status": f"error: building: {_short(e)}"}
    try:
        t0 = time.perf_counter()
        returned = runner.fn()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0  # compiles (JIT) on a configuration's first call
    except Exception as e:
        return {"status": f"missing: {_short(e)}" if spec.unavailable(e) else f"error: first call: {_short(e)}"}
    if runner.judged is not None:  # timed as a peer, its output not held to BF16 attention's error
        out = runner.output(returned)
        fields = {"status": "ok", "note": runner.judged, "nonfinite": int((~torch.isfinite(out)).sum())}
    else:
        fields = check_output(runner.output(returned), ref, args.shape_factor) if ref is not None else {"status": "ok"}
    fields["first_call_s"] = first_call_s
    try:
        fields["host_sync"] = syncs_with_host(runner.fn)
        fn = as_graph(runner.fn) if args.cuda_graph else runner.fn
        fields.update(time_fn(fn, iters=args.iters, warmup=args.warmup, flush=flush))
    except Exception as e:
        fields["status"] = f"error: timing: {_short(e)}"
        return fields
    if args.kernel_time:
        try:
            fields.update(kernel_time_fn(runner.fn, iters=args.iters, flush=flush))
        except Exception as e:
            fields["kernel_time_error"] = _short(e)
    return fields


def new_record(shape, bits, axes, kernel) -> dict:
    return {"B": shape[0], "L": shape[1], "Hq": HQ, "Hkv": HKV, "bits": bits, "k_axis": axes[0], "v_axis": axes[1],
            "kernel": kernel, "status": "not run"}


def set_heads(q_heads: int, kv_heads: int) -> None:
    """The problem's head counts (``--heads``; the paper's 32/8 by default), for the head-ratio sweep of the
    paper's Fig. 15. Module-wide, like the other problem constants: one run, one head configuration."""
    global HQ, HKV, GQA
    if kv_heads < 1 or q_heads < kv_heads or q_heads % kv_heads:
        raise ValueError(f"heads {q_heads}:{kv_heads}: Hq must be a positive multiple of Hkv")
    HQ, HKV, GQA = q_heads, kv_heads, q_heads // kv_heads


def _stage_inputs(case: Case | None, q: torch.Tensor, block_table: torch.Tensor):
    """(inputs, slice reference) of one stage: the BF16 kernels (case None) or one quantized case."""
    if case is None:
        inputs = make_bf16_inputs(q, block_table, block_table.shape[1] * PAGE)
        return inputs, bf16_slice_reference(inputs)
    inputs = QuantInputs(q, make_random_cache(case, block_table))
    return inputs, quant_slice_reference(inputs)


def run_shape(shape, cases, kernels, args, flush, block_table, records: list[dict]) -> None:
    """All kernels of one shape, appended to ``records``: the BF16 stage, then each quantized case.

    Each stage's data is freed before the next. Raises (after recording) when the CUDA context is lost.
    """
    q = torch.randn(shape[0], HQ, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    stages = [(None, [k for k in kernels if KERNELS[k].family == "bf16"])]
    stages += [(c, [k for k in kernels if KERNELS[k].family == "quant"]) for c in cases]
    for case, names in stages:
        if not names:
            continue
        bits, axes = (16, (None, None)) if case is None else (case.bits, (case.k_axis, case.v_axis))
        try:
            inputs, ref = _stage_inputs(case, q, block_table)
        except Exception as e:
            inputs = ref = None
            failed = f"error: building inputs: {_short(e)}"
        else:
            failed = None
        for name in names:
            rec = new_record(shape, bits, axes, name)
            rec.update({"status": failed} if failed else measure(KERNELS[name], inputs, ref, args, flush))
            rec["timing"] = "cuda-graph" if args.cuda_graph else "eager"
            records.append(rec)
            if rec["status"].startswith("error") and not cuda_alive():
                raise RuntimeError(f"CUDA context lost after {name} at B={shape[0]} L={shape[1]}: {rec['status']}")
        del inputs, ref
        torch.cuda.empty_cache()


def run_exact_check(bits: int, axes: tuple[str, str], kernels: list[str], args) -> list[dict]:
    """--check: foscar kernels vs decode_exact (float64, CPU) on a small ragged quantize_kv cache."""
    fmt = KVFormat(bits, HEAD_DIM, GROUP, *axes)
    lens = torch.tensor(CHECK_LENS, dtype=torch.int32)
    q, k, v = stress_inputs(len(CHECK_LENS), HQ, HKV, max(CHECK_LENS), HEAD_DIM, seed=args.seed + bits)
    q = q.to(torch.bfloat16)
    cache = quantize_kv(k, v, fmt, seq_lens=lens, page_size=PAGE)
    exact = decode_exact(q, cache)
    kd, vd = cache.dequantize(torch.float64)
    bf16 = torch.stack([attend(q[b].float().reshape(HKV, GQA, HEAD_DIM), kd[b, :, :n], vd[b, :, :n], SM_SCALE,
                               operand_dtype=torch.bfloat16)[0].reshape(HQ, HEAD_DIM)
                        for b, n in enumerate(CHECK_LENS)])
    bf16_err = rel_l2(bf16, exact)
    inputs = QuantInputs(q.to(DEVICE), cache_to(cache, DEVICE))
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
            status = f"missing: {_short(e)}" if KERNELS[name].unavailable(e) else f"FAIL: {_short(e)}"
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


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def device_meta(args, argv: list[str], prog: str = "python3 -m foscar.bench.decode") -> dict:
    import triton
    try:
        fi_version = _flashinfer().__version__
    except KernelMissing as e:
        fi_version = f"missing: {e}"
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
            "memory_gb": props.total_memory / 1e9, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "triton": triton.__version__, "flashinfer": fi_version,
            "command": f"{prog} {shlex.join(argv)}".strip(), "argv": argv, "args": vars(args),
            "timing": ("CUDA-graph replay" if args.cuda_graph else "eager calls")
            + f", L2 flushed ({FLUSH_BYTES // MIB} MiB), median of {args.iters} after {args.warmup} warm-up",
            "page_order": args.page_order, "problem": {"Hq": HQ, "Hkv": HKV, "D": HEAD_DIM, "g": GROUP, "page": PAGE},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_outputs(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    annotate(result["records"], (result.get("ceiling") or {}).get("tbps"))
    result["bars"] = evaluate_bars(result["records"])
    result["failures"] = failures(result)
    for name, text in (("bench_decode.json", json.dumps(result, indent=1, default=str)),
                       ("bench_decode.md", render_markdown(result, detailed=True)),
                       ("bench_decode.csv", records_csv(result["records"]))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)


CSV_COLUMNS = ("B", "L", "Hq", "Hkv", "bits", "k_axis", "v_axis", "kernel", "status", "median_us", "min_us",
               "tbps", "ceiling_frac", "speedup_vs_baseline", "err", "bf16_err", "err_ratio", "first_call_s",
               "host_sync", "timing")


def records_csv(records: list[dict]) -> str:
    """One row per record (its scalar fields, :data:`CSV_COLUMNS`), for spreadsheets and pandas."""
    return to_csv(records, CSV_COLUMNS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


DESCRIPTION = (
    "Time foscar's decode kernels over INT2 and INT4 KV caches against FlashInfer BF16 and cuDNN SDPA on this GPU, "
    "per shape of a grid (--grid) or of --shapes: the L2 flushed before each call, CUDA events around it, the "
    "median of --iters calls after --warmup, and the streaming-read ceiling. Every kernel's output is checked "
    "against a float64 reference on one slice of the timed shape; a kernel that is not installed is reported as "
    "missing, and a wrong output, a failed --check or a kernel error exits with status 1. It writes "
    "bench_decode.json, .md and .csv under --out and prints a Markdown table. It needs a CUDA GPU.")
PROG = "python3 -m foscar.bench.decode"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The options, each checked by its argparse type while the arguments are parsed."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog="Kernels: " + ", ".join(KERNELS) + f". Baseline for speedups: {BASELINE}.")
    p.add_argument("--grid", choices=sorted(GRIDS), default="paper",
                   help="paper: 13 shapes, token-wise K/V; axes: B {1,8} x L {32K,128K} x 4 K/V axis combinations; "
                        "quick: 2 small shapes (default: paper)")
    p.add_argument("--shapes", type=parse_shapes, default=None, metavar="B:L,...",
                   help=f"B:L,B:L (L may end in K or M, a multiple of {LENGTH_QUANTUM}); replaces the grid's shapes, "
                        "keeps its axis combinations")
    p.add_argument("--bits", type=int, nargs="+", choices=(2, 4), default=[2, 4],
                   help="code widths of the quantized kernels (default: 2 4)")
    defaults = [k for k, s in KERNELS.items() if s.default]
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=defaults, metavar="KERNEL",
                   help=f"kernels to time, of those listed below (default: {' '.join(defaults)})")
    p.add_argument("--iters", type=int_in(5, want="an integer >= 5 (the median of >= 5 timed calls)"), default=5,
                   help="timed calls per kernel, at least 5 (the median; default: 5)")
    p.add_argument("--warmup", type=int_in(1), default=5,
                   help="untimed calls per kernel first, at least 1 (default: 5)")
    p.add_argument("--out", type=writable_dir, default=os.environ.get("OUT") or "/tmp", metavar="DIR",
                   help="folder of the output files, made if missing (default: $OUT, else /tmp)")
    p.add_argument("--max-gb", type=positive_float, default=None,
                   help="skip (and report) shapes needing more device memory (default: free memory - 4 GB)")
    p.add_argument("--check", action="store_true",
                   help="first hold foscar kernels to decode_exact on small ragged caches (exit 1 on failure)")
    p.add_argument("--num-splits", type=int_in(1), default=None,
                   help="passed to foscar.triton.decode, at least 1 (default: its own)")
    p.add_argument("--heads", type=parse_heads, default="32:8", metavar="HQ:HKV",
                   help="query and KV heads, Hq a positive multiple of Hkv (default: 32:8); the head-ratio sweep "
                        "(paper Fig. 15) runs one --heads per invocation and `foscar bench plot` joins them")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays of each call")
    p.add_argument("--kernel-time", action="store_true",
                   help="also sum each call's GPU kernel times with the profiler (leaves out host gaps)")
    p.add_argument("--page-order", choices=("shuffled", "identity"), default="shuffled",
                   help="pages of each sequence in its own pool range, shuffled (default) or in order")
    p.add_argument("--ceiling-gib", type=positive_float, default=8.0,
                   help="GiB of the buffer read to measure the read ceiling (default: 8)")
    p.add_argument("--shape-factor", type=positive_float, default=SHAPE_FACTOR,
                   help=f"per-shape slice check: error at most this x BF16 attention's (default: {SHAPE_FACTOR:g})")
    p.add_argument("--seed", type=int_in(-2 ** 63, 2 ** 63 - 1, "an integer in [-2**63, 2**63)"), default=0,
                   help="seed of the random inputs; shape i draws from seed + i (default: 0)")
    return p


def parse_args(argv=None, prog: str = PROG) -> argparse.Namespace:
    args = build_parser(prog).parse_args(argv)
    args.bits = tuple(sorted(set(args.bits)))
    args.kernels = list(dict.fromkeys(args.kernels))
    set_heads(*args.heads)
    return args


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the benchmark; ``prog`` is how it was invoked (its usage and error lines, and recorded with the
    arguments in the JSON)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    if not torch.cuda.is_available():
        log(f"{prog}: error: needs a CUDA GPU (no CUDA device here): it times GPU kernels")
        return 1
    cases = build_grid(args.grid, args.bits, args.shapes)
    result = {"meta": device_meta(args, argv, prog), "ceiling": None, "checks": [], "records": [], "skipped": [], "fatal": []}
    log(f"bench_decode: {result['meta']['gpu']}, torch {torch.__version__}, flashinfer {result['meta']['flashinfer']}")
    quant = [k for k in args.kernels if KERNELS[k].family == "quant"]
    if args.check and quant:
        for bits, axes in dict.fromkeys((c.bits, (c.k_axis, c.v_axis)) for c in cases):
            result["checks"] += run_exact_check(bits, axes, quant, args)
            log(f"check INT{bits} {axes}: "
                + ", ".join(f"{c['kernel']} {c['status']}" for c in result["checks"][-len(quant):]))
        if any(c["status"].startswith("FAIL") for c in result["checks"]):
            write_outputs(result, args.out)
            print(render_markdown(result))
            log("bench_decode: --check failed; not timing. " + "; ".join(failures(result)))
            return 1
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    result["ceiling"] = measure_read_ceiling(args.ceiling_gib, args, flush)
    log(f"read ceiling {result['ceiling']['tbps']:.2f} TB/s ({result['ceiling']['source']})")
    budget = args.max_gb * 1e9 if args.max_gb is not None else torch.cuda.mem_get_info()[0] - 4e9
    groups = group_by_shape(cases)
    shapes, result["skipped"] = plan_shapes(list(groups), args.bits, budget, contiguous_copy="fa4" in args.kernels)
    for s in result["skipped"]:
        log(f"skipping B={s['B']} L={s['L']}: {s['reason']}")
    bar = Progress(len(shapes))
    for i, shape in enumerate(shapes):
        t0, first = time.time(), len(result["records"])
        log(f"[{i + 1}/{len(shapes)}] B={shape[0]} L={fmt_len(shape[1])}: building and timing")
        torch.manual_seed(args.seed + i)
        table = make_block_table(shape[0], shape[1] // PAGE, args.page_order, args.seed + i).to(DEVICE)
        try:
            run_shape(shape, groups[shape], args.kernels, args, flush, table, result["records"])
        except Exception as e:
            result["fatal"].append(_short(e))
            result["skipped"] += [{"B": b, "L": n, "reason": "not run: the run ended (FATAL above)"}
                                  for b, n in shapes[i + 1:]]
            log(f"bench_decode: FATAL: {_short(e)}")
            break
        finally:
            write_outputs(result, args.out)
        done = ", ".join(f"{r['kernel']}{'' if r['bits'] == 16 else ' INT%d' % r['bits']} {_cell(r)}"
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


if __name__ == "__main__":
    sys.exit(main())
